"""Kernel numerics on the CPU through Triton's interpreter (fp32 and fp16, tiny shapes).

The cases live in interpreter_cases.py and run in one subprocess (``interpreter_support``: TRITON_INTERPRET=1
has to be set before triton is imported, which this pytest process has already done without it).
"""

from __future__ import annotations

from pathlib import Path

from interpreter_support import case_row_fixture

CASES_SCRIPT = Path(__file__).with_name("interpreter_cases.py")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}

interpreter_results, case_row = case_row_fixture(CASES_SCRIPT)


def test_interpreter_case_matches_reference(case_row):
    name, row = case_row
    assert row["finite"], row
    tol = TOLERANCE[row["dtype"]]
    for quantity in ("out", "dq", "dk", "dv", "d_aux"):
        assert row[quantity] <= tol, (quantity, row)
    if "masked_rows_zero" in row:
        assert row["masked_rows_zero"], row
    assert row["tma_kernels"] == (["fwd"] if name == "hopper_tma_forward" else []), row
