"""Kernel numerics on the CPU through Triton's interpreter (fp32 and fp16, tiny shapes).

The cases live in interpreter_cases.py and run in one subprocess (TRITON_INTERPRET=1 has to be set
before triton is imported, which this pytest process has already done without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES_SCRIPT = Path(__file__).with_name("interpreter_cases.py")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(CASES_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["name"]] = row
    return results


def _case_names():
    import ast

    tree = ast.parse(CASES_SCRIPT.read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and getattr(node, "targets", [None])[0] is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if getattr(target, "id", None) == "CASES":
                return [k.value for k in node.value.keys]
    raise AssertionError("CASES not found")


@pytest.mark.parametrize("name", _case_names())
def test_interpreter_case_matches_reference(interpreter_results, name):
    row = interpreter_results[name]
    assert row["finite"], row
    tol = TOLERANCE[row["dtype"]]
    for quantity in ("out", "dq", "dk", "dv", "d_aux"):
        assert row[quantity] <= tol, (quantity, row)
    if "masked_rows_zero" in row:
        assert row["masked_rows_zero"], row
    assert row["tma_kernels"] == (["fwd"] if name == "hopper_tma_forward" else []), row
