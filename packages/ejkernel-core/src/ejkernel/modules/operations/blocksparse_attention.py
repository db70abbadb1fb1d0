"""``blocksparse_attention``: attention restricted by a block-level mask (splash-style), on top of the
token-level rules of ``flash_attention`` (causal, sliding window, segments, soft cap, sinks).

Canonical call every backend receives (validated and normalized here)::

    blocksparse_attention(query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, block_mask, *,
                          softmax_scale: float, causal: bool, sliding_window: tuple[int, int] | None,
                          logits_soft_cap: float | None, q_block_size: int, kv_block_size: int, cfg)

- ``query`` ``[batch, q_len, num_heads, head_dim]``, ``key`` ``[batch, kv_len, num_kv_heads, head_dim]``,
  ``value`` ``[batch, kv_len, num_kv_heads, v_head_dim]`` (one dtype; GQA: query head ``h`` reads kv head
  ``h // (num_heads // num_kv_heads)``); segment ids int32 ``[batch, q_len]`` / ``[batch, kv_len]`` or None
  (both or neither); ``softmax_aux`` (sinks) float ``[num_heads]`` or ``[num_heads, num_sinks]`` or None.
- ``block_mask`` bool ``[batch or 1, num_heads or 1, ceil(q_len / q_block_size), ceil(kv_len / kv_block_size)]``
  (core turns ``None`` into all True). Key ``j`` is visible to query ``i`` when
  ``block_mask[b, h, i // q_block_size, j // kv_block_size]`` and every rule of ``docs/flash_attention.md``
  holds (queries aligned to the end of the keys: position ``p = i + kv_len - q_len``; causal ``j <= p``;
  window ``(left, right)``: ``p - left <= j <= p + right``; equal segment ids).
- Logits ``softmax_scale * <q, k>`` in float32, then soft cap; sinks join the denominator only. Rows
  with no visible key give zeros. Output ``[batch, q_len, num_heads, v_head_dim]`` in ``query``'s dtype.

Gradients: ``query``, ``key``, ``value`` and ``softmax_aux`` (required of every backend).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import check_array, check_positive_int, describe, typechecked
from ejkernel.modules.operations._validation import (
    check_qkv,
    check_softmax_aux,
    normalize_segment_ids,
    normalize_sliding_window,
    normalize_soft_cap,
)
from ejkernel.modules.operations.page_attention import resolve_scale
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


@dataclasses.dataclass(frozen=True)
class BlockSparseAttentionConfig:
    """Launch parameters (block sizes of the compute are the mask's blocks; see the module docstring)."""

    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str = "auto"
    backend: str = "any"


def normalize_block_size(value) -> tuple[int, int]:
    pair = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(pair) != 2:
        raise ValueError(f"block_size must be an int or a (q_block_size, kv_block_size) pair, got {value!r}")
    for size in pair:
        check_positive_int("block_size", size)
    return int(pair[0]), int(pair[1])


class BlockSparseAttention(RegistryOperation):
    """Block-sparse attention (see the module docstring)."""

    algorithm = "blocksparse_attention"
    config_type = BlockSparseAttentionConfig

    def validate(
        self,
        query,
        key,
        value,
        q_segment_ids=None,
        kv_segment_ids=None,
        softmax_aux=None,
        block_mask=None,
        *,
        softmax_scale=None,
        causal=True,
        sliding_window=None,
        logits_soft_cap=None,
        block_size=128,
    ):
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(query, key, value)
        q_segment_ids, kv_segment_ids = normalize_segment_ids(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
        check_softmax_aux(softmax_aux, num_heads)
        q_block, kv_block = normalize_block_size(block_size)
        blocks = (math.ceil(q_len / q_block), math.ceil(kv_len / kv_block))
        if block_mask is None:
            block_mask = jnp.ones((1, 1, *blocks), bool)
        check_array(
            "block_mask",
            block_mask,
            rank=4,
            dtypes=(jnp.bool_,),
            what="[batch or 1, num_heads or 1, q_blocks, kv_blocks]",
        )
        bm = block_mask.shape
        if bm[0] not in (1, batch) or bm[1] not in (1, num_heads) or tuple(bm[2:]) != blocks:
            raise ValueError(
                f"block_mask must have shape [{batch} or 1, {num_heads} or 1, {blocks[0]}, {blocks[1]}] "
                f"(ceil(q_len / {q_block}), ceil(kv_len / {kv_block})), got {describe(block_mask)}"
            )
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        args = (query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, block_mask)
        kwargs = dict(
            softmax_scale=resolve_scale("softmax_scale", softmax_scale, head_dim),
            causal=causal,
            sliding_window=normalize_sliding_window(sliding_window),
            logits_soft_cap=normalize_soft_cap(logits_soft_cap),
            q_block_size=q_block,
            kv_block_size=kv_block,
        )
        return args, kwargs


@typechecked
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
    platform: str = "auto",
    cfg: BlockSparseAttentionConfig | None = None,
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Attention over the blocks that ``block_mask`` enables (see the module docstring).

    Args:
        query, key, value: ``[batch, seq, heads, head_dim]`` layout (GQA allowed).
        q_segment_ids, kv_segment_ids: int ``[batch, len]``; attend only within equal ids.
        softmax_aux: attention sinks ``[num_heads]`` or ``[num_heads, num_sinks]``.
        block_mask: bool ``[batch|1, heads|1, q_blocks, kv_blocks]``; None = every block.
        block_size: the mask's block size, int or ``(q_block_size, kv_block_size)``.
        causal, sliding_window, logits_soft_cap, softmax_scale: as in ``flash_attention``.
        platform: ``"auto"`` or a platform name.
        cfg: a :class:`BlockSparseAttentionConfig`, or None.
    """
    return execute(
        BlockSparseAttention(),
        query,
        key,
        value,
        q_segment_ids,
        kv_segment_ids,
        softmax_aux,
        block_mask,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        block_size=block_size,
        platform=platform,
        cfg=cfg,
    )
