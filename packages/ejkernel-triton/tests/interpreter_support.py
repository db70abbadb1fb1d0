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


def assert_forward_only_row(row: dict, tolerance: float) -> None:
    """The checks every forward-only (serving) case shares: finite output within ``tolerance`` of the
    reference, and a gradient request refused (these kernels have no backward)."""
    assert row["finite"] and row["out"] <= tolerance, row
    assert row.get("gradient", "refused") == "refused", row
