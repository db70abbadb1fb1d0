"""The dense path's query chunks (``ejkernel_xla._dense.query_chunk_count``): the same output and
gradients as one dense call over all keys, for every feature a chunk sees through its tokens (GQA, sliding
window, segment ids, dropout, sinks, soft cap, more keys than queries). The shared suite's shapes are
below ``CAUSAL_CHUNK_QUERIES`` (causal) and ``FULL_CHUNK_QUERIES`` and never chunk; the chunks are forced here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel_xla._blockwise import AttentionParams, key_tokens, query_tokens
from ejkernel_xla._dense import CAUSAL_CHUNK_QUERIES, MAX_CAUSAL_CHUNKS, query_chunk_count, flash_attention_dense

CASES = {
    "causal": dict(),
    "gqa_window_segments": dict(kv_heads=2, window=(7, 0), segments=True),
    "dropout_sinks_softcap_more_keys_window": dict(dropout=0.25, sinks=True, softcap=5.0, kv_len=57, window=(20, 2)),
    "not_causal_gqa_segments_dropout_sinks": dict(causal=False, kv_heads=2, segments=True, dropout=0.25, sinks=True,
                                                  kv_len=57),
    "not_causal_window": dict(causal=False, window=(6, 3)),
}


def _run(chunks: int, *, q_len=40, kv_len=None, heads=4, kv_heads=4, window=None, segments=False, dropout=0.0,
         sinks=False, softcap=None, causal=True):
    kv_len = kv_len or q_len
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (2, q_len, heads, 16), jnp.float32)
    k = jax.random.normal(keys[1], (2, kv_len, kv_heads, 16), jnp.float32)
    v = jax.random.normal(keys[2], (2, kv_len, kv_heads, 16), jnp.float32)
    do = jax.random.normal(keys[3], (2, q_len, heads, 16), jnp.float32)
    aux = jax.random.normal(keys[4], (heads,), jnp.float32) if sinks else None
    q_seg = kv_seg = None
    if segments:
        kv_seg = jnp.asarray(np.repeat(np.arange(4), -(-kv_len // 4))[:kv_len][None].repeat(2, 0), jnp.int32)
        q_seg = kv_seg[:, kv_len - q_len:]
    params = AttentionParams(softmax_scale=0.25, causal=causal, sliding_window=window, logits_soft_cap=softcap,
                             dropout_prob=dropout, precision=jax.lax.Precision.HIGHEST)

    def attend(q, k, v, aux):
        return flash_attention_dense(
            q, k, v, params=params, softmax_aux=aux,
            q_tokens=query_tokens(2, q_len, kv_len, segment_ids=q_seg), kv_tokens=key_tokens(2, kv_len, segment_ids=kv_seg),
            dropout_seed=7 if dropout else None, query_chunks=chunks,
        )

    @jax.jit
    def value_and_grads(q, k, v, aux, do):
        out, pullback = jax.vjp(attend, q, k, v, aux)
        return out, pullback(do)

    return value_and_grads(q, k, v, aux, do)


@pytest.mark.parametrize("case", list(CASES))
def test_chunks_match_one_dense_call(case):
    whole_out, whole_grads = _run(1, **CASES[case])
    out, grads = _run(3, **CASES[case])
    np.testing.assert_allclose(out, whole_out, rtol=2e-5, atol=2e-6)
    for name, got, want in zip(("dq", "dk", "dv", "daux"), grads, whole_grads):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


def test_chunk_count_rule():
    params = AttentionParams(softmax_scale=1.0, causal=True)
    varlen = False
    assert query_chunk_count(params, 2048, 2048, None, None, varlen) == 2048 // CAUSAL_CHUNK_QUERIES
    assert query_chunk_count(params, 64 * CAUSAL_CHUNK_QUERIES, 10**6, None, None, varlen) == MAX_CAUSAL_CHUNKS
    assert query_chunk_count(params, 100, 100, None, None, varlen) == 1  # short: one call
    full = AttentionParams(softmax_scale=1.0)
    assert query_chunk_count(full, 8192, 8192, None, None, varlen) == 1  # not causal: rows of <= 8192 queries
    assert query_chunk_count(full, 16384, 16384, None, None, varlen) == 2
    assert query_chunk_count(full, 16385, 100, None, None, varlen) == 3
    assert query_chunk_count(params, 8192, 4096, None, None, varlen) == 1  # more queries than keys
    assert query_chunk_count(params, 8192, 8192, jnp.zeros(()), None, varlen) == 1  # a bias
    assert query_chunk_count(params, 8192, 8192, None, jnp.ones((), bool), varlen) == 1  # a mask
    assert query_chunk_count(params, 8192, 8192, None, None, True) == 1  # varlen


def test_rule_counts_the_logits_the_chunks_compute():
    """The dense rule (``ejkernel_xla.flash_attention.dense_peak_bytes``) of a causal call counts the logits
    of its query chunks: S=16k, B=1, 16 heads, bf16 in 4 chunks keeps 62.5 % of the S² probabilities (2
    bytes each) and one chunk's transients (10 bytes per logit of the last chunk, which sees every key):
    15 GiB, within an H100's budget (29.7 GiB), where one call would need 48 GiB. On the H100 the chunked
    dense forward+backward ran at 117 TFLOP/s, the blockwise one at 31 (2026-11-23). Non-causal: 2 chunks
    of 8192 rows, all probabilities kept, one chunk's transients: 28 GiB."""
    from ejkernel.modules.operations.flash_attention import FlashAttentionCall
    from ejkernel_xla import flash_attention as xla_flash

    x = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
    causal = FlashAttentionCall(query=x, key=x, value=x, causal=True)
    chunk = 16384 // MAX_CAUSAL_CHUNKS
    kept = 16 * chunk * sum(chunk * (c + 1) for c in range(MAX_CAUSAL_CHUNKS))
    assert xla_flash.dense_peak_bytes(causal) == kept * 2 + 16 * chunk * 16384 * 10
    assert xla_flash.dense_forward_peak_bytes(causal) == 16 * chunk * 16384 * 6
    h100_budget = int(29.7 * 2**30)
    assert xla_flash.dense_fits(causal, h100_budget)
    full = FlashAttentionCall(query=x, key=x, value=x)  # not causal: 2 chunks of 8192 query rows
    assert xla_flash.dense_peak_bytes(full) == 16 * 16384 * 16384 * 2 + 16 * 8192 * 16384 * 10  # 28 GiB
    assert xla_flash.dense_fits(full, h100_budget)
    assert not xla_flash.dense_fits(full, int(27 * 2**30))
    varlen = FlashAttentionCall(query=x, key=x, value=x, causal=True,
                                cum_seqlens_q=jnp.asarray([0, 16384], jnp.int32),
                                cum_seqlens_k=jnp.asarray([0, 16384], jnp.int32))
    assert xla_flash.dense_peak_bytes(varlen) == 16 * 16384 * 16384 * 12  # varlen: one call
