"""XLA ``grouped_matmul`` against the shared conformance suite, and its matmul precision."""

from __future__ import annotations

import jax
import pytest

from ejkernel.modules import grouped_matmul
from ejkernel.testing.grouped_matmul import GroupedMatmulConformance
from ejkernel.testing.numerics import matmul_precisions

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


class TestXlaGroupedMatmul(GroupedMatmulConformance):
    platform = "xla"


@pytest.mark.parametrize(
    "dtype,precision,expected",
    [("float32", None, HIGHEST), ("float32", "default", DEFAULT), ("float32", "high", jax.lax.Precision.HIGH),
     ("bfloat16", None, DEFAULT)],
)
@pytest.mark.parametrize("offset", [False, True], ids=["all-groups", "group_offset"])
def test_forward_and_backward_matmuls_run_at_the_precision(dtype, precision, expected, offset):
    """None means HIGHEST for float32 (TF32 on a GPU otherwise); d_lhs and d_rhs too."""
    suite = TestXlaGroupedMatmul()
    inputs = suite.make_inputs(8, "group_offset" if offset else "even", dtype)

    def loss(lhs, rhs):
        out = grouped_matmul(lhs, rhs, inputs["group_sizes"], inputs["group_offset"], precision=precision, platform="xla")
        return out.sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1)), inputs["lhs"], inputs["rhs"])
    assert len(found) == 3 and set(found) == {expected}, found  # forward, d_lhs, d_rhs
