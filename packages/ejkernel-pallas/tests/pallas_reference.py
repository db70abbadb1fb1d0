"""Dense float32 reference of docs/flash_attention.md, for the Pallas backend's own tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.ops.utils import dropout as dropout_hash


def visible_mask(batch, heads, sq, skv, *, causal, sliding_window, attention_mask, q_segment_ids,
                 kv_segment_ids, cum_seqlens_q, cum_seqlens_k):
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(skv)[None, :]
    if cum_seqlens_q is not None:
        cq, ck = cum_seqlens_q, cum_seqlens_k
        qs = jnp.searchsorted(cq, jnp.arange(sq), side="right") - 1
        ks = jnp.searchsorted(ck, jnp.arange(skv), side="right") - 1
        q_in = jnp.arange(sq) < cq[-1]
        k_in = jnp.arange(skv) < ck[-1]
        qs_c = jnp.clip(qs, 0, cq.shape[0] - 2)
        ks_c = jnp.clip(ks, 0, ck.shape[0] - 2)
        q_local = jnp.arange(sq) - cq[qs_c]
        k_local = jnp.arange(skv) - ck[ks_c]
        q_pos = q_local + (ck[qs_c + 1] - ck[qs_c]) - (cq[qs_c + 1] - cq[qs_c])
        p = q_pos[:, None]
        jj = k_local[None, :]
        mask = (qs_c[:, None] == ks_c[None, :]) & q_in[:, None] & k_in[None, :]
    else:
        p = i + skv - sq
        jj = j
        mask = jnp.ones((sq, skv), bool)
    if causal:
        mask &= jj <= p
    if sliding_window is not None:
        left, right = sliding_window
        mask &= (jj >= p - left) & (jj <= p + right)
    mask = jnp.broadcast_to(mask, (batch, heads, sq, skv))
    if attention_mask is not None:
        mask &= attention_mask
    if q_segment_ids is not None:
        mask &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    return mask


def flash_attention_reference(query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None,
                              kv_segment_ids=None, softmax_scale, causal=False, sliding_window=None,
                              logits_soft_cap=None, dropout_prob=0.0, dropout_seed=None, cum_seqlens_q=None,
                              cum_seqlens_k=None, softmax_aux=None, cfg=None):
    batch, sq, heads, d = query.shape
    skv, kv_heads = key.shape[1], key.shape[2]
    g = heads // kv_heads
    q = query.astype(jnp.float32)
    k = jnp.repeat(key.astype(jnp.float32), g, axis=2)
    v = jnp.repeat(value.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q, k, precision=jax.lax.Precision.HIGHEST) * softmax_scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    mask = visible_mask(batch, heads, sq, skv, causal=causal, sliding_window=sliding_window,
                        attention_mask=attention_mask, q_segment_ids=q_segment_ids,
                        kv_segment_ids=kv_segment_ids, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if softmax_aux is not None:
        aux = softmax_aux.reshape(heads, -1).astype(jnp.float32)
        m = jnp.maximum(m, jnp.max(aux, axis=-1)[None, :, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux[None, :, None, :] - m), axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    if dropout_prob > 0:
        b_i = jnp.arange(batch)[:, None, None, None]
        h_i = jnp.arange(heads)[None, :, None, None]
        r_i = jnp.arange(sq)[None, None, :, None]
        c_i = jnp.arange(skv)[None, None, None, :]
        keep = dropout_hash.keep_mask(dropout_seed, b_i, h_i, r_i, c_i, dropout_prob)
        p = jnp.where(keep, p / (1 - dropout_prob), 0.0)
    out = jnp.einsum("bhij,bjhd->bihd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(query.dtype)
