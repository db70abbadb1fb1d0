"""Triton ``ragged_page_attention``: a mixed batch of prefill chunks and decode rows over one paged cache.

The batch is split by what each sequence needs (on the device, from ``query_start_loc``; shapes stay static):

- decode rows (``q_len == 1``): the split-K decode kernels of ``ejkernel_triton.decode`` (one program per
  split, sequence and kv head; the kv group's query heads are the rows of the tile), reading the query from
  its packed row and the interleaved K/V pages in place; their ``[max_num_seqs, H, D]`` result is scattered
  into the packed output (one row per decode sequence).
- prefill chunks (``q_len > 1``) and the padding rows: ``_prefill_kernel``, one program per (query tile,
  kv head). A tile is up to ``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query
  heads of the kv head (``BLOCK_M = BLOCK_Q * GROUP_P`` rows), so each page is read once for the whole
  group. It walks the keys ``BLOCK_N`` at a time through the block table: mask-free steps while every row
  sees every key (below the tile's first position, no window), then masked steps (causal, window, end).
  Padding rows form a last pseudo-sequence with no keys: they get zeros. The tile list is computed on the
  device (``tile_table``); tiles past its end return at once.

Page ids that are read are clamped into ``[0, num_pages)`` as in the decode kernels (a bad id reads some other
page); entries past a sequence's last page are never read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel_triton.decode.kernels import (
    DecodeStatic,
    _fold_values,
    _kv_offsets,
    _placeholder,
    _sink_state,
    _compute_query,
    _scale_kind,
    _split_program,
    _step_scales,
    forward_only,
    split_decode,
)
from ejkernel_triton.flash_attention.common import padded_dim, scores
from ejkernel_triton.flash_attention.tiles import load_tile
from ejkernel_triton.launch import launch
from ejkernel_triton.ragged_page_attention.config import TritonRaggedPageConfig, padded_group

TILE_FIELDS = 5
"""Columns of the tile table: table row (sequence), first row, end row, position of the first row, kv length."""


@dataclasses.dataclass(frozen=True)
class RaggedPageStatic:
    scale: float
    softcap: float  # 0.0: none
    window: int | None  # None: none; else a query sees keys p - window < j <= p
    config: TritonRaggedPageConfig
    interpret: bool


@triton.jit
def _prefill_fold(acc, m_i, l_i, q, KV, Tables, seq, kvh, start, stop, pos, kv_len, offs_n, offs_d, scale,
                  softcap, KScale, VScale, MASKED: tl.constexpr, WINDOW: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr,
                  NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr,
                  ROW_STRIDE: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  KV_HEADS: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """Online softmax of the tile's rows over keys ``[start, stop)``; ``MASKED``: per-row causal/window masks.
    Quantized pages multiply in ``q``'s dtype (float16 for bf16 queries: ``_compute_query``), dequantized as in
    the decode kernels (``_step_scales``)."""
    for n0 in range(start, stop, BLOCK_N):
        offs = _kv_offsets(Tables, seq, kvh, n0, offs_n, offs_d, stop, MASKED, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                           PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, 0, BLOCK_N)
        keys = n0 + offs_n
        k = load_tile(KV + offs, (keys < stop)[:, None], offs_d, D, BLOCK_D, MASKED).to(q.dtype)
        qk_scale, v_scale = _step_scales(Tables, seq, kvh, n0, offs_n, stop, scale, KScale, VScale, MASKED,
                                         PAGE_SIZE, MAX_PAGES, NUM_PAGES, KV_HEADS, BLOCK_N, K_SCALE, V_SCALE)
        s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        if MASKED:
            visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len)
            if WINDOW >= 0:
                visible = visible & (pos[:, None] - keys[None, :] < WINDOW)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _fold_values(acc, m_i, l_i, s, KV + D + offs, keys < stop, offs_d, q, v_scale, D, BLOCK_D,
                                     MASKED, DOT_PRECISION, V_SCALE > 0)
    return acc, m_i, l_i


@triton.jit
def _prefill_program(
    tile, kvh,  # the program's place in the grid
    Q, KV, Tiles, Tables, Aux, KScale, VScale, scale, softcap, Out,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr,
    NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr,
    WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):
    """One prefill tile (rows of the table's entry ``tile``) for kv head ``kvh``; nothing past the last tile."""
    seq = tl.load(Tiles + tile * 5)
    row0 = tl.load(Tiles + tile * 5 + 1)
    row1 = tl.load(Tiles + tile * 5 + 2)
    pos0 = tl.load(Tiles + tile * 5 + 3)
    kv_len = tl.load(Tiles + tile * 5 + 4)
    if row1 > row0:
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        token = offs_m // GROUP_P
        g = offs_m % GROUP_P
        row = row0 + token
        row_ok = (row < row1) & (g < GROUP)
        heads = kvh * GROUP + g
        q_rows = row.to(tl.int64) * H + heads
        io_mask = row_ok[:, None] & (offs_d[None, :] < D)
        q = tl.load(Q + q_rows[:, None] * D + offs_d[None, :], mask=io_mask, other=0.0)
        q, scale = _compute_query(q, scale, KV)
        pos = pos0 + token
        m_i, l_i = _sink_state(Aux, heads, row_ok, NUM_SINKS, BLOCK_SINKS, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(kv_len, pos0 + (row1 - row0))  # past the tile's last position nothing is visible
        if WINDOW >= 0:
            lo = tl.maximum(pos0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _prefill_fold(acc, m_i, l_i, q, KV, Tables, seq, kvh, lo, hi, pos, kv_len, offs_n,
                                          offs_d, scale, softcap, KScale, VScale, True, WINDOW, D, BLOCK_D, BLOCK_N,
                                          PAGE_SIZE, MAX_PAGES, NUM_PAGES, PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE,
                                          USE_SOFTCAP, DOT_PRECISION, H // GROUP, K_SCALE, V_SCALE)
        else:
            # keys <= pos0 (and < kv_len) are visible to every row of the tile: no mask
            full_hi = tl.maximum(tl.minimum(pos0 + 1, hi), 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _prefill_fold(acc, m_i, l_i, q, KV, Tables, seq, kvh, 0, full_hi, pos, kv_len, offs_n,
                                          offs_d, scale, softcap, KScale, VScale, False, WINDOW, D, BLOCK_D,
                                          BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES, PAGE_STRIDE, HEAD_STRIDE,
                                          ROW_STRIDE, USE_SOFTCAP, DOT_PRECISION, H // GROUP, K_SCALE, V_SCALE)
            acc, m_i, l_i = _prefill_fold(acc, m_i, l_i, q, KV, Tables, seq, kvh, full_hi, hi, pos, kv_len, offs_n,
                                          offs_d, scale, softcap, KScale, VScale, True, WINDOW, D, BLOCK_D, BLOCK_N,
                                          PAGE_SIZE, MAX_PAGES, NUM_PAGES, PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE,
                                          USE_SOFTCAP, DOT_PRECISION, H // GROUP, K_SCALE, V_SCALE)
        # rows without a visible key (padding rows, empty windows) have a value sum of 0: zeros
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Out + q_rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=io_mask)


@triton.jit
def _prefill_kernel(
    Q, KV, Tiles, Tables, Aux, KScale, VScale, scale, softcap,  # inputs
    Out,  # output
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr,
    NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr,
    WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
):
    _prefill_program(tl.program_id(0), tl.program_id(1), Q, KV, Tiles, Tables, Aux, KScale, VScale, scale, softcap,
                     Out, H, GROUP, GROUP_P, BLOCK_M, D, BLOCK_D, BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                     PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, WINDOW, USE_SOFTCAP, NUM_SINKS, BLOCK_SINKS, DOT_PRECISION,
                     K_SCALE, V_SCALE)


@triton.jit
def _mixed_kernel(
    Tiles, Q, K, V, Starts, Ends, Tables, Aux, QRows, KScale, VScale, scale, softcap,  # the split programs' from Q on
    Out, DecOut, PartAcc, PartM, PartL, Counter,  # outputs: the prefill rows, then the split programs'
    GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, PREFILL_BLOCK_N: tl.constexpr,
    MAX_TILES: tl.constexpr, KV_HEADS: tl.constexpr, MAX_SEQS: tl.constexpr,
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr,
    HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr, SEQ_STRIDE: tl.constexpr,
    HAS_START: tl.constexpr, WINDOW_LEFT: tl.constexpr, MAX_LEN: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, V_SHIFT: tl.constexpr,
    HAS_QROWS: tl.constexpr, ALIGN_LO: tl.constexpr, INLINE_COMBINE: tl.constexpr, K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """One launch for the whole mixed batch: the decode split programs first (memory-bound streams, started
    first), then the prefill tiles (compute-bound), so that SMs run both at once instead of one launch after
    the other. ``INTERLEAVE`` (> 0: that many pairs): decode and prefill programs alternate in the grid (then
    the rest of the larger part), so that the first wave already holds both kinds on every SM. A 1-D grid;
    each part keeps its own grid order (splits fastest; tiles fastest)."""
    pid = tl.program_id(0)
    decode_programs = NUM_SPLITS * MAX_SEQS * KV_HEADS * HEAD_BLOCKS
    if INTERLEAVE:  # INTERLEAVE: the pairs (decode, prefill) that alternate, min of both parts' programs
        if pid < 2 * INTERLEAVE:
            is_decode = pid % 2 == 0
            idx = pid // 2
        else:  # the rest of the larger part
            is_decode = (pid * 0 + decode_programs) > MAX_TILES * KV_HEADS
            idx = pid - INTERLEAVE
    else:
        is_decode = pid < decode_programs
        idx = tl.where(is_decode, pid, pid - decode_programs)
    if is_decode:
        pid = idx
        _split_program(pid % NUM_SPLITS, (pid // NUM_SPLITS) % MAX_SEQS, pid // (NUM_SPLITS * MAX_SEQS), Q, K, V,
                       Starts, Ends, Tables, Aux, QRows, KScale, VScale, scale, softcap, DecOut, PartAcc, PartM, PartL,
                       Counter, H, GROUP, HEAD_BLOCKS, D, BLOCK_D, BLOCK_H, BLOCK_N, CHUNK, NUM_SPLITS, PAGE_SIZE,
                       MAX_PAGES, NUM_PAGES, PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, HAS_START, WINDOW_LEFT,
                       MAX_LEN, USE_SOFTCAP, NUM_SINKS, BLOCK_SINKS, DOT_PRECISION, V_SHIFT, HAS_QROWS, ALIGN_LO,
                       INLINE_COMBINE, K_SCALE, V_SCALE)
    else:
        t = idx
        _prefill_program(t % MAX_TILES, t // MAX_TILES, Q, K, Tiles, Tables, Aux, KScale, VScale, scale, softcap, Out,
                         H, GROUP, GROUP_P, BLOCK_M, D, BLOCK_D, PREFILL_BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                         PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, WINDOW, USE_SOFTCAP, NUM_SINKS, BLOCK_SINKS,
                         DOT_PRECISION, K_SCALE, V_SCALE)


# ---- host side ---------------------------------------------------------------------------------------


def max_tiles(total_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static bound on the tiles: each sequence's partial last tile adds one, and so do the padding rows."""
    return -(-total_tokens // block_q) + max_num_seqs + 1


def tile_table(query_start_loc, context_lens, num_seqs, total_tokens: int, block_q: int):
    """``(tiles [max_tiles, TILE_FIELDS] int32, is_decode [max_num_seqs] bool)``: the prefill kernel's tiles
    (sequences with ``q_len > 1``, then the padding rows as a sequence with no keys), and which sequences
    are decode rows (active, ``q_len == 1``)."""
    num_slots = context_lens.shape[0]
    starts = query_start_loc.astype(jnp.int32)
    q_lens = starts[1:] - starts[:-1]
    active = jnp.arange(num_slots) < num_seqs[0]
    is_decode = active & (q_lens == 1)
    counts = jnp.where(active & (q_lens > 1), -(-q_lens // block_q), 0)
    pad_start = starts[num_seqs[0]]
    counts = jnp.concatenate([counts, (-(-(total_tokens - pad_start) // block_q))[None]])
    first_row = jnp.concatenate([starts[:-1], pad_start[None]])
    end_row = jnp.concatenate([starts[1:], jnp.full((1,), total_tokens, jnp.int32)])
    kv_lens = jnp.concatenate([context_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    ends = jnp.cumsum(counts)
    tile = jnp.arange(max_tiles(total_tokens, num_slots, block_q), dtype=jnp.int32)
    owner = jnp.searchsorted(ends, tile, side="right")
    live = owner <= num_slots
    owner = jnp.minimum(owner, num_slots)
    local = tile - (ends - counts)[owner]
    row0 = first_row[owner] + local * block_q
    row1 = jnp.minimum(row0 + block_q, end_row[owner])
    pos0 = kv_lens[owner] - (end_row[owner] - first_row[owner]) + local * block_q
    tiles = jnp.stack([jnp.minimum(owner, num_slots - 1), jnp.where(live, row0, 0), jnp.where(live, row1, 0),
                       pos0, kv_lens[owner]], axis=1).astype(jnp.int32)
    return tiles, is_decode


def ragged_page_forward(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, aux, key_scale,
                        value_scale, st: RaggedPageStatic):
    """``aux``: sinks float32 [H, num_sinks] or None; ``key_scale``/``value_scale``: float32 ``[Hkv]`` or
    ``[num_pages, Hkv]`` dequantization scales, or None. Returns [total_tokens, H, D] in queries' dtype."""
    total_tokens, num_heads, head_dim = queries.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    kv_heads = combined // 2
    group = num_heads // kv_heads
    max_num_seqs, max_pages = block_tables.shape
    cfg = st.config
    group_p = padded_group(group)
    block_m = max(cfg.block_m, group_p)
    tiles, is_decode = tile_table(query_start_loc, context_lens, num_seqs, total_tokens, block_m // group_p)
    num_sinks = 0 if aux is None else aux.shape[1]
    strides = dict(PAGE_SIZE=page_size, MAX_PAGES=max_pages, NUM_PAGES=num_pages,
                   PAGE_STRIDE=page_size * combined * head_dim, HEAD_STRIDE=2 * head_dim,
                   ROW_STRIDE=combined * head_dim)
    prefill_shape = jax.ShapeDtypeStruct(queries.shape, queries.dtype)
    prefill_constexprs = dict(GROUP_P=group_p, BLOCK_M=block_m, WINDOW=-1 if st.window is None else st.window)
    prefill = None
    if not cfg.fused:
        (prefill,) = launch(
            _prefill_kernel,
            [queries, kv_pages, tiles, block_tables, aux if aux is not None else _placeholder(jnp.float32),
             *(x if x is not None else _placeholder(jnp.float32) for x in (key_scale, value_scale)),
             np.float32(st.scale), np.float32(st.softcap)],
            [prefill_shape], (tiles.shape[0], kv_heads),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages(), interpret=st.interpret,
            H=num_heads, GROUP=group, D=head_dim, BLOCK_D=padded_dim(head_dim), BLOCK_N=cfg.block_n,
            USE_SOFTCAP=st.softcap > 0, NUM_SINKS=num_sinks,
            BLOCK_SINKS=max(2, 1 << max(num_sinks - 1, 0).bit_length()),
            DOT_PRECISION="ieee" if queries.dtype == jnp.float32 else "tf32", K_SCALE=_scale_kind(key_scale),
            V_SCALE=_scale_kind(value_scale), **prefill_constexprs, **strides)

    def run_mixed(args, out_shapes, grid, num_warps, num_stages, zeroed, constexprs):
        """The split programs and the prefill tiles in one launch (``cfg.fused``)."""
        nonlocal prefill
        programs = math.prod(grid) + tiles.shape[0] * kv_heads
        outs = launch(_mixed_kernel, [tiles, *args], [prefill_shape, *out_shapes], (programs,),
                      num_warps=cfg.num_warps, num_stages=max(num_stages, cfg.num_stages()),
                      zeroed_outputs=tuple(i + 1 for i in zeroed), interpret=st.interpret,
                      PREFILL_BLOCK_N=cfg.block_n, MAX_TILES=tiles.shape[0], KV_HEADS=kv_heads, MAX_SEQS=grid[1],
                      INTERLEAVE=min(math.prod(grid), tiles.shape[0] * kv_heads) if cfg.interleave else 0,
                      **prefill_constexprs, **constexprs)
        prefill = outs[0]
        return outs[1:]

    # decode rows: the split-K kernels, sequences that are not decode rows see no keys (and are not scattered)
    starts = query_start_loc[:-1]
    ends = jnp.where(is_decode, context_lens, 0).astype(jnp.int32)
    q_rows = jnp.clip(jnp.where(is_decode, starts, 0), 0, max(total_tokens - 1, 0)).astype(jnp.int32)
    dst = DecodeStatic(scale=st.scale, softcap=st.softcap, page_size=page_size, max_len=-1,
                       window_left=-1 if st.window is None else st.window - 1, config=cfg.decode_config(),
                       interpret=st.interpret, operation="ragged_page_attention", interleaved=True)
    decoded = split_decode(queries, kv_pages, None, None, ends, block_tables, aux, dst, q_rows=q_rows,
                           run_split=run_mixed if cfg.fused else None, key_scale=key_scale, value_scale=value_scale)
    return prefill.at[jnp.where(is_decode, starts, total_tokens)].set(decoded, mode="drop")


@functools.lru_cache(maxsize=None)
def _attend_fn(st: RaggedPageStatic):
    return forward_only(functools.partial(ragged_page_forward, st=st), "ragged_page_attention")


def ragged_page_attention(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, aux,
                          st: RaggedPageStatic, key_scale=None, value_scale=None) -> jax.Array:
    return _attend_fn(st)(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, aux, key_scale,
                          value_scale)
