"""XLA ``native_sparse_attention`` (semantics: the module docstring of the core operation).

- Compressed branch: mean-pooled key/value blocks, attended densely ([S, S / block_size] logits: the
  branch is block_size-times smaller than full attention); its probabilities also rank the blocks for
  the selection (under ``stop_gradient``: selection is discrete).
- Selected branch: for a chunk of query rows at a time (``lax.map``, rematerialized under autodiff) the
  rows' selected key blocks are gathered per kv head and attended; memory per step is
  ``chunk x num_selected_blocks x block_size`` keys per kv head, never the full sequence.
- Window branch: the flash-attention blockwise kernel (``_blockwise``, custom VJP) with a causal
  ``(window_size - 1, 0)`` window.
- Varlen (``cu_seqlens``): sequences are gathered into a padded ``[num_seqs, seq_len]`` batch (memory
  ``num_seqs x seq_len``), run as a batch and gathered back; padding never becomes visible because every
  branch is causal and compressed blocks count only when complete.

Every matmul (the branches' einsums and the window kernel, forward and backward) runs at the call's
precision. Every feature is implemented; nothing is refused. Config: :class:`XlaNsaConfig`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.native_sparse_attention import NativeSparseAttentionCall
from ejkernel_xla._blockwise import (
    AttentionParams,
    default_block_sizes,
    flash_attention_blockwise,
    key_tokens,
    query_tokens,
)
from ejkernel_xla._jitted import JittedImplementation


@dataclasses.dataclass(frozen=True)
class XlaNsaConfig:
    """``query_chunk``: query rows per step of the selected branch (memory per step grows with it)."""

    query_chunk: int = 64


def _softmax_rows(logits, visible):
    """float32 softmax over the last axis restricted to ``visible``; rows with nothing visible are 0."""
    masked = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(masked.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)


def _pool_blocks(x, block_size):
    """[B, S, Hkv, D] -> [B, ceil(S / bs), Hkv, D] block means (a partial last block: mean of its tokens)."""
    batch, seq_len = x.shape[:2]
    num_blocks = math.ceil(seq_len / block_size)
    padded = jnp.pad(x, ((0, 0), (0, num_blocks * block_size - seq_len), (0, 0), (0, 0)))
    sums = padded.reshape(batch, num_blocks, block_size, *x.shape[2:]).astype(jnp.float32).sum(axis=2)
    sizes = jnp.minimum(block_size, seq_len - jnp.arange(num_blocks) * block_size).astype(jnp.float32)
    return sums / sizes[None, :, None, None]


def _compressed(q, k, v, softmax_scale, block_size):
    """``(o_cmp [B, S, H, Dv] float32, P_cmp [B, S, Hkv, g, nb] float32)``."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    k_cmp, v_cmp = _pool_blocks(k, block_size), _pool_blocks(v, block_size)
    qg = q.reshape(batch, seq_len, num_kv_heads, num_heads // num_kv_heads, head_dim).astype(jnp.float32)
    logits = jnp.einsum("bskgd,bckd->bskgc", qg, k_cmp) * softmax_scale
    complete = (jnp.arange(k_cmp.shape[1])[None, :] + 1) * block_size - 1 <= jnp.arange(seq_len)[:, None]
    probs = _softmax_rows(logits, complete[None, :, None, None, :])
    out = jnp.einsum("bskgc,bckd->bskgd", probs, v_cmp)
    return out.reshape(batch, seq_len, num_heads, -1), probs


def _select_blocks(probs, block_size, num_selected):
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


def _selected(q, k, v, block_indices, block_counts, softmax_scale, block_size, query_chunk):
    """o_slc [B, S, H, Dv] float32, a chunk of query rows at a time."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k.shape[2], v.shape[-1]
    group = num_heads // num_kv_heads
    num_selected = block_indices.shape[-1]
    num_blocks = math.ceil(seq_len / block_size)
    pad_keys = num_blocks * block_size - seq_len

    def blocks_of(x):  # [B, S, Hkv, D] -> [B, Hkv, nb, bs, D]
        x = jnp.pad(x, ((0, 0), (0, pad_keys), (0, 0), (0, 0)))
        return jnp.moveaxis(x.reshape(batch, num_blocks, block_size, num_kv_heads, x.shape[-1]), 3, 1)

    key_blocks, value_blocks = blocks_of(k), blocks_of(v)
    chunk = max(1, min(seq_len, query_chunk))
    num_chunks = math.ceil(seq_len / chunk)
    pad_rows = num_chunks * chunk - seq_len

    def chunked(x, fill=0):
        x = jnp.pad(x, [(0, 0), (0, pad_rows)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 1, 0)

    rows = jnp.arange(num_chunks * chunk, dtype=jnp.int32).reshape(num_chunks, chunk)
    qg = q.reshape(batch, seq_len, num_kv_heads, group, head_dim)

    @jax.checkpoint
    def one_chunk(xs):
        q_c, idx, counts, row = xs  # [B, c, Hkv, g, D], [B, c, Hkv, n], [B, c, Hkv], [c]
        slot = jnp.arange(num_selected)
        earlier_same = (idx[..., :, None] == idx[..., None, :]) & (slot[:, None] > slot[None, :])
        usable = (
            (slot < counts[..., None])
            & (idx >= 0)
            & (idx <= (row // block_size)[None, :, None, None])
            & ~earlier_same.any(axis=-1)
        )
        safe = jnp.clip(idx, 0, num_blocks - 1)
        b = jnp.arange(batch)[:, None, None, None]
        h = jnp.arange(num_kv_heads)[None, None, :, None]
        keys = key_blocks[b, h, safe]  # [B, c, Hkv, n, bs, D]
        values = value_blocks[b, h, safe]
        logits = jnp.einsum("bckgd,bckntd->bckgnt", q_c, keys, preferred_element_type=jnp.float32) * softmax_scale
        positions = safe[..., None] * block_size + jnp.arange(block_size)  # [B, c, Hkv, n, bs]
        visible = usable[..., None] & (positions <= row[None, :, None, None, None])
        probs = _softmax_rows(logits.reshape(*logits.shape[:4], -1), visible.reshape(*visible.shape[:3], 1, -1))
        out = jnp.einsum("bckgm,bckmd->bckgd", probs, values.reshape(*values.shape[:3], -1, v_dim).astype(jnp.float32))
        return out

    chunks = (chunked(qg), chunked(block_indices, -1), chunked(block_counts), rows)
    if num_chunks == 1:  # no loop for short sequences
        out = one_chunk(jax.tree.map(lambda x: x[0], chunks))[None]
    else:
        out = jax.lax.map(one_chunk, chunks)
    out = jnp.moveaxis(out, 0, 1).reshape(batch, num_chunks * chunk, num_heads, v_dim)
    return out[:, :seq_len]


def _window(q, k, v, softmax_scale, window_size, precision):
    batch, seq_len = q.shape[:2]
    params = AttentionParams(
        softmax_scale=softmax_scale, causal=True, sliding_window=(window_size - 1, 0), precision=precision
    )
    return flash_attention_blockwise(
        q,
        k,
        v,
        params=params,
        blocks=default_block_sizes(seq_len, seq_len, q.shape[-1]),
        q_tokens=query_tokens(batch, seq_len, seq_len),
        kv_tokens=key_tokens(batch, seq_len),
    ).astype(jnp.float32)


def _nsa_batch(call: NativeSparseAttentionCall, query_chunk: int) -> jax.Array:
    """float32 output of a call without ``cu_seqlens``."""
    q, k, v, scale, block_size = call.query, call.key, call.value, call.softmax_scale, call.block_size
    block_indices, out = call.block_indices, 0.0
    if call.g_cmp is not None:
        o_cmp, probs = _compressed(q, k, v, scale, block_size)
        out = out + call.g_cmp[..., None].astype(jnp.float32) * o_cmp
        if block_indices is None:
            block_indices = _select_blocks(probs, block_size, call.num_selected_blocks)
    o_slc = _selected(q, k, v, block_indices, call.block_counts, scale, block_size, query_chunk)
    out = out + (o_slc if call.g_slc is None else call.g_slc[..., None].astype(jnp.float32) * o_slc)
    if call.window_size > 0:
        o_swa = _window(q, k, v, scale, call.window_size, call.precision)
        out = out + call.g_swa[..., None].astype(jnp.float32) * o_swa
    return out


_PER_TOKEN = ("query", "key", "value", "g_cmp", "g_slc", "g_swa", "block_indices", "block_counts")


def _nsa(call: NativeSparseAttentionCall, config: XlaNsaConfig) -> jax.Array:
    query, cu_seqlens = call.query, call.cu_seqlens
    if cu_seqlens is None:
        return _nsa_batch(call, config.query_chunk).astype(query.dtype)

    # varlen: [1, S, ...] -> padded batch [N, S, ...] (row n, local t <- packed token cu[n] + t)
    seq_len = query.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    local = jnp.arange(seq_len, dtype=jnp.int32)
    source = jnp.clip(cu_seqlens[:-1, None] + local[None, :], 0, seq_len - 1)  # [N, S]
    padded = {name: getattr(call, name) for name in _PER_TOKEN}
    padded = {name: None if x is None else x[0][source] for name, x in padded.items()}
    out = _nsa_batch(dataclasses.replace(call, cu_seqlens=None, **padded), config.query_chunk)  # [N, S, H, Dv]
    packed = jnp.arange(seq_len, dtype=jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cu_seqlens, packed, side="right") - 1, 0, num_seqs - 1)
    out = out[sequence, packed - cu_seqlens[sequence]]
    out = jnp.where((packed < cu_seqlens[-1])[:, None, None], out, 0.0)
    return out[None].astype(query.dtype)


class XlaNativeSparseAttention(JittedImplementation[NativeSparseAttentionCall, XlaNsaConfig]):
    """Plain autodiff around the window kernel, at the call's precision (``_jitted``)."""

    config_type = XlaNsaConfig
    compute = staticmethod(_nsa)


IMPLEMENTATION = XlaNativeSparseAttention()
