"""The dense path's key chunks (``ejkernel_xla._dense.DENSE_ROW_KEYS``): a forward that is not
differentiated and masks nothing splits rows longer than ``row_keys`` into key chunks merged by their
log-sum-exp. The same output as one call (and as the float64 reference); masked, differentiated or
sink/bias/dropout calls keep one call. The suite's shapes are far below 8192 keys: chunks are forced here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.flash_attention import reference_flash_attention_numpy
from ejkernel_xla import _dense
from ejkernel_xla._blockwise import AttentionParams, key_tokens, query_tokens


def _inputs(q_len=24, kv_len=61, heads=4, kv_heads=2, dim=16):
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (2, q_len, heads, dim), jnp.float32)
    k = jax.random.normal(keys[1], (2, kv_len, kv_heads, dim), jnp.float32)
    v = jax.random.normal(keys[2], (2, kv_len, kv_heads, dim), jnp.float32)
    return q, k, v


def _attend(q, k, v, row_keys, **params):
    params = AttentionParams(softmax_scale=0.3, precision=jax.lax.Precision.HIGHEST, **params)
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    return _dense.flash_attention_dense(q, k, v, params=params, q_tokens=query_tokens(batch, q_len, kv_len),
                                        kv_tokens=key_tokens(batch, kv_len), row_keys=row_keys)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_key_chunks_match_one_call_and_the_reference(monkeypatch, softcap):
    q, k, v = _inputs()
    chunked_calls = []
    original = _dense._forward_key_chunks
    monkeypatch.setattr(_dense, "_forward_key_chunks", lambda *a: chunked_calls.append(a[-1]) or original(*a))
    chunked = jax.jit(lambda q, k, v: _attend(q, k, v, 16, logits_soft_cap=softcap))(q, k, v)  # 61 keys: 4 chunks
    assert chunked_calls == [16]
    whole = jax.jit(lambda q, k, v: _attend(q, k, v, None, logits_soft_cap=softcap))(q, k, v)
    np.testing.assert_allclose(chunked, whole, rtol=2e-5, atol=2e-6)
    reference, _, _ = reference_flash_attention_numpy(q, k, v, softmax_scale=0.3, logits_soft_cap=softcap)
    np.testing.assert_allclose(chunked, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masking", [dict(causal=True), dict(sliding_window=(5, 5))])
def test_masked_or_differentiated_calls_keep_one_call(monkeypatch, masking):
    q, k, v = _inputs(q_len=61)
    monkeypatch.setattr(_dense, "_forward_key_chunks", lambda *a: pytest.fail("key chunks under a mask"))
    jax.jit(lambda q, k, v: _attend(q, k, v, 16, **masking))(q, k, v)
    monkeypatch.setattr(_dense, "_forward_key_chunks", lambda *a: pytest.fail("key chunks under differentiation"))
    grads = jax.jit(jax.grad(lambda q, k, v: _attend(q, k, v, 16).sum(), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.all(np.isfinite(g)) for g in grads)
