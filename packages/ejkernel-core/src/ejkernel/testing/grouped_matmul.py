"""Reference and conformance suite of ``grouped_matmul`` (``docs/ops/grouped_matmul.md``).

A backend's test module subclasses :class:`GroupedMatmulConformance` and sets ``platform``::

    class TestXlaGroupedMatmul(GroupedMatmulConformance):
        platform = "xla"
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.numerics import exact_matmuls, Tolerance, check_against_reference, normal_array


@exact_matmuls
def reference_grouped_matmul(
    lhs,
    rhs,
    group_sizes,
    group_offset=None,
    existing_out=None,
    *,
    preferred_element_type=None,
    transpose_rhs=False,
    precision=None,
):
    """Dense and obvious: every row times every group's matrix, then keep the row's own group."""
    del precision
    weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    sizes = jnp.asarray(group_sizes)
    offset = 0 if group_offset is None else jnp.reshape(jnp.asarray(group_offset), ())
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(lhs.shape[0])
    products = jnp.einsum("mk,gkn->gmn", lhs, weights)  # [G, M, N]
    groups = offset + jnp.arange(weights.shape[0])
    owned = (rows[None, :] >= starts[groups][:, None]) & (rows[None, :] < ends[groups][:, None])  # [G, M]
    out = jnp.sum(jnp.where(owned[:, :, None], products, 0), axis=0)
    if existing_out is not None:
        out = jnp.where(owned.any(axis=0)[:, None], out, existing_out)
    out_dtype = jnp.float32 if preferred_element_type is None else preferred_element_type
    return out.astype(jnp.promote_types(out.dtype, out_dtype)) if out.dtype == jnp.float64 else out.astype(out_dtype)


# name -> (m, k, n, group_sizes, rhs groups held (None: all), group_offset)
CASES = {
    "even": (24, 16, 8, (8, 8, 8), None, None),
    "ragged_empty_groups": (37, 17, 9, (5, 0, 19, 0, 13), None, None),
    "rows_past_the_groups": (40, 8, 16, (3, 11, 1), None, None),
    "single_row_groups": (5, 4, 3, (1, 1, 1, 1, 1), None, None),
    "group_offset": (33, 12, 10, (4, 7, 0, 9, 6), 2, 1),
    "group_offset_last": (20, 8, 8, (6, 6, 6), 1, 2),
}


class GroupedMatmulConformance:
    """Test base: subclass and set ``platform`` (see the module docstring)."""

    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    compiler_options: ClassVar[Mapping[str, Any] | None] = None
    """XLA options for the compiled checks (``numerics.INTERPRET_COMPILER_OPTIONS`` for interpret-mode kernels)."""

    def call(self, *args, **kwargs):
        from ejkernel.modules import grouped_matmul

        return grouped_matmul(*args, **kwargs, platform=self.platform)

    def make_inputs(self, seed: int, case: str, dtype: Any, transpose_rhs=False, existing_out=False):
        m, k, n, sizes, held, offset = CASES[case]
        held = len(sizes) if held is None else held
        rhs_shape = (held, n, k) if transpose_rhs else (held, k, n)
        return dict(
            lhs=normal_array(seed * 10 + 0, (m, k), dtype),
            rhs=normal_array(seed * 10 + 1, rhs_shape, dtype),
            group_sizes=jnp.asarray(sizes, jnp.int32),
            group_offset=None if offset is None else jnp.asarray([offset], jnp.int32),
            existing_out=normal_array(seed * 10 + 2, (m, n), dtype) if existing_out else None,
        )

    def check(self, inputs, dtype, **static):
        wrt = ["lhs", "rhs"] + (["existing_out"] if inputs["existing_out"] is not None else [])
        fn = functools.partial(self._keyword_call, **static)
        reference = functools.partial(reference_grouped_matmul, **static)
        return check_against_reference(
            fn, reference, inputs, wrt, dtype=dtype, tolerances=self.tolerances, compiler_options=self.compiler_options
        )

    def _keyword_call(self, lhs, rhs, group_sizes, group_offset=None, existing_out=None, **static):
        return self.call(lhs, rhs, group_sizes, group_offset, existing_out, **static)

    # ---- numerics -----------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "case,dtype",
        [(case, "float32") for case in sorted(CASES)] + [("ragged_empty_groups", "bfloat16"), ("group_offset", "float16")],
    )
    def test_forward_and_gradients(self, case, dtype):
        inputs = self.make_inputs(1, case, dtype)
        self.check(inputs, jnp.dtype(dtype), preferred_element_type=jnp.dtype(dtype))

    @pytest.mark.parametrize("case", ["ragged_empty_groups", "group_offset"])
    def test_transpose_rhs(self, case):
        inputs = self.make_inputs(2, case, "float32", transpose_rhs=True)
        self.check(inputs, jnp.float32, preferred_element_type=jnp.float32, transpose_rhs=True)

    @pytest.mark.parametrize("case", ["rows_past_the_groups", "group_offset"])
    def test_existing_out_keeps_rows_not_computed(self, case):
        inputs = self.make_inputs(3, case, "float32", existing_out=True)
        self.check(inputs, jnp.float32, preferred_element_type=jnp.float32)

    def test_default_output_is_float32(self):
        inputs = self.make_inputs(4, "ragged_empty_groups", "bfloat16")
        out = self._keyword_call(**inputs)
        assert out.dtype == jnp.float32
        expected = reference_grouped_matmul(**inputs)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)

    def test_jit_with_traced_group_sizes(self):
        inputs = self.make_inputs(5, "group_offset", "float32", existing_out=True)
        fn = jax.jit(lambda lhs, rhs, sizes, offset, prev: self.call(lhs, rhs, sizes, offset, prev))
        out = fn(*inputs.values())
        np.testing.assert_allclose(out, reference_grouped_matmul(**inputs), rtol=1e-5, atol=1e-5)
        other = jnp.asarray((9, 0, 7, 3, 14), jnp.int32)  # same shapes, new values: no stale result
        out = fn(inputs["lhs"], inputs["rhs"], other, inputs["group_offset"], inputs["existing_out"])
        expected = reference_grouped_matmul(**{**inputs, "group_sizes": other})
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

    def test_grad_under_jit(self):
        inputs = self.make_inputs(6, "ragged_empty_groups", "float32")

        def loss(fn, lhs, rhs):
            return jnp.sum(fn(lhs, rhs, inputs["group_sizes"]) ** 2)

        got = jax.jit(jax.grad(functools.partial(loss, self.call), argnums=(0, 1)))(inputs["lhs"], inputs["rhs"])
        want = jax.grad(functools.partial(loss, reference_grouped_matmul), argnums=(0, 1))(inputs["lhs"], inputs["rhs"])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)

    # ---- bad inputs ---------------------------------------------------------------------------------

    def test_bad_inputs_raise_value_errors(self):
        good = self.make_inputs(7, "even", "float32")
        lhs, rhs, sizes = good["lhs"], good["rhs"], good["group_sizes"]
        cases = [
            ((lhs[None], rhs, sizes), {}, "lhs"),
            ((lhs, rhs[:, :-1], sizes), {}, "rhs"),
            ((lhs, rhs.astype(jnp.bfloat16), sizes), {}, "rhs"),
            ((lhs, rhs, sizes.astype(jnp.float32)), {}, "group_sizes"),
            ((lhs, rhs, sizes[:2]), {}, "group_sizes"),
            ((lhs, rhs, jnp.asarray([20, 10, 8], jnp.int32)), {}, "group_sizes"),
            ((lhs, rhs, jnp.asarray([9, -1, 8], jnp.int32)), {}, "group_sizes"),
            ((lhs, rhs[:2], sizes, jnp.asarray([2], jnp.int32)), {}, "group_offset"),
            ((lhs, rhs, sizes, None, jnp.zeros((24, 7))), {}, "existing_out"),
            ((lhs, rhs, sizes), {"transpose_rhs": True}, "rhs"),
            ((lhs, rhs, sizes), {"preferred_element_type": jnp.int32}, "preferred_element_type"),
            ((lhs, rhs, sizes), {"precision": "fast"}, "precision"),
        ]
        for args, kwargs, name in cases:
            with pytest.raises((ValueError, TypeError), match=name):
                self.call(*args, **kwargs)
