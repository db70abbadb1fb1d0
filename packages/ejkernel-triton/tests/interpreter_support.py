"""Run a file of Triton interpreter cases in a fresh process and read its rows (shared by the tests of every
Triton kernel family): the interpreter must be switched on before triton is imported, which this pytest
process has already done without it. Also :data:`CUDA_LOWERING`, the mark of the tests that lower kernels
for sm_90 on a CPU-only machine.

A cases file defines ``CASES = {name: ...}`` and prints one JSON object per case (with ``"name"``) on stdout.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CUDA_LOWERING = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None and importlib.util.find_spec("jax_cuda13_plugin") is None,
    reason="needs jax-cuda13-plugin to lower for CUDA on the CPU")


def run_interpreter_suite(suite: Path, timeout: float = 900, *options: str) -> str:
    """Run a pytest file of shared conformance suites in Triton's interpreter (a fresh process with
    TRITON_INTERPRET=1): asserts it passed and returns pytest's output."""
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", *options],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=suite.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-1000:]
    return proc.stdout


def run_cases(script: Path, timeout: float = 600) -> dict[str, dict]:
    """Every case's row, by name (the subprocess runs on the CPU with TRITON_INTERPRET=1)."""
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    return {row["name"]: row for row in rows}


def case_names(script: Path) -> list[str]:
    """The keys of the file's ``CASES`` dict, read without importing it (for test parametrization)."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CASES":
            return [key.value for key in node.value.keys]
    raise AssertionError(f"CASES not found in {script}")


def case_row_fixture(script: Path):
    """A pytest fixture for a test module (assign it to a module-level name, e.g. ``case_row``): one
    parametrization per case of ``script``, giving ``(name, row)``; the script runs once per module."""

    @pytest.fixture(scope="module")
    def interpreter_results():
        return run_cases(script)

    @pytest.fixture(params=case_names(script), ids=str)
    def case_row(request, interpreter_results):
        return request.param, interpreter_results[request.param]

    return interpreter_results, case_row


# ---- used inside the cases files (the interpreter process): imports that load triton stay in the functions


def compile_for_hopper(hopper: bool) -> None:
    """Make the launcher compile for sm_90 (where a config can take the TMA kernels), or for the GPU it finds."""
    from ejkernel_triton import launch

    if hopper:
        os.environ[launch.COMPUTE_CAPABILITY_ENV] = "90"
    else:
        os.environ.pop(launch.COMPUTE_CAPABILITY_ENV, None)


def random_qkv(keys, *, lead: tuple, b: int, sq: int, skv: int, h: int, hkv: int, d: int, dv: int, dtype):
    """Standard normal q ``[*lead, b, sq, h, d]``, k ``[*lead, b, skv, hkv, d]``, v ``[*lead, b, skv, hkv, dv]``
    from ``keys[0]``, ``keys[1]``, ``keys[2]``, drawn in float32 and cast to ``dtype``."""
    import jax
    import jax.numpy as jnp

    q = jax.random.normal(keys[0], (*lead, b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (*lead, b, skv, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (*lead, b, skv, hkv, dv), jnp.float32).astype(dtype)
    return q, k, v


def gradient_outcome(take_gradient) -> str:
    """``"returned"`` when ``take_gradient()`` runs, ``"refused"`` when it raises ``UnsupportedFeature`` (what
    a forward-only kernel must do rather than return a wrong gradient)."""
    from ejkernel import UnsupportedFeature

    try:
        take_gradient()
    except UnsupportedFeature:
        return "refused"
    return "returned"


def print_row(row: dict, started: float) -> None:
    """Print a case's row, with the seconds since ``started``, as the JSON line :func:`run_cases` reads."""
    row["seconds"] = round(time.time() - started, 2)
    print(json.dumps(row), flush=True)


def assert_forward_only_row(row: dict, tolerance: float) -> None:
    """The checks every forward-only (serving) case shares: finite output within ``tolerance`` of the
    reference, and a gradient request refused (these kernels have no backward)."""
    assert row["finite"] and row["out"] <= tolerance, row
    assert row.get("gradient", "refused") == "refused", row
