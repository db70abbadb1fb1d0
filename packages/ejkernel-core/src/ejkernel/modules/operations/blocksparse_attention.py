"""``blocksparse_attention``: attention restricted by a block-level mask (splash-style), on top of the
token-level rules of ``flash_attention`` (causal, sliding window, segments, soft cap, sinks).

Core validates the public call into one frozen :class:`BlockSparseAttentionCall`, all a backend sees.
The arguments shared with ``flash_attention`` are checked and normalized by ``FlashAttention.validate``
(``softmax_scale=None`` -> ``1/sqrt(head_dim)``, ``sliding_window=w`` -> ``(w, w)``, a missing segment-id
side -> the other one, ``precision``); ``block_size`` becomes ``(q_block_size, kv_block_size)`` and
``block_mask=None`` all True.

- ``query`` ``[batch, q_len, num_heads, head_dim]``, ``key`` ``[batch, kv_len, num_kv_heads, head_dim]``,
  ``value`` ``[batch, kv_len, num_kv_heads, v_head_dim]`` (one dtype; GQA: query head ``h`` reads kv head
  ``h // (num_heads // num_kv_heads)``); segment ids int32 ``[batch, q_len]`` / ``[batch, kv_len]`` or None
  (both or neither); ``softmax_aux`` (sinks) float ``[num_heads]`` or ``[num_heads, num_sinks]`` or None.
- ``block_mask`` bool ``[batch or 1, num_heads or 1, ceil(q_len / q_block_size), ceil(kv_len / kv_block_size)]``.
  Key ``j`` is visible to query ``i`` when ``block_mask[b, h, i // q_block_size, j // kv_block_size]`` and
  every rule of ``docs/flash_attention.md`` holds (queries aligned to the end of the keys: position
  ``p = i + kv_len - q_len``; causal ``j <= p``; window ``(left, right)``: ``p - left <= j <= p + right``;
  equal segment ids).
- Logits ``softmax_scale * <q, k>`` in float32, then soft cap; sinks join the denominator only. Rows
  with no visible key give zeros. Output ``[batch, q_len, num_heads, v_head_dim]`` in ``query``'s dtype.

Gradients: ``query``, ``key``, ``value`` and ``softmax_aux`` (required of every backend).

Block masks: :func:`causal_block_mask`, :func:`local_block_mask` and :func:`chunked_block_mask` build the
``[1, 1, q_blocks, kv_blocks]`` patterns; any other boolean block mask is passed as is. A block mask gates
whole blocks only: token-exact causal / local attention also passes ``causal`` / ``sliding_window``.
Backends get their visiting schedule from ``ejkernel.ops.utils.block_sparse`` (``block_schedule``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field
from ejkernel.modules.operations._validation import (
    check_array,
    check_positive_int,
    describe,
    normalize_sliding_window,
)
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention_subset, restricted_call
from ejkernel.ops.utils.block_sparse import reachable_blocks


@flash_attention_subset(
    "query", "key", "value", "q_segment_ids", "kv_segment_ids", "softmax_aux",
    "softmax_scale", "causal", "sliding_window", "logits_soft_cap", "precision",
)
class BlockSparseAttentionCall:
    """A validated ``blocksparse_attention`` call: what every backend receives (see above); besides the
    block mask and its block sizes, its fields are ``FlashAttentionCall``'s of those names (no bias, mask,
    varlen or dropout)."""

    block_mask: Bool[jax.Array, "mask_batch mask_heads q_blocks kv_blocks"] = array_field()
    """``[batch or 1, num_heads or 1, ceil(q_len / q_block_size), ceil(kv_len / kv_block_size)]``."""
    q_block_size: int = 128
    kv_block_size: int = 128


def normalize_block_size(value: Any) -> tuple[int, int]:
    """An int ``b`` (-> ``(b, b)``) or a ``(q_block_size, kv_block_size)`` pair of positive ints."""
    pair = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(pair) != 2:
        raise ValueError(f"block_size must be an int or a (q_block_size, kv_block_size) pair, got {value!r}")
    for size in pair:
        check_positive_int("block_size", size)
    return int(pair[0]), int(pair[1])


def check_block_mask(block_mask: Any, batch: int, num_heads: int, blocks: tuple[int, int], block_size: tuple[int, int]):
    check_array(
        "block_mask", block_mask, rank=4, dtypes=(jnp.bool_,), what="[batch or 1, num_heads or 1, q_blocks, kv_blocks]"
    )
    shape = block_mask.shape
    if shape[0] not in (1, batch) or shape[1] not in (1, num_heads) or tuple(shape[2:]) != blocks:
        leading = ", ".join(f"{size} or 1" if size != 1 else "1" for size in (batch, num_heads))
        raise ValueError(
            f"block_mask must have shape [{leading}, {blocks[0]}, {blocks[1]}] (ceil(q_len / {block_size[0]}), "
            f"ceil(kv_len / {block_size[1]}) for block_size={block_size}: a mask built for another block_size "
            f"has other block counts), got {describe(block_mask)}"
        )


def _concrete(mask: np.ndarray) -> jax.Array:
    """A builder's result: a concrete array even inside ``jit`` (a block-sparse kernel then schedules the
    blocks at trace time, sized by the busiest row, instead of for every column block)."""
    with jax.ensure_compile_time_eval():
        return jnp.asarray(mask)[None, None]


def _mask_blocks(q_len: Any, kv_len: Any, block_size: Any) -> tuple[int, int, int, int]:
    check_positive_int("q_len", q_len)
    check_positive_int("kv_len", kv_len)
    q_block, kv_block = normalize_block_size(block_size)
    return int(q_len), int(kv_len), q_block, kv_block


def causal_block_mask(q_len: int, kv_len: int, block_size: int | tuple[int, int] = 128) -> jax.Array:
    """bool ``[1, 1, q_blocks, kv_blocks]``: the blocks holding a key ``j <= p`` for some query of the
    block (end-aligned position ``p = i + kv_len - q_len``). With ``causal=True`` in the call this is
    causal attention that never visits a block above the diagonal; with ``causal=False``, block-causal."""
    q_len, kv_len, q_block, kv_block = _mask_blocks(q_len, kv_len, block_size)
    return _concrete(reachable_blocks(q_len, kv_len, q_block, kv_block, causal=True))


def local_block_mask(
    q_len: int, kv_len: int, block_size: int | tuple[int, int] = 128, window: int | tuple[int, int] = 128
) -> jax.Array:
    """bool ``[1, 1, q_blocks, kv_blocks]``: the blocks holding a key in ``[p - left, p + right]`` for some
    query of the block (``window``: ``w`` or ``(left, right)``, as ``sliding_window``). Token-exact local
    attention also passes ``sliding_window=window`` to the call."""
    q_len, kv_len, q_block, kv_block = _mask_blocks(q_len, kv_len, block_size)
    window = normalize_sliding_window(window)
    if window is None:
        raise ValueError("local_block_mask: window must be a non-negative int or a (left, right) pair, got None")
    return _concrete(reachable_blocks(q_len, kv_len, q_block, kv_block, causal=False, sliding_window=window))


def chunked_block_mask(
    q_len: int, kv_len: int, block_size: int | tuple[int, int] = 128, chunk_size: int = 128
) -> jax.Array:
    """bool ``[1, 1, q_blocks, kv_blocks]``: chunked attention (query at end-aligned position ``p`` sees the
    keys of its chunk ``[c * chunk_size, (c + 1) * chunk_size)``, ``c = p // chunk_size``; with
    ``causal=True`` in the call, only the earlier ones). Token-exact only when no block straddles a chunk
    boundary, so that is required (``chunk_size`` a multiple of both block sizes, and ``kv_len - q_len`` of
    the query block size unless every query shares one chunk); a ``ValueError`` says which side does not fit."""
    q_len, kv_len, q_block, kv_block = _mask_blocks(q_len, kv_len, block_size)
    check_positive_int("chunk_size", chunk_size)
    offset = kv_len - q_len

    def chunk_of_blocks(side, length, block, shift):
        first = np.arange(math.ceil(length / block)) * block
        last = np.minimum(first + block, length) - 1
        first_chunk, last_chunk = (first + shift) // chunk_size, (last + shift) // chunk_size
        if np.any(first_chunk != last_chunk):
            raise ValueError(
                f"chunked_block_mask: a {side} block of {block} tokens straddles a chunk boundary (chunk_size="
                f"{chunk_size}, kv_len - q_len = {offset}); the block mask could not be token-exact. Use a "
                f"chunk_size that is a multiple of the block sizes (and of the query block size's alignment)"
            )
        return first_chunk

    q_chunks = chunk_of_blocks("query", q_len, q_block, offset)
    kv_chunks = chunk_of_blocks("key", kv_len, kv_block, 0)
    return _concrete(q_chunks[:, None] == kv_chunks[None, :])


class BlockSparseAttention(RegistryOperation):
    """Block-sparse attention (see the module docstring)."""

    algorithm = "blocksparse_attention"

    def canonicalize(self, args: Arguments) -> BlockSparseAttentionCall:
        """The arguments shared with ``flash_attention`` are checked and normalized by ``FlashAttention.validate``."""
        flash_call = FlashAttention().validate(**args.without("block_mask", "block_size"))
        (batch, q_len, num_heads, _), kv_len = args.query.shape, args.key.shape[1]
        q_block, kv_block = normalize_block_size(args.block_size)
        blocks = (math.ceil(q_len / q_block), math.ceil(kv_len / kv_block))
        block_mask = args.block_mask
        if block_mask is None:
            with jax.ensure_compile_time_eval():  # concrete under jit too: kernels size their schedules by it
                block_mask = jnp.ones((1, 1, *blocks), bool)
        check_block_mask(block_mask, batch, num_heads, blocks, (q_block, kv_block))
        return restricted_call(
            self.algorithm, BlockSparseAttentionCall, flash_call, block_mask=block_mask, q_block_size=q_block,
            kv_block_size=kv_block,
        )


@public_function(BlockSparseAttention)
def blocksparse_attention(
    query: Float[jax.Array, "batch q_len num_heads head_dim"],
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"],
    q_segment_ids: Int[jax.Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[jax.Array, "batch kv_len"] | None = None,
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = None,
    *,
    block_mask: Bool[jax.Array, "mask_batch mask_heads q_blocks kv_blocks"] | None = None,
    block_size: int | tuple[int, int] = 128,
    causal: bool = True,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Attention over the blocks that ``block_mask`` enables (see the module docstring).

    Args:
        query, key, value: ``[batch, seq, heads, head_dim]`` layout (GQA allowed).
        q_segment_ids, kv_segment_ids: int ``[batch, len]``; attend only within equal ids.
        softmax_aux: attention sinks ``[num_heads]`` or ``[num_heads, num_sinks]``.
        block_mask: bool ``[batch|1, heads|1, q_blocks, kv_blocks]``; None = every block.
        block_size: the mask's block size, int or ``(q_block_size, kv_block_size)``.
        causal, sliding_window, logits_soft_cap, softmax_scale: as in ``flash_attention``.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config (XLA: ``ejkernel.NoConfig()``: its blocks are the mask's); it
            selects that implementation. None: the chosen implementation's heuristic.
    """
    return execute(BlockSparseAttention(), **locals())
