"""Packed (varlen) sequences: where each token of an axis packed by ``cum_seqlens`` sits.

``cum_seqlens`` is int ``[num_seqs + 1]`` (0, end of sequence 0, end of sequence 1, ...); tokens at or past
``cum_seqlens[-1]`` (padding) belong to no sequence. Queries are aligned to the *end* of their keys, per
sequence (``docs/flash_attention.md``): query ``i`` of sequence ``n`` sits at key position
``i - cum_q[n] + len_k(n) - len_q(n)``, key ``j`` at ``j - cum_k[n]``.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["packed_keys", "packed_queries"]


def packed_keys(cum_seqlens, n: int):
    """``(sequence, position, exists)`` of tokens ``0..n-1``, int32/int32/bool ``[n]``: the sequence is
    clamped to a real one for padding tokens (``exists`` False), the position is local to it."""
    cum = jnp.asarray(cum_seqlens).astype(jnp.int32)
    index = jnp.arange(n, dtype=jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cum, index, side="right").astype(jnp.int32) - 1, 0, cum.shape[0] - 2)
    return sequence, index - cum[sequence], index < cum[-1]


def packed_queries(cum_seqlens_q, cum_seqlens_k, n: int):
    """``(sequence, position, exists)`` of packed queries ``0..n-1``, positions in key coordinates
    (aligned to the end of the query's own sequence of keys)."""
    sequence, local, exists = packed_keys(cum_seqlens_q, n)
    cum_q = jnp.asarray(cum_seqlens_q).astype(jnp.int32)
    cum_k = jnp.asarray(cum_seqlens_k).astype(jnp.int32)
    len_q = cum_q[sequence + 1] - cum_q[sequence]
    len_k = cum_k[sequence + 1] - cum_k[sequence]
    return sequence, local + len_k - len_q, exists
