"""The CUDA package's tests import their helpers (`native_tools`) from this folder (pytest runs with
--import-mode=importlib, which puts no test folder on sys.path)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
