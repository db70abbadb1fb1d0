"""Reference and conformance suite of ``mean_pooling`` (see ``ejkernel.modules.operations.mean_pooling``).

A backend's test module subclasses :class:`MeanPoolingConformance` and sets ``platform``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.numerics import exact_matmuls, Tolerance, check_against_reference, normal_array


@exact_matmuls
def reference_mean_pooling(x, cu_seqlens=None, *, chunk_size=32):
    """Dense: a [num_seqs, total_tokens] membership matrix times x, over the lengths; empty -> zeros."""
    del chunk_size
    if cu_seqlens is None:
        return jnp.mean(x, axis=1)
    tokens = jnp.arange(x.shape[0])
    member = (tokens[None, :] >= cu_seqlens[:-1, None]) & (tokens[None, :] < cu_seqlens[1:, None])
    sums = jnp.tensordot(member.astype(x.dtype), x, axes=1)
    lengths = jnp.maximum(cu_seqlens[1:] - cu_seqlens[:-1], 1).astype(x.dtype)
    return sums / lengths.reshape((-1,) + (1,) * (x.ndim - 1))


# name -> (shape of x, cu_seqlens or None)
CASES = {
    "fixed_3d": ((3, 17, 24), None),
    "fixed_one_token": ((2, 1, 8), None),
    "fixed_heads": ((2, 33, 3, 16), None),
    "varlen": ((40, 16), (0, 7, 8, 27, 40)),
    "varlen_empty_and_padding": ((50, 8), (0, 0, 13, 13, 44)),
    "varlen_heads": ((29, 2, 8), (0, 1, 29)),
}


class MeanPoolingConformance:
    """Test base: subclass and set ``platform``."""

    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None

    def call(self, x, cu_seqlens=None, **kwargs):
        from ejkernel.modules import mean_pooling

        return mean_pooling(x, cu_seqlens=cu_seqlens, **kwargs, platform=self.platform)

    def make_inputs(self, seed, case, dtype):
        shape, bounds = CASES[case]
        x = normal_array(seed, shape, dtype)
        return dict(x=x, cu_seqlens=None if bounds is None else jnp.asarray(bounds, jnp.int32))

    @pytest.mark.parametrize(
        "case,dtype", [(case, "float32") for case in sorted(CASES)] + [("varlen", "bfloat16"), ("fixed_3d", "float16")]
    )
    def test_forward_and_gradient(self, case, dtype):
        inputs = self.make_inputs(1, case, dtype)
        check_against_reference(
            self.call, reference_mean_pooling, inputs, ["x"], dtype=jnp.dtype(dtype), tolerances=self.tolerances
        )

    def test_ignored_tokens_get_zero_gradient(self):
        inputs = self.make_inputs(2, "varlen_empty_and_padding", "float32")
        grad = jax.grad(lambda x: jnp.sum(self.call(x, inputs["cu_seqlens"])))(inputs["x"])
        np.testing.assert_array_equal(np.asarray(grad[44:]), 0.0)
        np.testing.assert_allclose(np.asarray(grad[:13]), 1.0 / 13, rtol=1e-6)

    def test_jit_with_traced_cu_seqlens(self):
        inputs = self.make_inputs(3, "varlen", "float32")
        fn = jax.jit(lambda x, cu: self.call(x, cu))
        for bounds in ((0, 7, 8, 27, 40), (0, 20, 20, 21, 33)):
            cu = jnp.asarray(bounds, jnp.int32)
            np.testing.assert_allclose(fn(inputs["x"], cu), reference_mean_pooling(inputs["x"], cu), rtol=1e-5, atol=1e-6)

    def test_vmap_over_independent_batches(self):
        x = normal_array(4, (3, 2, 9, 5))
        out = jax.vmap(lambda item: self.call(item))(x)
        np.testing.assert_allclose(out, jnp.mean(x, axis=2), rtol=1e-5, atol=1e-6)

    def test_bad_inputs_raise_value_errors(self):
        x = normal_array(5, (20, 4))
        cases = [
            ((x, jnp.asarray([0, 9, 5, 20], jnp.int32)), "cu_seqlens"),
            ((x, jnp.asarray([0, 9, 21], jnp.int32)), "cu_seqlens"),
            ((x, jnp.asarray([1, 9, 20], jnp.int32)), "cu_seqlens"),
            ((x, jnp.asarray([[0, 20]], jnp.int32)), "cu_seqlens"),
            ((x, jnp.asarray([0.0, 20.0])), "cu_seqlens"),
            ((x[0], None), "x"),
            ((x.astype(jnp.int32), None), "x"),
        ]
        for args, name in cases:
            with pytest.raises((ValueError, TypeError), match=name):
                self.call(*args)
        with pytest.raises(ValueError, match="chunk_size"):
            self.call(x[None], chunk_size=0)
