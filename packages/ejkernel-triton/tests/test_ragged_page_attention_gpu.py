"""GPU tests of Triton ragged_page_attention (run on the device: `pytest -m gpu`).

The shared conformance suite with platform="triton" (the heuristic config, and small tiles with decode splits
so that several prefill tiles, key steps and the decode combine pass run on every case), plus bf16 serving
batches against a float32 reference: decode rows and prefill chunks mixed, pages of 16 and 64 and pages that
divide nothing, contexts of 0 and 1, unused (-1) block-table tail entries, GQA 1/4/8 and MQA, window, soft cap
and sinks.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import ragged_page_attention
from ejkernel.testing.page_attention import random_block_tables
from ejkernel.testing.ragged_page_attention import RaggedPageAttentionConformance, reference_ragged_page_attention
from ejkernel_triton.ragged_page_attention import TritonRaggedPageConfig
from ejkernel.testing.numerics import relative_error
from gpu_support import GPU_ONLY, float32_reference

pytestmark = GPU_ONLY

SMALL = TritonRaggedPageConfig(block_m=16, block_n=16, num_warps=4, prefetch=1, decode_block_n=16,
                               decode_num_splits=4, decode_prefetch=2)


class TestTritonRaggedPageAttentionConformance(RaggedPageAttentionConformance):
    platform = "triton"
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature


class TestTritonRaggedPageAttentionSmallTilesConformance(RaggedPageAttentionConformance):
    platform = "triton"
    supports_gradients = False
    cfg = SMALL


class TestTritonRaggedPageAttentionOneLaunchConformance(RaggedPageAttentionConformance):
    """Decode programs and prefill tiles in one launch, the last decode split merging: one kernel in all."""

    platform = "triton"
    supports_gradients = False
    cfg = dataclasses.replace(SMALL, fused=True, decode_inline_combine=True)


def _positional(inputs):
    """The public function's positional-only arguments, in order (a jitted dict of inputs comes back key-sorted)."""
    parameters = inspect.signature(ragged_page_attention).parameters.values()
    return [inputs[p.name] for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY]


def mixed_batch(seed, sequences, heads, kv_heads, dim, page_size, max_pages, padding=0, inactive=0, sinks=None):
    """bf16 inputs of a mixed batch: ``sequences`` = [(q_len, kv_len)], then inactive slots and padding rows."""
    q_lens = np.array([q for q, _ in sequences] + [0] * inactive, np.int32)
    kv_lens = np.array([k for _, k in sequences] + [0] * inactive, np.int32)
    slots = len(q_lens)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_pages = slots * max_pages // 2 + max_pages
    ks = jax.random.split(jax.random.key(seed), 3)
    return dict(
        queries=jax.random.normal(ks[0], (int(starts[-1]) + padding, heads, dim), jnp.float32).astype(jnp.bfloat16),
        kv_pages=jax.random.normal(ks[1], (num_pages, page_size, 2 * kv_heads, dim), jnp.float32).astype(jnp.bfloat16),
        context_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(random_block_tables(seed, slots, max_pages, num_pages, kv_lens, page_size)),
        query_start_loc=jnp.asarray(starts),
        num_seqs=jnp.asarray([len(sequences)], jnp.int32),
        softmax_aux=None if sinks is None else jax.random.normal(ks[2], (heads, sinks), jnp.float32),
    )


@pytest.mark.parametrize(
    "page_size,heads,kv_heads,dim,sequences,max_pages,static,cfg",
    [
        # the standard mix, scaled down (the reference gathers every row's whole cache: rows x table keys stay
        # small): prefill chunks over longer contexts, decode rows, contexts 0 and 1, an empty sequence
        (16, 32, 8, 128, [(40, 1000), (1, 1023), (1, 1), (12, 12), (0, 17), (1, 500)] + [(1, 300)] * 4, 64, {},
         None),
        (64, 32, 8, 128, [(33, 1000), (1, 64), (1, 65), (16, 64), (1, 1000)], 16, {}, None),
        (48, 16, 2, 128, [(30, 1000), (1, 47), (1, 49), (20, 1400)], 30, dict(sliding_window=700), None),  # GQA 8
        (8, 8, 8, 64, [(17, 100), (1, 9), (40, 1000)], 128, dict(logits_soft_cap=20.0), None),  # MHA
        (128, 8, 1, 128, [(30, 3000), (1, 129), (1, 1)], 24, {}, None),  # MQA
        (16, 32, 8, 128, [(40, 1000), (1, 1000), (1, 17)], 64, dict(sliding_window=256), SMALL),
        (64, 32, 8, 128, [(40, 1000)] + [(1, 1000)] * 20, 16, {},
         TritonRaggedPageConfig(decode_num_splits=4, fused=True, decode_inline_combine=True)),
        # the benchmark's schedule candidates: one launch of 32-key steps; two launches, three prefill steps in flight
        (64, 32, 8, 128, [(33, 1000), (1, 64), (1, 65), (16, 64), (1, 1000)], 16, {},
         TritonRaggedPageConfig(block_m=64, num_warps=4, block_n=32, decode_block_n=32, fused=True,
                                interleave=True)),
        (16, 32, 8, 128, [(40, 1000), (1, 1023), (1, 1), (12, 12)] + [(1, 300)] * 4, 64, {},
         TritonRaggedPageConfig(block_m=64, num_warps=4, fused=True, interleave=True)),
        (16, 32, 8, 128, [(40, 1000), (1, 1023), (1, 1), (12, 12)] + [(1, 300)] * 4, 64, {},
         TritonRaggedPageConfig(prefetch=3, decode_block_n=32, decode_prefetch=3)),
    ],
)
def test_bf16_mixed_serving_batches(page_size, heads, kv_heads, dim, sequences, max_pages, static, cfg):
    inputs = mixed_batch(page_size + len(sequences), sequences, heads, kv_heads, dim, page_size, max_pages,
                         padding=5, inactive=2, sinks=2 if static else None)
    out = jax.jit(lambda **kw: ragged_page_attention(*_positional(kw), platform="triton", cfg=cfg, **static))(**inputs)
    ref = float32_reference(lambda **kw: reference_ragged_page_attention(**kw, **static), **inputs)
    used = int(inputs["query_start_loc"][len(sequences)])
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out)[used:], 0)
    assert relative_error(out[:used], ref[:used]) < 1e-2, relative_error(out[:used], ref[:used])


def test_auto_dispatch_takes_the_triton_kernel_on_the_gpu(monkeypatch):
    from ejkernel_triton.ragged_page_attention import kernels

    calls = []
    original = kernels.ragged_page_forward
    monkeypatch.setattr(kernels, "ragged_page_forward", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    kernels._attend_fn.cache_clear()
    inputs = mixed_batch(0, [(5, 20), (1, 7)], 8, 2, 64, 16, 4)
    ragged_page_attention(*_positional(inputs))
    assert calls
