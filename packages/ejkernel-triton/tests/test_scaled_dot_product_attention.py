"""``scaled_dot_product_attention`` through the Triton flash kernels (``ThroughFlashAttention``), on a CPU-only
machine: the shared conformance suite in Triton's interpreter (pytest subprocess), and registration only in
the interpreter or with EJKERNEL_UNVERIFIED_KERNELS=1 until a GPU run has checked it. The GPU suite:
test_scaled_dot_product_attention_gpu.py."""

from __future__ import annotations

from pathlib import Path

from interpreter_support import run_interpreter_suite

SUITE = Path(__file__).with_name("scaled_dot_product_attention_interpreter_suite.py")


def test_conformance_suite_in_the_interpreter():
    output = run_interpreter_suite(SUITE, 900, "-rs")
    passed = int(output.splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 6, output[-2000:]  # only bias / mask cases may be refused
