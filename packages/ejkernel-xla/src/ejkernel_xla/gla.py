"""XLA ``gla``: the chunked linear-attention engine with the key-dimension gate (and g_gamma)."""

from __future__ import annotations

from ejkernel_xla.recurrent import key_log_decay, linear_attention


def gla(query, key, value, g, g_gamma, initial_state, cu_seqlens, *, softmax_scale, reverse, cfg=None):
    return linear_attention(
        query, key, value, key_log_decay(g, None, g_gamma, query.shape), None, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, cfg=cfg,
    )
