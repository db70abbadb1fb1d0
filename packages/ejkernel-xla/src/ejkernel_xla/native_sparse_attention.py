"""XLA ``native_sparse_attention`` (semantics: the module docstring of the core operation).

The compressed branch, the selection and varlen are core's (``operations._nsa_branches``, shared with
the GPU backends); this module brings the other two branches:

- Selected branch: for a chunk of query rows at a time (``lax.map``, rematerialized under autodiff) the
  rows' selected key blocks are gathered per kv head and attended; memory per step is
  ``chunk x num_selected_blocks x block_size`` keys per kv head, never the full sequence.
- Window branch: the flash-attention blockwise kernel (``_blockwise``, custom VJP) with a causal
  ``(window_size - 1, 0)`` window.

Every matmul (the branches' einsums and the window kernel, forward and backward) runs at the call's
precision. Every feature is implemented; nothing is refused. Config: :class:`XlaNsaConfig`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ejkernel.modules.operations._nsa_branches import (
    native_sparse_attention_from_branches,
    softmax_rows,
    usable_slots,
)
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


def _selected(q, k, v, block_indices, block_counts, softmax_scale, block_size, query_chunk):
    """o_slc [B, S, H, Dv] float32, a chunk of query rows at a time."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k.shape[2], v.shape[-1]
    group = num_heads // num_kv_heads
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
        usable = usable_slots(idx, counts, row, block_size)
        safe = jnp.clip(idx, 0, num_blocks - 1)
        b = jnp.arange(batch)[:, None, None, None]
        h = jnp.arange(num_kv_heads)[None, None, :, None]
        keys = key_blocks[b, h, safe]  # [B, c, Hkv, n, bs, D]
        values = value_blocks[b, h, safe]
        logits = jnp.einsum("bckgd,bckntd->bckgnt", q_c, keys, preferred_element_type=jnp.float32) * softmax_scale
        positions = safe[..., None] * block_size + jnp.arange(block_size)  # [B, c, Hkv, n, bs]
        visible = usable[..., None] & (positions <= row[None, :, None, None, None])
        probs = softmax_rows(logits.reshape(*logits.shape[:4], -1), visible.reshape(*visible.shape[:3], 1, -1))
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


def _nsa(call: NativeSparseAttentionCall, config: XlaNsaConfig) -> jax.Array:
    def selected(q, k, v, block_indices, block_counts, scale, block_size):
        return _selected(q, k, v, block_indices, block_counts, scale, block_size, config.query_chunk)

    return native_sparse_attention_from_branches(call, selected, _window)


class XlaNativeSparseAttention(JittedImplementation[NativeSparseAttentionCall, XlaNsaConfig]):
    """Plain autodiff around the window kernel, at the call's precision (``_jitted``)."""

    config_type = XlaNsaConfig
    compute = staticmethod(_nsa)


IMPLEMENTATION = XlaNativeSparseAttention()
