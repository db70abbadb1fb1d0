"""XLA ``recurrent``: the chunked form of ``_chunked`` (intra-chunk matmuls, a scan over chunks)."""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel_xla._chunked import chunked_linear_attention

MATMUL_CHUNK = 64
"""Default chunk when the intra-chunk part is matmuls (scalar or key-dimension decays)."""
PAIRWISE_CHUNK = 16
"""Default chunk with value-dimension decays: their pairwise factor tile is chunk x chunk x value_dim."""


def linear_attention(query, key, value, log_decay_k, log_decay_v, initial_state, cu_seqlens, *, softmax_scale, reverse, cfg):
    """Shared by recurrent / gla / lightning_attention: repeat kv heads, pick the chunk, run, cast."""
    group = query.shape[2] // key.shape[2]
    if group > 1:
        key = jnp.repeat(key, group, axis=2)
        value = jnp.repeat(value, group, axis=2)
    chunk = getattr(cfg, "chunk_size", None)
    if chunk is None:
        chunk = MATMUL_CHUNK if log_decay_v is None else PAIRWISE_CHUNK
    out, final = chunked_linear_attention(
        query, key, value, log_decay_k, log_decay_v, initial_state, cu_seqlens,
        scale=softmax_scale, reverse=reverse, chunk_size=chunk,
    )
    return out.astype(query.dtype), final


def key_log_decay(g, gk, g_gamma, query_shape):
    """``g + gk + g_gamma`` as float32 [B, T, H, K or 1] (None when no gate is given)."""
    total = None
    for gate in (g, gk, None if g_gamma is None else g_gamma[:, None, :, None]):
        if gate is not None:
            gate = gate.astype(jnp.float32)
            total = gate if total is None else total + gate
    if total is None:
        return None
    return jnp.broadcast_to(total, tuple(query_shape[:3]) + (total.shape[-1],))


def recurrent(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, *, softmax_scale, reverse, cfg=None):
    return linear_attention(
        query, key, value, key_log_decay(g, gk, g_gamma, query.shape), gv, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, cfg=cfg,
    )
