"""XLA ``recurrent``, ``gla`` and ``lightning_attention``: one implementation of the linear-attention
family's :class:`LinearAttentionCall`, the chunked form of ``_chunked`` (intra-chunk matmuls, a scan over
chunks, memory O(T * chunk)). Every feature of ``docs/ops/recurrent.md`` is implemented; nothing is refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.recurrent import LinearAttentionCall
from ejkernel_xla._chunked import chunked_linear_attention

MATMUL_CHUNK = 64
"""Default chunk when the intra-chunk part is matmuls (scalar or key-dimension decays)."""
PAIRWISE_CHUNK = 16
"""Default chunk with value-dimension decays: their pairwise factor tile is chunk x chunk x value_dim."""


@dataclasses.dataclass(frozen=True)
class XlaLinearAttentionConfig:
    """Tokens per chunk of the chunked form (None: 64, or 16 with a value-dimension gate ``gv``); the
    result does not depend on it."""

    chunk_size: int | None = None

    def __post_init__(self):
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"XlaLinearAttentionConfig.chunk_size must be a positive int or None, got {size!r}")


def _chunk_size(call: LinearAttentionCall, requested: int | None) -> int:
    if requested is not None:
        return requested
    return MATMUL_CHUNK if call.gv is None else PAIRWISE_CHUNK


def key_log_decay(call: LinearAttentionCall) -> jax.Array | None:
    """``g + gk + g_gamma`` as float32 [B, T, H, K or 1] (None when no key-dimension gate is given)."""
    gamma = None if call.g_gamma is None else call.g_gamma[:, None, :, None]
    total = None
    for gate in (call.g, call.gk, gamma):
        if gate is not None:
            gate = gate.astype(jnp.float32)
            total = gate if total is None else total + gate
    if total is None:
        return None
    return jnp.broadcast_to(total, tuple(call.query.shape[:3]) + (total.shape[-1],))


class XlaLinearAttention(Implementation[LinearAttentionCall, XlaLinearAttentionConfig]):
    config_type = XlaLinearAttentionConfig

    def heuristic_config(self, call: LinearAttentionCall) -> XlaLinearAttentionConfig:
        """The chunk a config left at None takes, spelled out (the config stored is the one run)."""
        return XlaLinearAttentionConfig(_chunk_size(call, None))

    def __call__(self, call: LinearAttentionCall, config: XlaLinearAttentionConfig) -> tuple[jax.Array, jax.Array]:
        query, key, value = call.query, call.key, call.value
        group = query.shape[2] // key.shape[2]
        if group > 1:
            key = jnp.repeat(key, group, axis=2)
            value = jnp.repeat(value, group, axis=2)
        chunk = _chunk_size(call, config.chunk_size)
        out, final = chunked_linear_attention(
            query, key, value, key_log_decay(call), call.gv, call.initial_state, call.cu_seqlens,
            scale=call.softmax_scale, reverse=call.reverse, chunk_size=chunk, precision=call.precision,
        )
        return out.astype(query.dtype), final


IMPLEMENTATION = XlaLinearAttention()
"""Registered for ``recurrent``, ``gla`` and ``lightning_attention`` (one call type, one engine)."""
