"""The shared mean_pooling conformance suite with platform="triton", run in Triton's interpreter (collected
only by test_mean_pooling.py, in a pytest subprocess started with TRITON_INTERPRET=1: the variable has to
be set before triton is imported)."""

from __future__ import annotations

import os

import pytest

from ejkernel.testing.mean_pooling import MeanPoolingConformance

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (through test_mean_pooling.py)", allow_module_level=True)


class TestTritonMeanPoolingInterpreted(MeanPoolingConformance):
    platform = "triton"
