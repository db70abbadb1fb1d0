"""The TPU flash attention's config (:class:`TpuFlashBlocks`): block sizes, their defaults, candidates and
the checks Mosaic's tiling rules impose."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from ejkernel.ops.utils.padding import round_up

from ejkernel_pallas.tpu_tiling import LANES, TpuTilingError, sublane_multiple


# ---------------------------------------------------------------------------------------------------
# The config: block sizes


@dataclasses.dataclass(frozen=True)
class TpuFlashBlocks:
    """The TPU kernels' config: rows of Q / rows of K,V per grid step of the forward (``fwd_*``), the dK/dV
    pass (``dkv_*``) and the dQ pass (``dq_*``).

    Used as given (lengths are padded to whole blocks); :func:`heuristic_blocks` fits one to a call. Blocks
    a TPU cannot tile for a call raise :class:`TpuTilingError` naming the field (:func:`validate_blocks`).
    """

    fwd_q: int
    fwd_kv: int
    dkv_q: int
    dkv_kv: int
    dq_q: int
    dq_kv: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TpuFlashBlocks.{field.name} must be a positive int, got {value!r}")


# Larger blocks amortize the ~0.35 us per-grid-step overhead of TPU pipelines; 512 rows of bf16 with
# D=128 keep Q, K, V, the f32 logits tile and double buffers well inside the 16-32 MiB of scoped VMEM.
DEFAULT_FWD_BLOCK = 512
DEFAULT_BWD_BLOCK = 256


def block_caps(head_dim: int) -> tuple[int, int]:
    """(forward, backward) row caps. A step holds double-buffered (block, D) tiles of Q, K, V (and dO, plus
    f32 dK/dV accumulators in the backward) beside the (block_q, block_kv) f32 logits: above D = 128 the
    tiles double, so the caps halve to keep the same VMEM footprint (an estimate; not measured on a TPU)."""
    if head_dim <= LANES:
        return DEFAULT_FWD_BLOCK, DEFAULT_BWD_BLOCK
    return DEFAULT_FWD_BLOCK // 2, DEFAULT_BWD_BLOCK // 2


def _default_block(length: int, cap: int, row_multiple: int) -> int:
    """Whole (padded) length when it fits in one block, else ``cap`` (a multiple of 128)."""
    if length <= cap:
        return round_up(length, row_multiple)
    return cap


def _row_multiple(dtype, has_mask: bool) -> int:
    """Rows of q-side blocks also index int8 masks (32-row tiles) and f32 metadata (8-row tiles)."""
    return max(sublane_multiple(dtype), 32 if has_mask else 8)


def heuristic_blocks(
    sq: int, skv: int, dtype=jnp.bfloat16, head_dim: int = LANES, has_mask: bool = False
) -> TpuFlashBlocks:
    """One block over a (padded) length up to the cap of :func:`block_caps`, else blocks of the cap
    (multiples of 128); the dQ pass uses the dK/dV pass's blocks."""
    rows = _row_multiple(dtype, has_mask)
    fwd_cap, bwd_cap = block_caps(head_dim)
    dkv_q, dkv_kv = _default_block(sq, bwd_cap, rows), _default_block(skv, bwd_cap, rows)
    return TpuFlashBlocks(
        fwd_q=_default_block(sq, fwd_cap, rows), fwd_kv=_default_block(skv, fwd_cap, rows),
        dkv_q=dkv_q, dkv_kv=dkv_kv, dq_q=dkv_q, dq_kv=dkv_kv,
    )


def candidate_blocks(
    sq: int, skv: int, dtype=jnp.bfloat16, head_dim: int = LANES, has_mask: bool = False
) -> list[TpuFlashBlocks]:
    """Autotuning candidates, pruned: the heuristic first, then square and 2:1 forward tiles of 128-multiples
    up to the padded lengths (as large as the VMEM caps allow, x2), each with backward blocks half as tall
    (the backward keeps twice the live tiles); at most 8, every one tiling on TPU."""
    heuristic = heuristic_blocks(sq, skv, dtype, head_dim, has_mask)
    fwd_cap, _ = block_caps(head_dim)

    def sizes(length):
        return [b for b in (128, 256, 512, 1024) if b <= min(2 * fwd_cap, round_up(length, LANES))]

    candidates = [heuristic]
    for bq in sizes(sq)[::-1]:
        for bk in sizes(skv)[::-1]:
            if max(bq, bk) <= 2 * min(bq, bk):
                hq, hk = max(bq // 2, LANES), max(bk // 2, LANES)
                candidates.append(TpuFlashBlocks(bq, bk, hq, hk, hq, hk))
    return list(dict.fromkeys(candidates))[:8]


def padded_lengths(blocks: TpuFlashBlocks, sq: int, skv: int) -> tuple[int, int]:
    """Lengths padded to whole blocks of every kernel (what the kernels see)."""
    return (round_up(sq, math.lcm(blocks.fwd_q, blocks.dkv_q, blocks.dq_q)),
            round_up(skv, math.lcm(blocks.fwd_kv, blocks.dkv_kv, blocks.dq_kv)))


def validate_blocks(blocks: TpuFlashBlocks, sq: int, skv: int, *, q_rows: int, kv_rows: int, kv_lanes: bool) -> None:
    """Refuse blocks a TPU cannot tile, naming the config field (before anything is lowered).

    Query-side blocks are rows of Q/O tiles and of per-query metadata: a multiple of ``q_rows``. Key-side
    blocks are rows of K/V tiles (a multiple of ``kv_rows``) and, with ``kv_lanes`` (per-key metadata,
    bias or mask), the lane dim of ``[.., 1, S]`` / ``[.., Sq, Skv]`` tiles: a multiple of 128. Either may
    instead be one block over the whole padded length."""
    sq_pad, skv_pad = padded_lengths(blocks, sq, skv)
    for field in ("fwd_q", "dkv_q", "dq_q"):
        value = getattr(blocks, field)
        if value != sq_pad and value % q_rows:
            raise TpuTilingError(
                f"TpuFlashBlocks.{field}={value}: a query block must be a multiple of {q_rows} rows "
                f"(TPU sublane tiles of the query-side arrays) or one block over the padded length {sq_pad}"
            )
    if kv_lanes:
        need, why = LANES, "the lane dim of per-key metadata / bias / mask tiles"
    else:
        need, why = kv_rows, "sublane rows of the K/V tiles"
    for field in ("fwd_kv", "dkv_kv", "dq_kv"):
        value = getattr(blocks, field)
        if value != skv_pad and value % need:
            raise TpuTilingError(
                f"TpuFlashBlocks.{field}={value}: a key/value block must be a multiple of {need} ({why}) "
                f"or one block over the padded length {skv_pad}"
            )
