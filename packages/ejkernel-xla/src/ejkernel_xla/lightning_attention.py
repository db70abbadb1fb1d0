"""XLA ``lightning_attention``: the chunked engine with the layer-dependent per-head decay (a scalar
decay, so the intra-chunk part is two plain matmuls)."""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel.modules.operations.lightning_attention import lightning_decay_slopes
from ejkernel_xla.recurrent import key_log_decay, linear_attention


def lightning_attention(query, key, value, initial_state, cu_seqlens, *, layer_idx, num_layers, softmax_scale,
                        reverse, cfg=None):
    slopes = lightning_decay_slopes(query.shape[2], layer_idx, num_layers)
    g_gamma = jnp.broadcast_to(slopes, (query.shape[0], query.shape[2]))
    return linear_attention(
        query, key, value, key_log_decay(None, None, g_gamma, query.shape), None, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, cfg=cfg,
    )
