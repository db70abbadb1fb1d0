"""Reference and conformance suite of ``ragged_page_attention`` (``docs/ops/ragged_page_attention.md``).

Subclass :class:`RaggedPageAttentionConformance` and set ``platform``; the other knobs (``cfg``,
``supports_gradients``, ...) are :class:`~ejkernel.testing.numerics.ConformanceSuite`'s.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttention
from ejkernel.testing._attention_reference import masked_softmax_attention, soft_cap
from ejkernel.testing.numerics import (
    DTYPES,
    ConformanceSuite,
    assert_close,
    exact_matmuls,
    normal_array,
    run_jitted,
)
from ejkernel.testing.page_attention import gather_pages, random_block_tables, sinks_for
from ejkernel.testing.quantized_cache import QuantizedCacheChecks, dequantized


@exact_matmuls
def reference_ragged_page_attention(
    queries,
    kv_pages,
    context_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    softmax_aux=None,
    *,
    softmax_scale=None,
    logits_soft_cap=None,
    sliding_window=None,
    key_scale=None,
    value_scale=None,
):
    """Dense: every row gathers its whole sequence's cache; masks written out literally. Float64-ready; quantized
    caches are dequantized in the queries' dtype (float64 in the suites)."""
    total_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = kv_pages.shape[2] // 2
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    starts = jnp.asarray(query_start_loc)
    lengths = jnp.asarray(context_lens)
    active_count = jnp.reshape(jnp.asarray(num_seqs), (-1,))[0]

    rows = jnp.arange(total_tokens)
    sequence = jnp.clip(jnp.searchsorted(starts[1:], rows, side="right"), 0, lengths.shape[0] - 1)
    q_len = starts[sequence + 1] - starts[sequence]
    position = lengths[sequence] - q_len + rows - starts[sequence]
    live = rows < starts[active_count]

    def part(first, scale):  # keys (first = 0) or values (1) of every row's sequence: [T, L, H, D]
        pages = dequantized(kv_pages[:, :, first::2], scale, queries.dtype, kv_heads_axis=2)
        return jnp.repeat(gather_pages(pages, block_tables, 0)[sequence], group, axis=2)

    keys, values = part(0, key_scale), part(1, value_scale)
    logits = soft_cap(scale * jnp.einsum("thd,tlhd->thl", queries, keys), logits_soft_cap)[:, :, None, :]
    key_pos = jnp.arange(keys.shape[1])[None, :]
    visible = (key_pos < lengths[sequence][:, None]) & (key_pos <= position[:, None]) & live[:, None]
    if sliding_window is not None:
        visible &= position[:, None] - key_pos < sliding_window
    sinks = None if softmax_aux is None else jnp.reshape(softmax_aux, (num_heads, -1))
    out = masked_softmax_attention(logits, visible[:, None, None, :], values.transpose(0, 2, 1, 3), sinks)
    return out[:, :, 0, :].astype(queries.dtype)


# Each case: (num_q_heads, num_kv_heads, head_dim, page_size, [(q_len, kv_len) per active sequence],
# inactive slots, padding rows)
CASES = {
    "mixed_gqa": (4, 2, 32, 8, [(1, 17), (5, 5), (0, 9), (7, 40)], 1, 3),
    "decode_mha": (2, 2, 16, 4, [(1, 33), (1, 1), (1, 64)], 2, 0),
    "prefill_mqa": (4, 1, 64, 16, [(17, 17), (3, 30)], 0, 5),
}


class RaggedPageAttentionConformance(ConformanceSuite, QuantizedCacheChecks):
    """Test base: subclass and set ``platform``."""

    operation_type: ClassVar[type] = RaggedPageAttention
    public_name = "ragged_page_attention"

    def make_inputs(self, seed, case, dtype, *, scale=1.0, num_sinks=None):
        heads, kv_heads, head_dim, page_size, sequences, inactive, padding = case
        q_lens = np.array([q for q, _ in sequences] + [0] * inactive, np.int32)
        kv_lens = np.array([k for _, k in sequences] + [0] * inactive, np.int32)
        max_num_seqs = len(q_lens)
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        pages_per_seq = int(-(-kv_lens.max() // page_size)) + 1
        num_pages = max(pages_per_seq * max_num_seqs, 4)
        tables = random_block_tables(seed, max_num_seqs, pages_per_seq, num_pages, kv_lens, page_size)
        total = int(starts[-1]) + padding
        return dict(
            queries=normal_array(seed * 5, (total, heads, head_dim), dtype, scale),
            kv_pages=normal_array(seed * 5 + 1, (num_pages, page_size, 2 * kv_heads, head_dim), dtype),
            context_lens=jnp.asarray(kv_lens),
            block_tables=jnp.asarray(tables),
            query_start_loc=jnp.asarray(starts),
            num_seqs=jnp.asarray([len(sequences)], jnp.int32),
            softmax_aux=sinks_for(seed * 5 + 2, heads, num_sinks),
        )

    quantized_names = ("kv_pages",)
    kv_heads_axis = 2
    paged = True

    def num_kv_heads(self, cache_shape) -> int:
        return cache_shape[2] // 2  # keys and values interleaved

    def quantized_base_inputs(self, query_dtype):
        return self.make_inputs(8, CASES["mixed_gqa"], query_dtype)

    def quantized_reference(self):
        return reference_ragged_page_attention

    def check(self, inputs, dtype, **static):
        wrt = ("queries", "kv_pages") + (("softmax_aux",) if inputs["softmax_aux"] is not None else ())
        self.check_call(reference_ragged_page_attention, inputs, wrt, dtype, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        self.check(self.make_inputs(1, CASES["mixed_gqa"], dtype), dtype)

    @pytest.mark.parametrize("case", ["decode_mha", "prefill_mqa"])
    def test_batch_mixes(self, case):
        self.check(self.make_inputs(2, CASES[case], "float32"), "float32")

    def test_window_soft_cap_and_sinks(self):
        inputs = self.make_inputs(3, CASES["mixed_gqa"], "float32", scale=3.0, num_sinks=3)
        self.check(inputs, "float32", sliding_window=6, logits_soft_cap=4.0, softmax_scale=0.4)

    def test_large_logits(self):
        self.check(self.make_inputs(4, CASES["prefill_mqa"], "float32", scale=40.0), "float32")

    def test_padding_rows_are_zero(self):
        inputs = self.make_inputs(5, CASES["mixed_gqa"], "float32", num_sinks=0)
        used = int(inputs["query_start_loc"][int(inputs["num_seqs"][0])])
        self.assert_rows_are_zero(inputs, slice(used, None), wrt=("queries",))

    def test_num_seqs_as_int_jit_and_vmap(self):
        inputs = self.make_inputs(6, CASES["mixed_gqa"], "float32")
        expected = run_jitted(reference_ragged_page_attention, **inputs)
        as_int = run_jitted(self.call, **{**inputs, "num_seqs": int(inputs["num_seqs"][0])})
        assert_close(as_int, expected, dtype="float32")
        stacked = jnp.stack([inputs["queries"], -inputs["queries"]])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "queries": q})))(stacked)
        assert_close(
            batched[1],
            run_jitted(reference_ragged_page_attention, **{**inputs, "queries": stacked[1]}),
            dtype="float32",
        )
        assert_close(batched[0], expected, dtype="float32")

    def test_bad_inputs(self):
        inputs = self.make_inputs(7, CASES["mixed_gqa"], "float32")

        def call(match, **changes):
            self.assert_rejected(match, **{**inputs, **changes})

        call("queries", queries=inputs["queries"][0])
        # odd combined head count
        call("kv_pages", kv_pages=inputs["kv_pages"][:, :, :3])
        # 3 kv heads do not divide 4
        call("kv_pages", kv_pages=jnp.concatenate([inputs["kv_pages"]] * 3, axis=2)[:, :, :6])
        call("kv_pages", kv_pages=inputs["kv_pages"].astype(jnp.float16))
        # not monotone
        call("query_start_loc", query_start_loc=inputs["query_start_loc"].at[2].set(0))
        # more queries than cached tokens
        call("query_start_loc", context_lens=inputs["context_lens"].at[1].set(2))
        call("num_seqs", num_seqs=99)
        call("softmax_aux", softmax_aux=jnp.ones((3,), jnp.float32))
        self.assert_rejected("sliding_window", **inputs, sliding_window=0)
        call(r"block_tables\[0, 0\] = -5", block_tables=inputs["block_tables"].at[0, 0].set(-5))
        self.assert_rejected("softmax_scale", **inputs, softmax_scale="0.1")
        self.assert_rejected("logits_soft_cap", **inputs, logits_soft_cap=0.0)
        self.assert_rejected("precision", **inputs, precision="fastest")
