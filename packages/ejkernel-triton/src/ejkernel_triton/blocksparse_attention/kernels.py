"""The block-sparse kernels: forward (`_fwd_kernel`), dK/dV (`_dkv_kernel`) and dQ (`_dq_kernel`).

Each program walks a schedule (`ejkernel.ops.utils.block_sparse.block_schedule`, reordered by
:func:`kernel_schedule`) instead of a contiguous range: the forward and dQ programs own a query tile and
visit the key blocks of its mask row, the dK/dV programs own a key tile and visit the query blocks of its
mask column (the transposed schedule), looping over the query heads of their kv head's group (GQA without
repeated kv, no atomics). A disabled block is never loaded. Kernel tiles divide the mask's blocks, so a
visited mask block is ``block_size // tile`` consecutive tiles; the full blocks come first and run the
unmasked tile step, the partial ones (a causal/window boundary, a ragged tail, segment ids) the masked one.
The tile steps, online softmax, sinks and stores are flash attention's (`flash_attention.tiles`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel.ops.utils.block_sparse import block_schedule, full_blocks
from ejkernel_triton.flash_attention.backward import row_delta
from ejkernel_triton.flash_attention.common import StaticParams, kernel_meta, placeholder
from ejkernel_triton.flash_attention.tiles import (
    dkv_tile,
    dq_tile,
    fwd_tile,
    gradient_rows,
    key_operands,
    query_operands,
    sink_blocks,
    sink_state,
    store_rows,
    store_tma_rows,
    store_token_tile,
    tma_descriptors,
    tma_tile,
    token_tile,
)
from ejkernel_triton.launch import launch

_FLASH_ONLY = ("IS_VARLEN", "DROPOUT", "DROP_THRESHOLD", "DROP_SCALE")


def kernel_schedule(call, by: str):
    """(indices, num_full, counts) of ``block_schedule(call, by=by)`` with each row's full blocks first
    (ascending), then its partial ones (ascending): a kernel runs ``[0, num_full)`` unmasked and
    ``[num_full, counts)`` masked. int32 ``[mask_batch, mask_heads, rows, max_visits]``, ``[..., rows]`` x2."""
    schedule = block_schedule(call, by=by, order="full_first")  # one sort (the helper orders the classes)
    counts = schedule.counts.astype(jnp.int32)
    whole = full_blocks(call.query.shape[1], call.key.shape[1], call.q_block_size, call.kv_block_size,
                        causal=call.causal, sliding_window=call.sliding_window)
    if call.q_segment_ids is None and whole.all():
        return schedule.indices, counts, counts  # every visit full: no reduction kernel for num_full
    valid = jnp.arange(schedule.indices.shape[-1], dtype=jnp.int32) < schedule.counts[..., None]
    num_full = jnp.sum(valid & ~schedule.partial, axis=-1, dtype=jnp.int32)
    return schedule.indices, num_full, counts


@triton.jit
def _schedule_row(Indices, NumFull, Counts, batch, head, row, MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr,
                  ROWS: tl.constexpr, MAX_VISITS: tl.constexpr):
    """(visits pointer, number of full visits, number of visits) of schedule row `row` for (batch, head).
    A mask of batch or heads 1 is shared; `batch % MASK_BATCH` also maps a vmap-folded batch back."""
    sched = ((batch % MASK_BATCH) * MASK_HEADS + head % MASK_HEADS) * ROWS + row
    return Indices + sched.to(tl.int64) * MAX_VISITS, tl.load(NumFull + sched), tl.load(Counts + sched)


@triton.jit
def _next_visit(visits, i, TILES: tl.constexpr, MAX_VISITS: tl.constexpr):
    """The block of flattened tile `i + 1` (clamped inside the row). The unmasked loops read it one iteration
    ahead into a register: loaded in the iteration that uses it, Triton 3.6's pipeliner gives the index load
    a stage of its own (an async copy) and the K/V tiles then arrive only one stage ahead (`async_wait 0`
    instead of flash attention's `num_stages - 1` tiles in flight; seen in the sm_90 TTGIR)."""
    return tl.load(visits + tl.minimum((i + 1) // TILES, MAX_VISITS - 1))


@triton.jit
def _fwd_query_tile(
    Q, K, V, QSeg, KSeg, Aux, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV, O, LSE, m0, batch, head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    """The forward of query tile `m0` of (batch, head) over its schedule row (the body of `_fwd_kernel` and of
    each item of `_fwd_persistent_kernel`)."""
    b64 = batch.to(tl.int64)  # element offsets of large batches overflow int32
    kv_head = head // GROUP
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q

    q, k_ptrs, v_ptrs, k_seg_ptr, q_seg = query_operands(
        Q, K, V, QSeg, KSeg, b64, head, kv_head, 0, 0, rows, SEQ_Q, offs_kv, offs_d, offs_dv, SEQ_Q, SEQ_KV,
        stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, D, HAS_SEGMENTS)
    acc = tl.zeros([BLOCK_Q, BLOCK_DV], dtype=tl.float32)
    m_i, l_i = sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)
    visits, num_full, count = _schedule_row(Indices, NumFull, Counts, batch, head, m0 // Q_BLOCK_SIZE,
                                            MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS)
    TILES: tl.constexpr = KV_BLOCK_SIZE // BLOCK_KV
    block_next = tl.load(visits)
    for i in range(0, num_full * TILES):
        n0 = block_next * KV_BLOCK_SIZE + (i % TILES) * BLOCK_KV
        block_next = _next_visit(visits, i, TILES, MAX_VISITS)
        acc, m_i, l_i = fwd_tile(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, n0, rows, offs_kv, offs_d, offs_dv, SEQ_Q,
            SEQ_KV, k_seg_ptr, q_seg, qk_scale, softcap, 0, 0, 0, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION, False, 0, 1.0)
    for i in range(num_full * TILES, count * TILES):
        n0 = tl.load(visits + i // TILES) * KV_BLOCK_SIZE + (i % TILES) * BLOCK_KV
        acc, m_i, l_i = fwd_tile(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, n0, rows, offs_kv, offs_d, offs_dv, SEQ_Q,
            SEQ_KV, k_seg_ptr, q_seg, qk_scale, softcap, 0, 0, 0, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, False, 0, 1.0)

    o_ptrs = token_tile(O, b64, 0, head, rows, offs_dv, SEQ_Q, stride_os, stride_oh)
    store_rows(o_ptrs, LSE + (b64 * NUM_HEADS + head) * SEQ_Q + rows, acc, m_i, l_i,
               (rows[:, None] < SEQ_Q) & (offs_dv[None, :] < DV), rows < SEQ_Q)


@triton.jit
def _fwd_kernel(
    Q, K, V, QSeg, KSeg, Aux, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs, scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    """One program per (query tile, batch, head)."""
    _fwd_query_tile(
        Q, K, V, QSeg, KSeg, Aux, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV, O, LSE,
        tl.program_id(0) * BLOCK_Q, tl.program_id(1), tl.program_id(2), NUM_HEADS, GROUP, stride_qs, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_oh, D, DV, BLOCK_D, BLOCK_DV, BLOCK_Q,
        BLOCK_KV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, USE_SOFTCAP, HAS_SEGMENTS, NUM_SINKS, BLOCK_SINKS,
        DOT_PRECISION, MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS, Q_BLOCK_SIZE, KV_BLOCK_SIZE)


@triton.jit
def _fwd_persistent_kernel(
    Q, K, V, QSeg, KSeg, Aux, Indices, NumFull, Counts, Order, qk_scale, softcap, SEQ_Q, SEQ_KV, NUM_ITEMS,
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, Q_TILES: tl.constexpr,
):
    """A fixed number of programs (`TritonBlockSparseConfig.persistent_forward` per SM), each taking the
    (batch, head, query tile) items `Order[program], Order[program + programs], ...`; `Order` lists the items
    longest schedule row first (an item is `(batch * NUM_HEADS + head) * Q_TILES + tile`), so the last items
    to start are the shortest (no long tail) and no program start is paid per item."""
    for slot in range(tl.program_id(0), NUM_ITEMS, tl.num_programs(0)):
        item = tl.load(Order + slot)
        tile = item % Q_TILES
        batch_head = item // Q_TILES
        _fwd_query_tile(
            Q, K, V, QSeg, KSeg, Aux, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV, O, LSE,
            tile * BLOCK_Q, batch_head // NUM_HEADS, batch_head % NUM_HEADS, NUM_HEADS, GROUP, stride_qs,
            stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_os, stride_oh, D, DV, BLOCK_D, BLOCK_DV,
            BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, USE_SOFTCAP, HAS_SEGMENTS, NUM_SINKS,
            BLOCK_SINKS, DOT_PRECISION, MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS, Q_BLOCK_SIZE, KV_BLOCK_SIZE)


@triton.jit
def _tma_visits(acc, m_i, l_i, q, k_desc, v_desc, row_visits, slots, count, kv_row0, kv_col, qk_scale, softcap,
                USE_SOFTCAP: tl.constexpr, TILES: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr):
    """The TMA forwards' warp-specialized loop over a schedule row's `count` visits (`row_visits` in registers).
    A row that visits nothing still runs one visit (of its padding entry, block 0) whose result is discarded:
    a warp-specialized loop of zero trips hung the GPU (H200, 2026-11-23: both TMA tests stalled on masks with
    empty rows), so the loop always has a trip and the empty row keeps its initial (sink) state, i.e. zeros
    and the sinks' log-sum-exp as `store_rows` writes them."""
    m_start, l_start = m_i, l_i
    for i in tl.range(0, tl.maximum(count, 1) * TILES, warp_specialize=True):
        block = tl.sum(tl.where(slots == i // TILES, row_visits, 0), 0)
        n0 = block * KV_BLOCK_SIZE + (i % TILES) * BLOCK_KV
        acc, m_i, l_i = tma_tile(acc, m_i, l_i, q, k_desc, v_desc, kv_row0 + n0, kv_col, qk_scale, softcap,
                                 USE_SOFTCAP)
    empty = count == 0
    return tl.where(empty, 0.0, acc), tl.where(empty, m_start, m_i), tl.where(empty, l_start, l_i)


@triton.jit
def _fwd_tma_kernel(
    Q, K, V, Aux, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs and scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    VISITS_P2: tl.constexpr, Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    """The forward for Hopper on calls whose every visited block is full (`tma_forward_applies`):
    flash attention's TMA + warp-specialized loop (`flash_attention.forward._fwd_tma_kernel`) walking the
    schedule. Triton 3.6's warp specialization pass fails on a loop that loads its block index from memory
    and on a kernel with a second (masked) loop (sm_90 lowering, 2026-11-23), hence: the row's visit list is
    read into registers once and each step picks its entry with a masked sum, and calls with partial blocks
    (causal, window, segment ids, ragged lengths) keep `_fwd_kernel`."""
    m0 = tl.program_id(0) * BLOCK_Q
    batch = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_desc, k_desc, v_desc = tma_descriptors(Q, K, V, tl.num_programs(1) * SEQ_Q, tl.num_programs(1) * SEQ_KV,
                                             NUM_HEADS, GROUP, D, BLOCK_Q, BLOCK_KV)
    q = q_desc.load([batch * SEQ_Q + m0, head * D])
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    m_i, l_i = sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)
    visits, _, count = _schedule_row(Indices, NumFull, Counts, batch, head, m0 // Q_BLOCK_SIZE,
                                     MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS)
    slots = tl.arange(0, VISITS_P2)
    row_visits = tl.load(visits + slots, mask=slots < MAX_VISITS, other=0)
    TILES: tl.constexpr = KV_BLOCK_SIZE // BLOCK_KV
    acc, m_i, l_i = _tma_visits(acc, m_i, l_i, q, k_desc, v_desc, row_visits, slots, count, batch * SEQ_KV,
                                kv_head * D, qk_scale, softcap, USE_SOFTCAP, TILES, KV_BLOCK_SIZE, BLOCK_KV)
    store_tma_rows(O, LSE, acc, m_i, l_i, batch, head, m0, SEQ_Q, NUM_HEADS, D, BLOCK_Q)


@triton.jit
def _fwd_tma_persistent_kernel(
    Q, K, V, Aux, Indices, NumFull, Counts, Order, qk_scale, softcap, SEQ_Q, SEQ_KV, NUM_ITEMS,
    O, LSE,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    VISITS_P2: tl.constexpr, Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, Q_TILES: tl.constexpr,
    BATCH: tl.constexpr,
):
    """The persistent form of `_fwd_tma_kernel` (`TritonBlockSparseConfig.persistent_forward` programs per
    SM): the TMA descriptors are made once per program, which then loops over the (batch, head, query tile)
    items `Order[program], Order[program + programs], ...` (longest schedule rows first, as
    `_fwd_persistent_kernel`); each item runs the warp-specialized visit loop of `_fwd_tma_kernel` (Triton 3.6
    warp-specializes the inner loop: one `ttg.warp_specialize`, as the one-item kernel, on the sm_90 TTGIR)."""
    q_desc, k_desc, v_desc = tma_descriptors(Q, K, V, BATCH * SEQ_Q, BATCH * SEQ_KV, NUM_HEADS, GROUP, D, BLOCK_Q,
                                             BLOCK_KV)
    TILES: tl.constexpr = KV_BLOCK_SIZE // BLOCK_KV
    slots = tl.arange(0, VISITS_P2)
    for slot in range(tl.program_id(0), NUM_ITEMS, tl.num_programs(0)):
        item = tl.load(Order + slot)
        m0 = (item % Q_TILES) * BLOCK_Q
        batch = item // Q_TILES // NUM_HEADS
        head = (item // Q_TILES) % NUM_HEADS
        kv_head = head // GROUP
        q = q_desc.load([batch * SEQ_Q + m0, head * D])
        acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
        m_i, l_i = sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)
        visits, _, count = _schedule_row(Indices, NumFull, Counts, batch, head, m0 // Q_BLOCK_SIZE,
                                         MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS)
        row_visits = tl.load(visits + slots, mask=slots < MAX_VISITS, other=0)
        acc, m_i, l_i = _tma_visits(acc, m_i, l_i, q, k_desc, v_desc, row_visits, slots, count, batch * SEQ_KV,
                                    kv_head * D, qk_scale, softcap, USE_SOFTCAP, TILES, KV_BLOCK_SIZE, BLOCK_KV)
        store_tma_rows(O, LSE, acc, m_i, l_i, batch, head, m0, SEQ_Q, NUM_HEADS, D, BLOCK_Q)



@triton.jit
def _dkv_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DKOut, DVOut,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_KV
    batch = tl.program_id(1)
    kv_head = tl.program_id(2)
    b64 = batch.to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = n0 + offs_kv

    k, v, k_seg = key_operands(K, V, KSeg, b64, kv_head, 0, cols, SEQ_KV, offs_d, offs_dv, SEQ_KV, stride_ks,
                               stride_kh, stride_vs, stride_vh, D, DV, HAS_SEGMENTS)
    q_seg_ptr = QSeg + b64 * SEQ_Q

    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_DV], dtype=tl.float32)
    TILES: tl.constexpr = Q_BLOCK_SIZE // BLOCK_Q
    # Every query head of this kv head's group adds to the same dK/dV; each follows its own mask column.
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_ptrs = token_tile(Q, b64, 0, head, offs_q, offs_d, SEQ_Q, stride_qs, stride_qh)
        do_ptrs = token_tile(DO, b64, 0, head, offs_q, offs_dv, SEQ_Q, stride_os, stride_oh)
        row_offset = (b64 * NUM_HEADS + head) * SEQ_Q
        visits, num_full, count = _schedule_row(Indices, NumFull, Counts, batch, head, n0 // KV_BLOCK_SIZE,
                                                MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS)
        block_next = tl.load(visits)
        for i in range(0, num_full * TILES):
            m0 = block_next * Q_BLOCK_SIZE + (i % TILES) * BLOCK_Q
            block_next = _next_visit(visits, i, TILES, MAX_VISITS)
            dk, dv = dkv_tile(
                dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, m0, cols, offs_q,
                offs_d, offs_dv, SEQ_Q, SEQ_KV, k_seg, stride_qs, stride_os, qk_scale, softcap, 0, 0, 0, D, DV,
                BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False,
                DOT_PRECISION, False, 0, 1.0)
        for i in range(num_full * TILES, count * TILES):
            m0 = tl.load(visits + i // TILES) * Q_BLOCK_SIZE + (i % TILES) * BLOCK_Q
            dk, dv = dkv_tile(
                dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, m0, cols, offs_q,
                offs_d, offs_dv, SEQ_Q, SEQ_KV, k_seg, stride_qs, stride_os, qk_scale, softcap, 0, 0, 0, D, DV,
                BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True,
                DOT_PRECISION, False, 0, 1.0)

    dk = dk * qk_scale
    store_token_tile(DKOut, dk, b64, 0, kv_head, cols, SEQ_KV, offs_d, D, SEQ_KV, stride_ks, stride_kh)
    store_token_tile(DVOut, dv, b64, 0, kv_head, cols, SEQ_KV, offs_dv, DV, SEQ_KV, stride_vs, stride_vh)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, Indices, NumFull, Counts, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DQ,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK_BATCH: tl.constexpr, MASK_HEADS: tl.constexpr, ROWS: tl.constexpr, MAX_VISITS: tl.constexpr,
    Q_BLOCK_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_Q
    batch = tl.program_id(1)
    head = tl.program_id(2)
    b64 = batch.to(tl.int64)
    kv_head = head // GROUP
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q
    q, k_ptrs, v_ptrs, k_seg_ptr, q_seg = query_operands(
        Q, K, V, QSeg, KSeg, b64, head, kv_head, 0, 0, rows, SEQ_Q, offs_kv, offs_d, offs_dv, SEQ_Q, SEQ_KV,
        stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, D, HAS_SEGMENTS)
    do, lse, delta = gradient_rows(DO, LSE, Delta, b64, head, 0, rows, SEQ_Q, offs_dv, SEQ_Q, stride_os, stride_oh,
                                   NUM_HEADS, DV)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    visits, num_full, count = _schedule_row(Indices, NumFull, Counts, batch, head, m0 // Q_BLOCK_SIZE,
                                            MASK_BATCH, MASK_HEADS, ROWS, MAX_VISITS)
    TILES: tl.constexpr = KV_BLOCK_SIZE // BLOCK_KV
    block_next = tl.load(visits)
    for i in range(0, num_full * TILES):
        n0 = block_next * KV_BLOCK_SIZE + (i % TILES) * BLOCK_KV
        block_next = _next_visit(visits, i, TILES, MAX_VISITS)
        dq = dq_tile(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, n0, rows, offs_kv, offs_d, offs_dv, SEQ_Q,
            SEQ_KV, k_seg_ptr, q_seg, qk_scale, softcap, 0, 0, 0, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION, False, 0, 1.0)
    for i in range(num_full * TILES, count * TILES):
        n0 = tl.load(visits + i // TILES) * KV_BLOCK_SIZE + (i % TILES) * BLOCK_KV
        dq = dq_tile(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, n0, rows, offs_kv, offs_d, offs_dv, SEQ_Q,
            SEQ_KV, k_seg_ptr, q_seg, qk_scale, softcap, 0, 0, 0, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, False, 0, 1.0)
    dq = dq * qk_scale
    store_token_tile(DQ, dq, b64, 0, head, rows, SEQ_Q, offs_d, D, SEQ_Q, stride_qs, stride_qh)


def _meta(q, k, v, st: StaticParams, has_segments: bool, schedule, q_block_size: int, kv_block_size: int) -> dict:
    """Constexprs of the three kernels: flash attention's (`common.kernel_meta`) and the schedule's shape."""
    meta = {name: value for name, value in kernel_meta(q, k, v, st, has_segments, False).items()
            if name not in _FLASH_ONLY}
    mask_batch, mask_heads, rows, max_visits = schedule[0].shape
    return dict(meta, MASK_BATCH=mask_batch, MASK_HEADS=mask_heads, ROWS=rows, MAX_VISITS=max_visits,
                Q_BLOCK_SIZE=q_block_size, KV_BLOCK_SIZE=kv_block_size)


def longest_first(counts, batch: int, heads: int, q_tiles: int, block_q: int, q_block_size: int):
    """int32 ``[batch * heads * q_tiles]``: the forward's (batch, head, query tile) items, encoded
    ``(b * heads + h) * q_tiles + t``, by decreasing schedule-row length (stable: ties keep launch order)."""
    mask_batch, mask_heads, _ = counts.shape
    rows = (np.arange(q_tiles) * block_q) // q_block_size
    per_item = counts[np.arange(batch)[:, None, None] % mask_batch, np.arange(heads)[None, :, None] % mask_heads,
                      rows[None, None, :]]
    return jnp.argsort(-per_item.reshape(-1), stable=True).astype(jnp.int32)


def run_forward(q, k, v, q_seg, kv_seg, aux, q_schedule, st: StaticParams, q_block_size: int, kv_block_size: int,
                tma: bool = False, persistent: int = 0):
    """(out [B, Sq, H, Dv], lse [B, H, Sq] float32, log2 units); `q_schedule`: `kernel_schedule(call, "q")`;
    `tma`: run `_fwd_tma_kernel` (a call `tma_forward_applies` admits); `persistent` > 0: the persistent form
    (`_fwd_tma_persistent_kernel`, else `_fwd_persistent_kernel`) with `persistent` programs per SM."""
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    config = st.config
    has_seg = q_seg is not None
    num_sinks = aux.shape[-1] if aux is not None else 0
    args = (q, k, v, q_seg if has_seg else placeholder(), kv_seg if has_seg else placeholder(),
            aux if aux is not None else jnp.zeros((1,), jnp.float32), *q_schedule,
            np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, k.shape[1])
    out_shapes = (jax.ShapeDtypeStruct((b, sq, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    q_tiles = triton.cdiv(sq, config.fwd_block_q)
    if tma and persistent:
        from ejkernel_triton.decode.config import sm_count

        mask_batch, mask_heads, rows, max_visits = q_schedule[0].shape
        items = b * h * q_tiles
        order = longest_first(q_schedule[2], b, h, q_tiles, config.fwd_block_q, q_block_size)
        return launch(
            _fwd_tma_persistent_kernel, (q, k, v, *args[5:9], order, *args[9:], items), out_shapes,
            (min(items, persistent * sm_count()), 1, 1), num_warps=config.fwd_num_warps,
            num_stages=config.fwd_num_stages, zeroed_outputs=(), interpret=st.interpret, tma=True, NUM_HEADS=h,
            GROUP=h // k.shape[2], D=q.shape[-1], BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv,
            USE_SOFTCAP=st.softcap > 0, NUM_SINKS=num_sinks, BLOCK_SINKS=sink_blocks(num_sinks),
            MASK_BATCH=mask_batch, MASK_HEADS=mask_heads, ROWS=rows, MAX_VISITS=max_visits,
            VISITS_P2=triton.next_power_of_2(max_visits), Q_BLOCK_SIZE=q_block_size, KV_BLOCK_SIZE=kv_block_size,
            Q_TILES=q_tiles, BATCH=b)
    if tma:
        mask_batch, mask_heads, rows, max_visits = q_schedule[0].shape
        return launch(
            _fwd_tma_kernel, (q, k, v, *args[5:]), out_shapes, (triton.cdiv(sq, config.fwd_block_q), b, h),
            num_warps=config.fwd_num_warps, num_stages=config.fwd_num_stages, zeroed_outputs=(),
            interpret=st.interpret, tma=True, NUM_HEADS=h, GROUP=h // k.shape[2], D=q.shape[-1],
            BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv, USE_SOFTCAP=st.softcap > 0,
            NUM_SINKS=num_sinks, BLOCK_SINKS=sink_blocks(num_sinks), MASK_BATCH=mask_batch, MASK_HEADS=mask_heads,
            ROWS=rows, MAX_VISITS=max_visits, VISITS_P2=triton.next_power_of_2(max_visits),
            Q_BLOCK_SIZE=q_block_size, KV_BLOCK_SIZE=kv_block_size)
    if persistent:
        from ejkernel_triton.decode.config import sm_count

        items = b * h * q_tiles
        order = longest_first(q_schedule[2], b, h, q_tiles, config.fwd_block_q, q_block_size)
        return launch(
            _fwd_persistent_kernel, (*args[:9], order, *args[9:], items), out_shapes,
            (min(items, persistent * sm_count()), 1, 1), num_warps=config.fwd_num_warps,
            num_stages=config.fwd_num_stages, zeroed_outputs=(), interpret=st.interpret,
            **_meta(q, k, v, st, has_seg, q_schedule, q_block_size, kv_block_size),
            BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv, NUM_SINKS=num_sinks,
            BLOCK_SINKS=sink_blocks(num_sinks), Q_TILES=q_tiles)
    return launch(
        _fwd_kernel, args, out_shapes, (q_tiles, b, h),
        num_warps=config.fwd_num_warps, num_stages=config.fwd_num_stages, zeroed_outputs=(), interpret=st.interpret,
        **_meta(q, k, v, st, has_seg, q_schedule, q_block_size, kv_block_size),
        BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv, NUM_SINKS=num_sinks,
        BLOCK_SINKS=sink_blocks(num_sinks))


def run_backward(q, k, v, do, lse, out, q_seg, kv_seg, q_schedule, kv_schedule, st: StaticParams,
                 q_block_size: int, kv_block_size: int):
    """(dq, dk, dv, delta): the gradients of q, k, v and delta_i = <dO_i, O_i> (the sinks' gradient needs it)."""
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    config = st.config
    has_seg = q_seg is not None
    delta = row_delta(out, do, None, st)
    inputs = (q, k, v, do, lse, delta, q_seg if has_seg else placeholder(), kv_seg if has_seg else placeholder())
    scalars = (np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, skv)
    dk, dv = launch(
        _dkv_kernel, (*inputs, *kv_schedule, *scalars),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        (triton.cdiv(skv, config.dkv_block_kv), b, hkv), num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages, zeroed_outputs=(), interpret=st.interpret,
        **_meta(q, k, v, st, has_seg, kv_schedule, q_block_size, kv_block_size),
        BLOCK_Q=config.dkv_block_q, BLOCK_KV=config.dkv_block_kv)
    (dq,) = launch(
        _dq_kernel, (*inputs, *q_schedule, *scalars), (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        (triton.cdiv(sq, config.dq_block_q), b, h), num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages, zeroed_outputs=(), interpret=st.interpret,
        **_meta(q, k, v, st, has_seg, q_schedule, q_block_size, kv_block_size),
        BLOCK_Q=config.dq_block_q, BLOCK_KV=config.dq_block_kv)
    return dq, dk, dv, delta
