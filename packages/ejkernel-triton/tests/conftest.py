"""The Triton package's tests import their helpers (`interpreter_support`, `gpu_support`) from this folder
(pytest runs with --import-mode=importlib, which puts no test folder on sys.path)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
