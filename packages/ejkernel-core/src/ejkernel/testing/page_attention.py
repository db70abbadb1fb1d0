"""Reference and conformance suite of ``page_attention`` (``docs/ops/page_attention.md``), plus the input
helpers of the paged suites (random lengths, block tables, sinks, page gathering).

A backend's test module subclasses :class:`PageAttentionConformance` and sets ``platform``::

    class TestXlaPageAttention(PageAttentionConformance):
        platform = "xla"
        cfg = None      # optional config of that implementation, used for every call

Forward-only backends set ``supports_gradients = False``: the gradient tests then check that taking a
gradient raises instead of returning something wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations.page_attention import PageAttention
from ejkernel.testing._attention_reference import masked_softmax_attention, soft_cap
from ejkernel.testing.quantized_cache import QuantizedCacheChecks, dequantized
from ejkernel.testing.numerics import (
    DTYPES,
    ConformanceSuite,
    assert_close,
    exact_matmuls,
    normal_array,
    run_jitted,
)

# ---- inputs of the paged suites --------------------------------------------------------------------


def random_lengths(seed: int, count: int, high: int, include: Sequence[int] = ()) -> np.ndarray:
    """``count`` lengths in ``[0, high]``, the first ones fixed to ``include`` (edge cases)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, high + 1, size=count)
    lengths[: len(include)] = np.minimum(np.asarray(include, dtype=np.int64)[:count], high)
    return lengths.astype(np.int32)


def random_block_tables(
    seed: int, num_seqs: int, max_blocks: int, num_blocks: int, lengths, block_size: int
) -> np.ndarray:
    """Each sequence gets distinct random pages (shuffled over the cache); entries past its last used
    page are -1, which implementations must tolerate."""
    rng = np.random.default_rng(seed)
    tables = np.full((num_seqs, max_blocks), -1, np.int32)
    for s in range(num_seqs):
        used = -(-int(lengths[s]) // block_size)
        tables[s, :used] = rng.choice(num_blocks, size=used, replace=False)
    return tables


def sinks_for(seed: int, heads: int, num_sinks: int | None) -> jax.Array | None:
    """Sink logits: None, ``[heads]`` (``num_sinks == 0``) or ``[heads, num_sinks]``."""
    if num_sinks is None:
        return None
    shape = (heads,) if num_sinks == 0 else (heads, num_sinks)
    return normal_array(seed, shape, jnp.float32)


def gather_pages(cache: jax.Array, tables: jax.Array, token_axis: int) -> jax.Array:
    """``cache[tables]`` with the page and in-page axes merged into one token axis; pages clamped (the
    references mask unread entries, whatever they hold)."""
    pages = cache[jnp.clip(tables, 0, cache.shape[0] - 1)]  # [S, P, ...]
    pages = jnp.moveaxis(pages, token_axis + 2, 2)  # [S, P, page_size, ...]
    return pages.reshape(pages.shape[0], -1, *pages.shape[3:])


# ---- the reference ---------------------------------------------------------------------------------


@exact_matmuls
def reference_page_attention(
    query,
    key_cache,
    value_cache,
    context_lens,
    block_tables,
    *,
    attn_scale=None,
    max_context_len=None,
    attn_logits_soft_cap=None,
    key_scale=None,
    value_scale=None,
):
    """Dense: gather every page of every sequence, repeat kv heads, masked softmax. Float64-ready; quantized
    caches are dequantized in the query's dtype (float64 in the suites)."""
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    key_cache = dequantized(key_cache, key_scale, query.dtype, kv_heads_axis=1)
    value_cache = dequantized(value_cache, value_scale, query.dtype, kv_heads_axis=1)
    scale = head_dim**-0.5 if attn_scale is None else attn_scale
    limit = block_tables.shape[1] * block_size if max_context_len is None else max_context_len
    group = num_heads // num_kv_heads
    keys = jnp.repeat(gather_pages(key_cache, block_tables, 1), group, axis=2)  # [S, T, H, D]
    values = jnp.repeat(gather_pages(value_cache, block_tables, 1), group, axis=2)
    logits = soft_cap(scale * jnp.einsum("shd,sthd->sht", query, keys), attn_logits_soft_cap)[:, :, None, :]
    lengths = jnp.minimum(jnp.asarray(context_lens), limit)
    visible = (jnp.arange(keys.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    out = masked_softmax_attention(logits, visible, values.transpose(0, 2, 1, 3))
    return out[:, :, 0, :].astype(query.dtype)


# ---- the suite -------------------------------------------------------------------------------------

# (num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks, lengths to include)
SHAPES = {
    "mha": (3, 4, 4, 32, 8, 16, 4, (17, 1, 32)),
    "gqa4_odd": (4, 8, 2, 64, 16, 24, 5, (0, 79, 1, 16)),
    "mqa": (2, 4, 1, 16, 4, 12, 6, (23, 5)),
    "long": (2, 2, 1, 32, 16, 80, 64, (1000, 127)),
}


class PageAttentionConformance(ConformanceSuite, QuantizedCacheChecks):
    """Test base: subclass and set ``platform`` (see the module docstring)."""

    operation_type: ClassVar[type] = PageAttention
    public_name = "page_attention"

    def make_inputs(self, seed, shape, dtype, *, scale=1.0):
        num_seqs, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks, include = shape
        lengths = random_lengths(seed, num_seqs, max_blocks * block_size, include)
        return dict(
            query=normal_array(seed * 3, (num_seqs, heads, head_dim), dtype, scale),
            key_cache=normal_array(seed * 3 + 1, (num_blocks, kv_heads, block_size, head_dim), dtype),
            value_cache=normal_array(seed * 3 + 2, (num_blocks, kv_heads, block_size, head_dim), dtype),
            context_lens=jnp.asarray(lengths),
            block_tables=jnp.asarray(random_block_tables(seed, num_seqs, max_blocks, num_blocks, lengths, block_size)),
        )

    def check(self, inputs, dtype, scale=1.0, **static):
        wrt = ("query", "key_cache", "value_cache")
        self.check_call(reference_page_attention, inputs, wrt, dtype, scale=scale, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        self.check(self.make_inputs(1, SHAPES["gqa4_odd"], dtype), dtype)

    def test_mha(self):
        self.check(self.make_inputs(2, SHAPES["mha"], "float32"), "float32")

    def test_long_context_soft_cap_scale_and_max_context_len(self):
        inputs = self.make_inputs(3, SHAPES["long"], "float32", scale=4.0)
        self.check(inputs, "float32", attn_scale=0.3, attn_logits_soft_cap=5.0, max_context_len=700)

    def test_large_logits(self):
        inputs = self.make_inputs(4, SHAPES["mha"], "float32", scale=40.0)
        self.check(inputs, "float32")

    def test_empty_sequences_give_zeros(self):
        inputs = self.make_inputs(5, SHAPES["mha"], "float32")
        inputs["context_lens"] = inputs["context_lens"].at[1:].set(0)
        out = self.assert_rows_are_zero(inputs, slice(1, None), wrt=("query",))
        assert np.abs(np.asarray(out[0])).sum() > 0

    def test_jit_and_vmap(self):
        inputs = self.make_inputs(6, SHAPES["gqa4_odd"], "float32")
        jitted = jax.jit(lambda **kw: self.call(**kw))(**inputs)
        assert_close(jitted, run_jitted(reference_page_attention, **inputs), dtype="float32")
        # vmap over a stack of query sets sharing one cache
        queries = jnp.stack([inputs["query"], inputs["query"][::-1] * 0.5])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "query": q})))(queries)
        expected = run_jitted(jax.vmap(lambda q: reference_page_attention(**{**inputs, "query": q})), queries)
        assert_close(batched, expected, dtype="float32")

    quantized_names = ("key_cache", "value_cache")
    kv_heads_axis = 1
    paged = True

    def quantized_base_inputs(self, query_dtype):
        return self.make_inputs(8, SHAPES["gqa4_odd"], query_dtype)

    def quantized_reference(self):
        return reference_page_attention

    def test_bad_inputs(self):
        inputs = self.make_inputs(7, SHAPES["gqa4_odd"], "float32")
        self.assert_rejected("query", **{**inputs, "query": inputs["query"][0]})
        # 3 kv heads do not divide 8
        three_kv_heads = {k: inputs[k][:, :1].repeat(3, 1) for k in ("key_cache", "value_cache")}
        self.assert_rejected("key_cache", **{**inputs, **three_kv_heads})
        self.assert_rejected("value_cache", **{**inputs, "value_cache": inputs["value_cache"].astype(jnp.bfloat16)})
        self.assert_rejected("context_lens", **{**inputs, "context_lens": inputs["context_lens"][:2]})
        self.assert_rejected("context_lens", **{**inputs, "context_lens": inputs["context_lens"].at[0].set(-1)})
        # a page that is read is out of range
        # a page id that is read and out of range: the error names the entry and its value (tail entries past a
        # sequence's last page hold -1 in every case of this suite and are accepted)
        self.assert_rejected(r"block_tables\[1, 0\] = 10000",
                             **{**inputs, "block_tables": inputs["block_tables"].at[1, 0].set(10_000)})
        self.assert_rejected("attn_scale", **inputs, attn_scale=float("nan"))
        self.assert_rejected("attn_logits_soft_cap", **inputs, attn_logits_soft_cap=-1.0)
        self.assert_rejected("precision", **inputs, precision="fastest")
        self.assert_rejected("value_cache", **{**inputs, "key_cache": inputs["key_cache"].astype(jnp.int8)})
        self.assert_rejected("key_scale", **inputs, key_scale=jnp.ones((3,), jnp.float32))
        self.assert_rejected("value_scale", **inputs, value_scale=jnp.full((2,), jnp.nan, jnp.float32))
