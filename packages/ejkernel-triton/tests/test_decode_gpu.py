"""GPU tests of the Triton decode kernels (run on the device: `pytest -m gpu`).

The shared conformance suites of page_attention and ragged_decode_attention with platform="triton" (the
heuristic config, and a config forcing several splits so that the combine kernel runs on every case), plus
bf16 serving shapes against a float32 reference: page sizes that do not divide the contexts, contexts of 0
and 1, block tables with unused (-1) tail entries, GQA ratios 1/4/8 and MQA, one split and many.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import page_attention, ragged_decode_attention
from ejkernel.testing.page_attention import PageAttentionConformance, random_block_tables, reference_page_attention
from ejkernel.testing.ragged_decode_attention import (
    RaggedDecodeAttentionConformance,
    reference_ragged_decode_attention,
)
from ejkernel_triton.decode import TritonDecodeConfig
from ejkernel.testing.numerics import relative_error
from gpu_support import GPU_ONLY, float32_reference

pytestmark = GPU_ONLY

SPLITS = TritonDecodeConfig(block_n=16, num_splits=4, prefetch=2)


class TestTritonPageAttentionConformance(PageAttentionConformance):
    platform = "triton"
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature


class TestTritonPageAttentionSplitsConformance(PageAttentionConformance):
    platform = "triton"
    supports_gradients = False
    cfg = SPLITS


class TestTritonPageAttentionInlineCombineConformance(PageAttentionConformance):
    """The last split merges (an atomic arrival counter): the memory ordering only a GPU can check."""

    platform = "triton"
    supports_gradients = False
    cfg = TritonDecodeConfig(block_n=16, num_splits=4, prefetch=2, inline_combine=True)


class TestTritonRaggedDecodeAttentionConformance(RaggedDecodeAttentionConformance):
    platform = "triton"
    supports_gradients = False


class TestTritonRaggedDecodeAttentionSplitsConformance(RaggedDecodeAttentionConformance):
    platform = "triton"
    supports_gradients = False
    cfg = SPLITS


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


@pytest.mark.parametrize(
    "page_size,heads,kv_heads,dim,lengths,max_pages,cfg",
    [
        (16, 32, 8, 128, [0, 1, 4095, 1000, 4096, 17, 2048, 3333], 256, None),
        (64, 32, 8, 128, [4096, 1, 0, 777, 64, 65, 4000, 3071], 64, None),
        (8, 8, 8, 64, [100, 0, 1, 8, 9, 2047], 300, None),  # MHA, pages of 8
        (48, 16, 2, 128, [1000, 47, 48, 49, 0, 2400], 60, None),  # group 8, pages that divide nothing
        (128, 8, 1, 128, [5000, 129, 1], 40, None),  # MQA
        (16, 32, 8, 128, [300, 1, 0, 200] * 64, 20, None),  # 256 short contexts: one split
        (16, 32, 8, 128, [4096, 1, 0, 3000], 256, TritonDecodeConfig(block_n=128, num_splits=16, prefetch=1)),
        (64, 32, 8, 128, [4096, 1, 0, 3000] * 16, 64, TritonDecodeConfig(num_splits=7, inline_combine=True)),
        # the heuristic's 4-per-SM program (32-key steps, three in flight) with one table entry per step
        (64, 32, 8, 128, [4096, 1, 0, 3000] * 16, 64, TritonDecodeConfig(block_n=32, prefetch=3)),
    ],
)
def test_bf16_paged_serving_shapes(page_size, heads, kv_heads, dim, lengths, max_pages, cfg):
    num_seqs = len(lengths)
    num_pages = num_seqs * max_pages // 2 + max_pages
    lengths = np.minimum(np.asarray(lengths, np.int32), max_pages * page_size)
    ks = jax.random.split(jax.random.key(page_size + len(lengths)), 3)
    inputs = dict(
        query=_normal(ks[0], (num_seqs, heads, dim)),
        key_cache=_normal(ks[1], (num_pages, kv_heads, page_size, dim)),
        value_cache=_normal(ks[2], (num_pages, kv_heads, page_size, dim)),
        context_lens=jnp.asarray(lengths),
        # distinct pages within a sequence, shared between some (read-only); -1 past each one's last page
        block_tables=jnp.asarray(random_block_tables(page_size, num_seqs, max_pages, num_pages, lengths, page_size)),
    )
    out = jax.jit(lambda **kw: page_attention(**kw, platform="triton", cfg=cfg))(**inputs)
    ref = float32_reference(reference_page_attention, **inputs)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out)[lengths == 0], 0)
    assert relative_error(out, ref) < 1e-2, relative_error(out, ref)


@pytest.mark.parametrize("cfg", [None, TritonDecodeConfig(block_n=32, num_splits=7, prefetch=3)])
def test_bf16_ragged_serving_shape(cfg):
    batch, seq_len, heads, kv_heads, dim = 8, 5000, 32, 8, 128
    ks = jax.random.split(jax.random.key(11), 4)
    rng = np.random.default_rng(0)
    start = rng.integers(0, 2000, batch).astype(np.int32)
    end = np.minimum(start + rng.integers(0, 3000, batch), seq_len).astype(np.int32)
    end[0], start[1], end[1] = start[0], 0, seq_len  # an empty range and a full one
    inputs = dict(
        query=_normal(ks[0], (batch, heads, dim)),
        key=_normal(ks[1], (batch, seq_len, kv_heads, dim)),
        value=_normal(ks[2], (batch, seq_len, kv_heads, dim)),
        sequence_start=jnp.asarray(start),
        sequence_end=jnp.asarray(end),
        softmax_aux=jax.random.normal(ks[3], (heads, 2), jnp.float32),
    )
    for extra in (dict(), dict(sliding_window=(1500, 0), logit_soft_cap=30.0)):
        out = jax.jit(lambda **kw: ragged_decode_attention(**kw, platform="triton", cfg=cfg, **extra))(**inputs)
        ref = float32_reference(lambda **kw: reference_ragged_decode_attention(**kw, **extra), **inputs)
        assert np.all(np.isfinite(np.asarray(out, np.float32)))
        np.testing.assert_array_equal(np.asarray(out)[0], 0)
        assert relative_error(out, ref) < 1e-2, (extra, relative_error(out, ref))


def test_auto_dispatch_takes_the_triton_kernel_on_the_gpu(monkeypatch):
    from ejkernel_triton.decode import kernels

    calls = []
    original = kernels.split_decode
    monkeypatch.setattr(kernels, "split_decode", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    kernels._attend_fn.cache_clear()
    q = _normal(jax.random.key(0), (2, 8, 64))
    cache = _normal(jax.random.key(1), (8, 2, 16, 64))
    page_attention(q, cache, cache, jnp.asarray([20, 5], jnp.int32), jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    assert calls
