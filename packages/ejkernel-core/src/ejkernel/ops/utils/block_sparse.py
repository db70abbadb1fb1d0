"""Block-sparse schedules: which key blocks each query block of a ``blocksparse_attention`` call visits
(and the transpose, for the dK/dV pass), shared by every backend's block-sparse kernel so the mask
semantics live in one place.

A block pair ``(i, j)`` (query block ``i`` of ``q_block_size`` rows, key block ``j`` of ``kv_block_size``)
is *visited* when ``block_mask`` enables it and the call's causal / sliding-window rules leave at least one
visible (query, key) pair in it (queries aligned to the end of the keys: query ``t`` sits at key position
``t + kv_len - q_len``). A visited block is *partial* when the kernel must still mask tokens inside it: a
causal or window boundary crosses it, it holds the ragged tail of ``q_len`` or ``kv_len``, or the call has
segment ids. Block-level reachability depends only on static sizes, so it is computed with numpy; the
block mask may be a tracer (a schedule can be built under ``jit``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttentionCall

__all__ = [
    "BlockSchedule",
    "block_schedule",
    "effective_block_mask",
    "schedule_blocks",
    "full_blocks",
    "reachable_blocks",
]


class BlockSchedule(NamedTuple):
    """Per row block, the column blocks a kernel visits (rows: query blocks for ``by="q"``, key blocks for
    ``by="kv"``). ``mask_batch`` / ``mask_heads`` are those of ``block_mask`` (1 or full)."""

    indices: jax.Array
    """int32 ``[mask_batch, mask_heads, rows, max_visits]``: the column blocks to visit, ascending (with
    ``order="full_first"``: the row's full blocks ascending, then its partial ones ascending;
    ``"partial_first"`` the reverse); entries at or
    past ``counts`` repeat the last valid index (0 when the row visits nothing), so a kernel whose index map
    follows them loads no new block there."""
    counts: jax.Array
    """int32 ``[mask_batch, mask_heads, rows]``: how many entries of ``indices`` are real."""
    partial: jax.Array
    """bool ``[mask_batch, mask_heads, rows, max_visits]``: the visited block needs token-level masking."""


def _token_ranges(length: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last real token of each block (int64 ``[ceil(length / block)]``)."""
    first = np.arange(math.ceil(length / block), dtype=np.int64) * block
    return first, np.minimum(first + block, length) - 1


def _visible_columns(q_len: int, kv_len: int, causal: bool, window):
    """``lo(p)``, ``hi(p)``: the key range query position ``p`` sees under causal/window (functions of
    numpy arrays). Both are non-decreasing in ``p`` and ``lo <= hi``, so the keys seen by a run of
    positions ``[pf, pl]`` are exactly ``[lo(pf), hi(pl)]``."""
    big = np.int64(2**40)

    def lo(p):
        return p - window[0] if window is not None else np.full_like(p, -big)

    def hi(p):
        bound = np.full_like(p, big)
        if causal:
            bound = np.minimum(bound, p)
        if window is not None:
            bound = np.minimum(bound, p + window[1])
        return bound

    return lo, hi


def reachable_blocks(
    q_len: int, kv_len: int, q_block: int, kv_block: int, *, causal: bool, sliding_window=None
) -> np.ndarray:
    """bool ``[q_blocks, kv_blocks]``: blocks holding at least one (query, key) pair that causal /
    ``sliding_window`` ``(left, right)`` leave visible (end-aligned queries)."""
    q_first, q_last = _token_ranges(q_len, q_block)
    kv_first, kv_last = _token_ranges(kv_len, kv_block)
    offset = kv_len - q_len
    lo, hi = _visible_columns(q_len, kv_len, causal, sliding_window)
    p_first, p_last = (q_first + offset)[:, None], (q_last + offset)[:, None]
    return (kv_last[None, :] >= lo(p_first)) & (kv_first[None, :] <= hi(p_last))


def full_blocks(q_len: int, kv_len: int, q_block: int, kv_block: int, *, causal: bool, sliding_window=None) -> np.ndarray:
    """bool ``[q_blocks, kv_blocks]``: blocks a kernel may compute without any token mask (every pair
    visible under causal/window, and no ragged tail of ``q_len`` / ``kv_len`` in the block). Segment ids
    are not considered here."""
    q_first, q_last = _token_ranges(q_len, q_block)
    kv_first, kv_last = _token_ranges(kv_len, kv_block)
    offset = kv_len - q_len
    lo, hi = _visible_columns(q_len, kv_len, causal, sliding_window)
    p_first, p_last = (q_first + offset)[:, None], (q_last + offset)[:, None]
    full = (kv_first[None, :] >= lo(p_last)) & (kv_last[None, :] <= hi(p_first))
    full &= (q_last - q_first + 1 == q_block)[:, None]
    full &= (kv_last - kv_first + 1 == kv_block)[None, :]
    return full


def _reachable_of(call: BlockSparseAttentionCall) -> np.ndarray:
    return reachable_blocks(
        call.query.shape[1], call.key.shape[1], call.q_block_size, call.kv_block_size,
        causal=call.causal, sliding_window=call.sliding_window,
    )


def effective_block_mask(call: BlockSparseAttentionCall) -> jax.Array:
    """bool ``[mask_batch, mask_heads, q_blocks, kv_blocks]``: ``call.block_mask`` AND the block-level
    reachability of ``call.causal`` / ``call.sliding_window``: exactly the blocks with a visible pair
    (ignoring segment ids)."""
    return jnp.logical_and(call.block_mask, jnp.asarray(_reachable_of(call)))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def block_schedule(call: BlockSparseAttentionCall, *, by: Literal["q", "kv"] = "q",
                   order: Literal["ascending", "full_first", "partial_first"] = "ascending") -> BlockSchedule:
    """The visiting schedule of ``call``'s blocks (see :class:`BlockSchedule`).

    ``by="q"``: rows are query blocks, columns key blocks (forward and dQ passes); ``by="kv"``: the
    transpose (dK/dV pass). ``order="full_first"``: each row lists its full blocks first, then its partial
    ones (each group ascending), for a kernel that runs ``[0, number of full)`` through a mask-free loop and
    the rest through a masked one (``"partial_first"``: partial ones first); the same single sort as
    ``"ascending"`` (no second pass).
    ``max_visits`` (static) is the largest count when ``call.block_mask`` is concrete, else the number of
    column blocks; at least 1, so a kernel grid always has a step. A concrete mask is scheduled with numpy
    (no compilation per mask shape), a traced one with the same jnp code."""
    return schedule_blocks(
        call.block_mask, call.query.shape[1], call.key.shape[1], call.q_block_size, call.kv_block_size,
        causal=call.causal, sliding_window=call.sliding_window,
        segments=call.q_segment_ids is not None or call.kv_segment_ids is not None, by=by, order=order,
    )


def schedule_blocks(block_mask, q_len: int, kv_len: int, q_block: int, kv_block: int, *, causal: bool,
                    sliding_window=None, segments: bool = False, by: Literal["q", "kv"] = "q",
                    order: Literal["ascending", "full_first", "partial_first"] = "ascending") -> BlockSchedule:
    """:func:`block_schedule` from its parts: ``block_mask`` ``[mask_batch, mask_heads, q_blocks,
    kv_blocks]`` (None: every block, as dense attention visits them), the lengths and blocks, causal /
    ``sliding_window``, and ``segments`` (the call has segment ids: every visited block is partial)."""
    if by not in ("q", "kv"):
        raise ValueError(f"block_schedule: by must be 'q' or 'kv', got {by!r}")
    if order not in ("ascending", "full_first", "partial_first"):
        raise ValueError(f"block_schedule: order must be 'ascending', 'full_first' or 'partial_first', got {order!r}")
    reachable = reachable_blocks(q_len, kv_len, q_block, kv_block, causal=causal, sliding_window=sliding_window)
    if block_mask is None:
        block_mask = np.ones((1, 1, *reachable.shape), dtype=bool)
    concrete = _is_concrete(block_mask)
    xp = np if concrete else jnp
    mask = xp.logical_and(xp.asarray(block_mask), reachable)
    partial = ~full_blocks(q_len, kv_len, q_block, kv_block, causal=causal, sliding_window=sliding_window)
    if segments:
        partial = np.ones_like(partial)
    if by == "kv":
        mask = xp.swapaxes(mask, 2, 3)
        partial = partial.T
    counts = xp.sum(mask, axis=3, dtype=xp.int32)
    max_visits = max(1, int(np.max(counts, initial=0)) if concrete else mask.shape[3])
    # enabled columns first, ascending: a stable sort of the disabled flags (full_first: of the class
    # 0 enabled full, 1 enabled partial, 2 disabled; partial_first: the enabled classes swapped)
    key = xp.where(mask, 0, 2).astype(xp.int8)
    if order != "ascending":
        first = np.asarray(partial if order == "full_first" else ~partial, dtype=np.int8)
        key = xp.where(mask, first, key).astype(xp.int8)
    if concrete:
        columns = np.argsort(key, axis=3, kind="stable")
    else:
        columns = jnp.argsort(key, axis=3, stable=True)
    columns = columns[..., :max_visits].astype(xp.int32)
    last = xp.take_along_axis(columns, xp.clip(counts - 1, 0, max_visits - 1)[..., None], axis=3)
    last = xp.where(counts[..., None] > 0, last, 0)
    step = xp.arange(max_visits, dtype=xp.int32)
    indices = xp.where(step < counts[..., None], columns, last).astype(xp.int32)
    partial_rows = xp.broadcast_to(xp.asarray(partial), (*mask.shape[:2], *partial.shape))
    partial = xp.take_along_axis(partial_rows, indices, axis=3)
    return BlockSchedule(indices=jnp.asarray(indices), counts=jnp.asarray(counts), partial=jnp.asarray(partial))
