"""Dense, obviously-correct attention: the reference of ``flash_attention``, ``scaled_dot_product_attention``
and ``attention``. Every rule of ``docs/flash_attention.md`` is spelled out on the full [B, H, Sq, Skv]
logits; the visibility mask is built in numpy with explicit per-sequence loops (independent of any
backend's index arithmetic). Differentiable with ``jax.vjp``; call it on float64 inputs inside
``jax.enable_x64(True)`` (``ejkernel.testing.numerics.jax_float64``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops.utils.dropout import keep_mask


def _window(sliding_window) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (int, np.integer)):
        return int(sliding_window), int(sliding_window)
    left, right = sliding_window
    return int(left), int(right)


def reference_visibility(
    batch: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    sliding_window=None,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
) -> np.ndarray:
    """bool [B, H, Sq, Skv]: may query i attend to key j (numpy, concrete inputs only)."""
    window = _window(sliding_window)
    visible = np.zeros((batch, num_heads, q_len, kv_len), bool)
    if cum_seqlens_q is None:
        spans = [(0, q_len, 0, kv_len)]
    else:
        cq, ck = np.asarray(cum_seqlens_q), np.asarray(cum_seqlens_k)
        spans = [(cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]
    for q0, q1, k0, k1 in spans:
        lq, lk = q1 - q0, k1 - k0
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        position = i + lk - lq  # bottom-right alignment
        ok = np.ones((lq, lk), bool)
        if causal:
            ok &= j <= position
        if window is not None:
            ok &= (j >= position - window[0]) & (j <= position + window[1])
        visible[:, :, q0:q1, k0:k1] = ok
    if q_segment_ids is not None or kv_segment_ids is not None:
        qs = np.asarray(q_segment_ids if q_segment_ids is not None else kv_segment_ids)
        ks = np.asarray(kv_segment_ids if kv_segment_ids is not None else q_segment_ids)
        visible &= (qs[:, :, None] == ks[:, None, :])[:, None]
    if attention_mask is not None:
        visible &= np.asarray(attention_mask, bool)
    return visible


def reference_attention_weights(
    query,
    key,
    bias=None,
    *,
    softmax_scale=None,
    logits_soft_cap=None,
    softmax_aux=None,
    visible: np.ndarray,
):
    """Softmax probabilities [B, H, Sq, Skv] (sinks in the denominator; rows seeing nothing are 0)."""
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    key_per_q_head = jnp.repeat(key, num_heads // num_kv_heads, axis=2)  # head h reads kv head h // g
    s = jnp.einsum("bqhd,bkhd->bhqk", query, key_per_q_head) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias
    vis = jnp.asarray(visible)
    if softmax_aux is None:
        sinks = jnp.zeros((num_heads, 0), s.dtype)
    else:
        sinks = softmax_aux if softmax_aux.ndim == 2 else softmax_aux[:, None]
    sinks = jnp.broadcast_to(sinks[None, :, None, :].astype(s.dtype), (*s.shape[:3], sinks.shape[-1]))
    # the max only stabilises exp; it cancels, so it carries no gradient
    m = jax.lax.stop_gradient(
        jnp.maximum(jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1), jnp.max(sinks, axis=-1, initial=-jnp.inf))
    )
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    e = jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - m), 0.0)
    denominator = jnp.sum(e, axis=-1, keepdims=True) + jnp.sum(jnp.exp(sinks - m), axis=-1, keepdims=True)
    return e / jnp.where(denominator > 0, denominator, 1.0)


def reference_dropout_keep(batch: int, num_heads: int, q_len: int, kv_len: int, seed: int, dropout_prob: float):
    """bool [B, H, Sq, Skv]: the keep mask of ``ejkernel.ops.utils.dropout`` at every index."""
    b = jnp.arange(batch)[:, None, None, None]
    h = jnp.arange(num_heads)[None, :, None, None]
    i = jnp.arange(q_len)[None, None, :, None]
    j = jnp.arange(kv_len)[None, None, None, :]
    return keep_mask(seed, b, h, i, j, dropout_prob)


def reference_flash_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal: bool = False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob: float = 0.0,
    dropout_seed=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
    softmax_aux=None,
    return_weights: bool = False,
):
    """``out [B, Sq, H, Dv]`` (and the pre-dropout weights with ``return_weights``), computed densely."""
    batch, q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    visible = reference_visibility(
        batch,
        num_heads,
        q_len,
        kv_len,
        causal=causal,
        sliding_window=sliding_window,
        attention_mask=attention_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        cum_seqlens_q=cum_seqlens_q,
        cum_seqlens_k=cum_seqlens_k,
    )
    weights = reference_attention_weights(
        query,
        key,
        bias,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux,
        visible=visible,
    )
    p = weights
    if dropout_prob > 0.0:
        seed = 0 if dropout_seed is None else dropout_seed
        keep = reference_dropout_keep(batch, num_heads, q_len, kv_len, seed, dropout_prob)
        p = jnp.where(keep, weights / (1.0 - dropout_prob), 0.0)
    value_per_q_head = jnp.repeat(value, num_heads // num_kv_heads, axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, value_per_q_head)
    return (out, weights) if return_weights else out
