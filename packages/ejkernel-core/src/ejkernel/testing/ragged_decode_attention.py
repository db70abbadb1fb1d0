"""Reference and conformance suite of ``ragged_decode_attention`` (semantics: the module docstring of
``ejkernel.modules.operations.ragged_decode_attention``).

Subclass :class:`RaggedDecodeAttentionConformance` and set ``platform``; the other knobs (``cfg``,
``supports_gradients``, ...) are :class:`~ejkernel.testing.numerics.ConformanceSuite`'s.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules.operations.ragged_decode_attention import RaggedDecodeAttention
from ejkernel.testing._attention_reference import masked_softmax_attention, soft_cap
from ejkernel.testing.numerics import (
    DTYPES,
    ConformanceSuite,
    assert_close,
    exact_matmuls,
    normal_array,
    run_jitted,
)
from ejkernel.testing.page_attention import sinks_for
from ejkernel.testing.quantized_cache import QuantizedCacheChecks, dequantized


@exact_matmuls
def reference_ragged_decode_attention(
    query,
    key,
    value,
    sequence_start,
    sequence_end,
    softmax_aux=None,
    *,
    softmax_scale=None,
    sliding_window=None,
    logit_soft_cap=None,
    key_scale=None,
    value_scale=None,
):
    """Dense over the whole buffer with the range/window mask written out. Float64-ready; quantized buffers are
    dequantized in the query's dtype."""
    batch, num_heads, head_dim = query.shape
    key = dequantized(key, key_scale, query.dtype, kv_heads_axis=2)
    value = dequantized(value, value_scale, query.dtype, kv_heads_axis=2)
    group = num_heads // key.shape[2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    keys = jnp.repeat(key, group, axis=2)
    values = jnp.repeat(value, group, axis=2)
    logits = soft_cap(scale * jnp.einsum("bhd,bjhd->bhj", query, keys), logit_soft_cap)[:, :, None, :]
    j = jnp.arange(key.shape[1])[None, :]
    start, end = jnp.asarray(sequence_start)[:, None], jnp.asarray(sequence_end)[:, None]
    visible = (j >= start) & (j < end)
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        visible &= (j >= end - 1 - left) & (j <= end - 1 + right)
    sinks = None if softmax_aux is None else jnp.reshape(softmax_aux, (num_heads, -1))
    out = masked_softmax_attention(logits, visible[:, None, None, :], values.transpose(0, 2, 1, 3), sinks)
    return out[:, :, 0, :].astype(query.dtype)


# (batch, num_heads, num_kv_heads, head_dim, seq_len, [(start, end) per sequence])
CASES = {
    "gqa": (4, 8, 2, 32, 45, [(0, 45), (3, 20), (17, 18), (40, 41)]),
    "mha_odd": (3, 3, 3, 17, 127, [(0, 1), (5, 127), (60, 100)]),
    "mqa": (2, 4, 1, 64, 33, [(0, 33), (10, 30)]),
}


class RaggedDecodeAttentionConformance(ConformanceSuite, QuantizedCacheChecks):
    """Test base: subclass and set ``platform``."""

    operation_type: ClassVar[type] = RaggedDecodeAttention
    public_name = "ragged_decode_attention"
    quantized_names = ("key", "value")
    kv_heads_axis = 2

    def quantized_base_inputs(self, query_dtype):
        return self.make_inputs(8, CASES["gqa"], query_dtype)

    def quantized_reference(self):
        return reference_ragged_decode_attention

    def make_inputs(self, seed, case, dtype, *, scale=1.0, num_sinks=None):
        batch, heads, kv_heads, head_dim, seq_len, ranges = case
        return dict(
            query=normal_array(seed * 4, (batch, heads, head_dim), dtype, scale),
            key=normal_array(seed * 4 + 1, (batch, seq_len, kv_heads, head_dim), dtype),
            value=normal_array(seed * 4 + 2, (batch, seq_len, kv_heads, head_dim), dtype),
            sequence_start=jnp.asarray([s for s, _ in ranges], jnp.int32),
            sequence_end=jnp.asarray([e for _, e in ranges], jnp.int32),
            softmax_aux=sinks_for(seed * 4 + 3, heads, num_sinks),
        )

    def check(self, inputs, dtype, **static):
        wrt = ("query", "key", "value") + (("softmax_aux",) if inputs["softmax_aux"] is not None else ())
        self.check_call(reference_ragged_decode_attention, inputs, wrt, dtype, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        self.check(self.make_inputs(1, CASES["gqa"], dtype), dtype)

    def test_odd_head_dim_long_buffer(self):
        self.check(self.make_inputs(2, CASES["mha_odd"], "float32"), "float32")

    def test_window_soft_cap_and_sinks(self):
        inputs = self.make_inputs(3, CASES["mha_odd"], "float32", scale=3.0, num_sinks=2)
        self.check(inputs, "float32", sliding_window=(20, 0), logit_soft_cap=4.0, softmax_scale=0.3)

    def test_large_logits(self):
        self.check(self.make_inputs(4, CASES["gqa"], "float32", scale=40.0), "float32")

    def test_empty_ranges_give_zeros(self):
        inputs = self.make_inputs(5, CASES["gqa"], "float32", num_sinks=0)
        inputs["sequence_end"] = inputs["sequence_start"].at[0].set(45)  # rows 1..3: start == end
        inputs["sequence_start"] = inputs["sequence_start"].at[0].set(0)
        self.assert_rows_are_zero(inputs, slice(1, None), wrt=("query", "key"))

    def test_jit_and_vmap(self):
        inputs = self.make_inputs(6, CASES["mqa"], "float32")
        stacked = jnp.stack([inputs["query"], 2.0 * inputs["query"]])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "query": q})))(stacked)
        for i in range(2):
            expected = run_jitted(reference_ragged_decode_attention, **{**inputs, "query": stacked[i]})
            assert_close(batched[i], expected, dtype="float32")

    def test_bad_inputs(self):
        inputs = self.make_inputs(7, CASES["gqa"], "float32")

        def call(match, **changes):
            self.assert_rejected(match, **{**inputs, **changes})

        call("query", query=inputs["query"][None])
        # 3 kv heads do not divide 8
        call("key", key=inputs["key"][:, :, :1].repeat(3, 2), value=inputs["value"][:, :, :1].repeat(3, 2))
        call("value", value=inputs["value"].astype(jnp.bfloat16))
        call("sequence_end", sequence_end=inputs["sequence_end"][:2])
        call("sequence_end", sequence_end=inputs["sequence_end"].at[0].set(99))
        self.assert_rejected("sliding_window", **inputs, sliding_window=(-1, 2))
        call("softmax_aux", softmax_aux=jnp.ones((2, 8), jnp.float32))
        self.assert_rejected("softmax_scale", **inputs, softmax_scale=float("inf"))
        self.assert_rejected("logit_soft_cap", **inputs, logit_soft_cap=-2.0)
        self.assert_rejected("precision", **inputs, precision="fastest")
        call("value", key=inputs["key"].astype(jnp.int8))  # an int8 key needs an int8 value
        call("key_scale", key_scale=jnp.ones((inputs["key"].shape[0], 2), jnp.float32))  # no pages: per head only
