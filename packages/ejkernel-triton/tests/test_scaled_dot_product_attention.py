"""``scaled_dot_product_attention`` through the Triton flash kernels (``ThroughFlashAttention``), on a CPU-only
machine: the shared conformance suite in Triton's interpreter (pytest subprocess), and registration only in
the interpreter or with EJKERNEL_UNVERIFIED_KERNELS=1 until a GPU run has checked it. The GPU suite:
test_scaled_dot_product_attention_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ejkernel_triton import plugin

SUITE = Path(__file__).with_name("scaled_dot_product_attention_interpreter_suite.py")


def test_conformance_suite_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", "-rs"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=SUITE.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = int(proc.stdout.splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 6, proc.stdout[-2000:]  # only bias / mask cases may be refused


def test_registered_only_where_checked():
    assert "scaled_dot_product_attention" not in plugin.IMPLEMENTATIONS
    assert plugin.UNVERIFIED["scaled_dot_product_attention"] == (
        "ejkernel_triton.scaled_dot_product_attention:IMPLEMENTATION")
