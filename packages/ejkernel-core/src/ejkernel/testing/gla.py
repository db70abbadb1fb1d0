"""Reference and conformance suite of ``gla_attention``: ``recurrent`` with the key-dimension gate only.

A backend's test module subclasses :class:`GLAConformance`, sets ``platform`` and ``chunk_config``
as for :class:`~ejkernel.testing.recurrent.RecurrentConformance`.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

from ejkernel.testing.numerics import assert_close, exact_matmuls
from ejkernel.testing.recurrent import RecurrentSuite, reference_recurrent


@exact_matmuls
def reference_gla(query, key, value, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, *,
                  softmax_scale=None, reverse=False):
    """The naive recurrence with ``a_t = g_t + g_gamma``."""
    return reference_recurrent(query, key, value, g=g, g_gamma=g_gamma, initial_state=initial_state,
                               cu_seqlens=cu_seqlens, softmax_scale=softmax_scale, reverse=reverse)


class GLAConformance(RecurrentSuite):
    """Test base: subclass and set ``platform``."""

    operation: ClassVar[str] = "gla_attention"
    reference = staticmethod(reference_gla)

    @pytest.mark.parametrize("shape,chunk_size", [("mha_17", None), ("varlen", 8)])
    def test_forward_and_gradients(self, shape, chunk_size):
        inputs = self.make_inputs(11, shape, "float32", gates=("g",), initial_state=shape != "mha_17")
        self.check(inputs, "float32", cfg=self.config(chunk_size))

    @pytest.mark.parametrize("shape", ["gqa_odd"])
    def test_bfloat16_reverse_with_g_gamma(self, shape):
        inputs = self.make_inputs(12, shape, "bfloat16", gates=("g", "g_gamma"), initial_state=True)
        self.check(inputs, "bfloat16", cfg=self.config(4), reverse=True)

    def test_jit_grad_varlen(self):
        inputs = self.make_inputs(13, "varlen", "bfloat16", gates=("g",))
        self.skip_if_refused(inputs)

        def loss(call, query, key, value, g):
            out, final = call(query=query, key=key, value=value, g=g, cu_seqlens=inputs["cu_seqlens"])
            return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(final**2)

        names = ("query", "key", "value", "g")
        got = jax.jit(jax.grad(functools.partial(loss, self.call), argnums=(0, 1, 2, 3)))(*(inputs[n] for n in names))
        f32 = [inputs[n].astype(jnp.float32) for n in names]
        want = jax.jit(jax.grad(functools.partial(loss, reference_gla), argnums=(0, 1, 2, 3)))(*f32)
        for name, a, b in zip(names, got, want):
            assert a.dtype == inputs[name].dtype
            assert_close(a, b, dtype=jnp.bfloat16, gradient=True, name=name, scale=2.0)

    def test_bad_gate_shape(self):
        inputs = self.make_inputs(14, "gqa_odd", "float32", gates=("g",))
        with pytest.raises((ValueError, TypeError), match="g"):
            self.call(**{**inputs, "g": inputs["g"][:, :, :2]})
        with pytest.raises((ValueError, TypeError), match="g_gamma"):
            self.call(**inputs, g_gamma=jnp.zeros((3,), jnp.float32))
