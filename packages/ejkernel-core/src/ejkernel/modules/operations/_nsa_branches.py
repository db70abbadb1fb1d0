"""The branches of ``native_sparse_attention`` every backend shares (plain jnp), and the driver that
gates them together: a backend brings its selected branch and its window branch
(:func:`native_sparse_attention_from_branches`); the compressed branch (``[S, S / block_size]`` logits,
block_size times smaller than full attention) and the selection (top-k of its probabilities, no gradient)
are computed here, as is varlen (sequences gathered into a padded ``[num_seqs, seq_len]`` batch: every
branch is causal and compressed blocks count only when complete, so padding never becomes visible).
Semantics: the module docstring of ``native_sparse_attention``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

def softmax_rows(logits, visible):
    """float32 softmax over the last axis restricted to ``visible``; rows with nothing visible are 0."""
    masked = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(masked.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)


def pool_blocks(x, block_size):
    """[B, S, Hkv, D] -> [B, ceil(S / bs), Hkv, D] block means (a partial last block: mean of its tokens)."""
    batch, seq_len = x.shape[:2]
    num_blocks = math.ceil(seq_len / block_size)
    padded = jnp.pad(x, ((0, 0), (0, num_blocks * block_size - seq_len), (0, 0), (0, 0)))
    sums = padded.reshape(batch, num_blocks, block_size, *x.shape[2:]).astype(jnp.float32).sum(axis=2)
    sizes = jnp.minimum(block_size, seq_len - jnp.arange(num_blocks) * block_size).astype(jnp.float32)
    return sums / sizes[None, :, None, None]


def compressed_branch(q, k, v, softmax_scale, block_size):
    """``(o_cmp [B, S, H, Dv] float32, P_cmp [B, S, Hkv, g, nb] float32)``."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    k_cmp, v_cmp = pool_blocks(k, block_size), pool_blocks(v, block_size)
    qg = q.reshape(batch, seq_len, num_kv_heads, num_heads // num_kv_heads, head_dim).astype(jnp.float32)
    logits = jnp.einsum("bskgd,bckd->bskgc", qg, k_cmp) * softmax_scale
    complete = (jnp.arange(k_cmp.shape[1])[None, :] + 1) * block_size - 1 <= jnp.arange(seq_len)[:, None]
    probs = softmax_rows(logits, complete[None, :, None, None, :])
    out = jnp.einsum("bskgc,bckd->bskgd", probs, v_cmp)
    return out.reshape(batch, seq_len, num_heads, -1), probs


def select_blocks(probs, block_size, num_selected):
    """Top ``num_selected`` block indices [B, S, Hkv, n] from the compressed probabilities (-1: none)."""
    seq_len, num_blocks = probs.shape[1], probs.shape[-1]
    scores = jax.lax.stop_gradient(probs).sum(axis=3)  # [B, S, Hkv, nb]
    block = jnp.arange(num_blocks)[None, :]
    own = (jnp.arange(seq_len) // block_size)[:, None]
    complete = (block + 1) * block_size - 1 <= jnp.arange(seq_len)[:, None]
    scores = jnp.where((block == own)[None, :, None], jnp.inf, jnp.where(complete[None, :, None], scores, -jnp.inf))
    count = min(num_selected, num_blocks)
    top_scores, indices = jax.lax.top_k(scores, count)
    indices = jnp.where(top_scores == -jnp.inf, -1, indices).astype(jnp.int32)
    if count < num_selected:
        indices = jnp.pad(indices, ((0, 0), (0, 0), (0, 0), (0, num_selected - count)), constant_values=-1)
    return indices


def usable_slots(block_indices, block_counts, rows, block_size: int):
    """bool ``[..., n]``: which selection slots count for query rows ``rows`` (``[c]``, broadcast over the
    second axis): among the first ``block_counts`` entries, ``0 <= index <= row // block_size``, and not a
    repeat of an earlier slot (duplicates count once)."""
    num_selected = block_indices.shape[-1]
    slot = jnp.arange(num_selected)
    earlier_same = (block_indices[..., :, None] == block_indices[..., None, :]) & (slot[:, None] > slot[None, :])
    return (
        (slot < block_counts[..., None])
        & (block_indices >= 0)
        & (block_indices <= (rows // block_size)[None, :, None, None])
        & ~earlier_same.any(axis=-1)
    )


SelectedBranch = Callable[..., jax.Array]
"""``(q, k, v, block_indices, block_counts, softmax_scale, block_size) -> o_slc [B, S, H, Dv] float32``."""
WindowBranch = Callable[..., jax.Array]
"""``(q, k, v, softmax_scale, window_size, precision) -> o_swa [B, S, H, Dv] float32``."""


def _gated_branches(call, selected: SelectedBranch, window: WindowBranch) -> jax.Array:
    """float32 output of a call without ``cu_seqlens``."""
    q, k, v, scale, block_size = call.query, call.key, call.value, call.softmax_scale, call.block_size
    block_indices, out = call.block_indices, 0.0
    if call.g_cmp is not None:
        o_cmp, probs = compressed_branch(q, k, v, scale, block_size)
        out = out + call.g_cmp[..., None].astype(jnp.float32) * o_cmp
        if block_indices is None:
            block_indices = select_blocks(probs, block_size, call.num_selected_blocks)
    o_slc = selected(q, k, v, block_indices, call.block_counts, scale, block_size)
    out = out + (o_slc if call.g_slc is None else call.g_slc[..., None].astype(jnp.float32) * o_slc)
    if call.window_size > 0:
        o_swa = window(q, k, v, scale, call.window_size, call.precision)
        out = out + call.g_swa[..., None].astype(jnp.float32) * o_swa
    return out


_PER_TOKEN = ("query", "key", "value", "g_cmp", "g_slc", "g_swa", "block_indices", "block_counts")


def native_sparse_attention_from_branches(call, selected: SelectedBranch, window: WindowBranch) -> jax.Array:
    """The output of a validated ``NativeSparseAttentionCall`` (query's dtype) from a backend's selected and
    window branches (see the module docstring)."""
    query, cu_seqlens = call.query, call.cu_seqlens
    if cu_seqlens is None:
        return _gated_branches(call, selected, window).astype(query.dtype)

    # varlen: [1, S, ...] -> padded batch [N, S, ...] (row n, local t <- packed token cu[n] + t)
    seq_len = query.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    local = jnp.arange(seq_len, dtype=jnp.int32)
    source = jnp.clip(cu_seqlens[:-1, None] + local[None, :], 0, seq_len - 1)  # [N, S]
    padded = {name: getattr(call, name) for name in _PER_TOKEN}
    padded = {name: None if x is None else x[0][source] for name, x in padded.items()}
    out = _gated_branches(dataclasses.replace(call, cu_seqlens=None, **padded), selected, window)  # [N, S, H, Dv]
    packed = jnp.arange(seq_len, dtype=jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cu_seqlens, packed, side="right") - 1, 0, num_seqs - 1)
    out = out[sequence, packed - cu_seqlens[sequence]]
    out = jnp.where((packed < cu_seqlens[-1])[:, None, None], out, 0.0)
    return out[None].astype(query.dtype)
