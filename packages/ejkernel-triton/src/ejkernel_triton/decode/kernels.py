"""Split-K decode attention (flash-decoding) as Triton kernels, shared by ``page_attention`` and
``ragged_decode_attention``: the two differ only in where key ``j`` of sequence ``b`` lives (a page found
through the block table, or row ``j`` of the sequence's slice of a dense buffer) and in the visible range.

``_split_kernel``: one program per (split, sequence, kv head [, block of its query heads]). The query heads
of the kv group are the M rows of the tile (GQA/MQA packing), so each key and value is read once for the
whole group; the program walks its split's keys ``BLOCK_N`` at a time (mask-free steps, then one masked
tail step), with an online softmax in exp2 units and float32 accumulation. With one split it writes the
normalized output; with several, each split writes its unnormalized float32 accumulator, running max and
sum, and ``_combine_kernel`` (one program per sequence and block of heads) merges the valid splits and adds
the attention sinks. Splits past a sequence's end return at once and are never read.

Paged addressing works for any page size: with pages that hold whole steps (``page_size % BLOCK_N == 0``)
each step reads one block-table entry, otherwise each key row looks its page up. Page ids that are read are
clamped into ``[0, num_pages)``: a bad id (the caller's contract, checked by core when the tables are
concrete) reads some other page instead of faulting; entries past a sequence's last page are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel.errors import UnsupportedFeature
from ejkernel_triton.decode.config import TritonDecodeConfig, block_heads, split_plan
from ejkernel_triton.flash_attention.common import padded_dim, scores
from ejkernel_triton.flash_attention.tiles import load_tile, softmax_update
from ejkernel_triton.launch import launch

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """What is static about one call (hashable: it keys the custom-VJP and vmap closures)."""

    scale: float
    softcap: float  # 0.0: none
    page_size: int  # 0: dense ragged buffer
    max_len: int  # caps every length (page_attention's max_context_len); -1: the buffer's length
    window_left: int  # -1: none (the ragged op's sliding window; only its left side can hide keys)
    config: TritonDecodeConfig
    interpret: bool
    operation: str  # for the error of a gradient
    interleaved: bool = False  # paged K/V interleaved on the head axis: [num_pages, page_size, 2 * Hkv, D]


# ---- Triton helpers ----------------------------------------------------------------------------------


@triton.jit
def _sequence_range(Starts, Ends, b, HAS_START: tl.constexpr, WINDOW_LEFT: tl.constexpr, MAX_LEN: tl.constexpr):
    """Visible keys ``[lo, hi)`` of sequence ``b``, inside ``[0, MAX_LEN)`` (bounds that core could not check,
    traced ones, never send a read out of the buffer)."""
    hi = tl.minimum(tl.load(Ends + b), MAX_LEN)
    lo = hi * 0
    if HAS_START:
        lo = tl.maximum(tl.load(Starts + b), 0)
    if WINDOW_LEFT >= 0:  # the query sits at hi - 1
        lo = tl.maximum(lo, hi - 1 - WINDOW_LEFT)
    return lo, hi


@triton.jit
def _split_base(lo, ALIGN_LO: tl.constexpr, BLOCK_N: tl.constexpr):
    """First key of split 0: ``lo``, or ``lo`` rounded down to a step boundary (paged steps that must not
    straddle pages when a window starts the range mid-page)."""
    if ALIGN_LO:
        return lo // BLOCK_N * BLOCK_N
    return lo


@triton.jit
def _sink_state(Aux, heads, row_ok, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Initial running max and sum (log2 units) of rows ``heads``: sinks join the denominator only."""
    if NUM_SINKS > 0:
        offs_s = tl.arange(0, BLOCK_SINKS)
        aux = tl.load(Aux + heads[:, None] * NUM_SINKS + offs_s[None, :],
                      mask=row_ok[:, None] & (offs_s[None, :] < NUM_SINKS), other=float("-inf"))
        aux = aux.to(tl.float32) * 1.4426950408889634
        m_i = tl.max(aux, 1)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = tl.sum(tl.math.exp2(aux - m_safe[:, None]), 1)
    else:
        m_i = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _key_pages(Tables, b, n0, offs_n, stop, MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr,
               NUM_PAGES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids (int64, clamped into ``[0, NUM_PAGES)``) of keys ``n0 + offs_n`` of sequence ``b``: one id when
    the step lies in one page (``PAGE_SIZE % BLOCK_N == 0``), else one per key."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(Tables + b * MAX_PAGES + n0 // PAGE_SIZE)
    else:
        tokens = n0 + offs_n
        if MASKED:
            page = tl.load(Tables + b * MAX_PAGES + tokens // PAGE_SIZE, mask=tokens < stop, other=0)
        else:
            page = tl.load(Tables + b * MAX_PAGES + tokens // PAGE_SIZE)
    return tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)


@triton.jit
def _kv_offsets(Tables, b, kvh, n0, offs_n, offs_d, stop, MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr,
                HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr, SEQ_STRIDE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Element offsets ``[BLOCK_N, BLOCK_D]`` of keys ``n0 + offs_n`` of sequence ``b``, kv head ``kvh``."""
    if PAGE_SIZE > 0:
        page = _key_pages(Tables, b, n0, offs_n, stop, MASKED, PAGE_SIZE, MAX_PAGES, NUM_PAGES, BLOCK_N)
        if PAGE_SIZE % BLOCK_N == 0:  # the step lies in one page
            rows = page * PAGE_STRIDE + kvh * HEAD_STRIDE + ((n0 % PAGE_SIZE) + offs_n) * ROW_STRIDE
        else:
            rows = page * PAGE_STRIDE + kvh * HEAD_STRIDE + ((n0 + offs_n) % PAGE_SIZE) * ROW_STRIDE
    else:
        rows = b.to(tl.int64) * SEQ_STRIDE + kvh * HEAD_STRIDE + (n0 + offs_n).to(tl.int64) * ROW_STRIDE
    return rows[:, None] + offs_d[None, :]


@triton.jit
def _scale_rows(Tables, b, kvh, n0, offs_n, stop, MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Index ``[BLOCK_N]`` of keys ``n0 + offs_n`` (sequence ``b``, kv head ``kvh``) into a paged cache's
    ``[num_pages, KV_HEADS]`` dequantization scales: the row of each key's page."""
    page = _key_pages(Tables, b, n0, offs_n, stop, MASKED, PAGE_SIZE, MAX_PAGES, NUM_PAGES, BLOCK_N)
    return page * KV_HEADS + kvh + offs_n * 0


@triton.jit
def _compute_query(q, scale, Cache):
    """``(q, scale)`` for the products with a cache: as they are, except bfloat16 queries over a one-byte cache
    (float8 / int8), which multiply in float16. Every float8 and int8 value is exact in float16, and the cache
    converts to it with one packed instruction per two values (to bfloat16 it takes one more per value, which
    bound the compute-bound prefill tiles of ragged_page_attention); the query is converted once, scaled by a power of two that keeps its largest
    entry below 2**14 (float16 tops out at 65504), and the logit scale takes the power back."""
    if (Cache.dtype.element_ty.primitive_bitwidth == 8) and (q.dtype == tl.bfloat16):
        q32 = q.to(tl.float32)
        top = tl.max(tl.max(tl.abs(q32), 1), 0)
        shift = tl.maximum(tl.math.ceil(tl.math.log2(tl.maximum(top, 1.0) / 16384.0)), 0.0)
        q_out = (q32 * tl.math.exp2(-shift)).to(tl.float16)
        scale_out = scale * tl.math.exp2(shift)
    else:
        q_out = q
        scale_out = scale
    return q_out, scale_out


@triton.jit
def _step_scales(Tables, b, kvh, n0, offs_n, stop, scale, KScale, VScale, MASKED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, KV_HEADS: tl.constexpr,
                 BLOCK_N: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """``(qk_scale, v_scale)`` of one step over keys ``n0 + offs_n``: the logit scale times the keys'
    dequantization scale, and the values' (``K_SCALE`` / ``V_SCALE``, paged caches: 0 none, 1 ``KScale`` /
    ``VScale`` per kv head ``[KV_HEADS]``, 2 per page and kv head ``[num_pages, KV_HEADS]``: ``[1, BLOCK_N]`` per
    key; ``v_scale`` is unused without one)."""
    qk_scale = scale
    v_scale = scale
    if K_SCALE == 2 or V_SCALE == 2:
        rows = _scale_rows(Tables, b, kvh, n0, offs_n, stop, MASKED, PAGE_SIZE, MAX_PAGES, NUM_PAGES, KV_HEADS,
                           BLOCK_N)
        if K_SCALE == 2:
            qk_scale = scale * tl.load(KScale + rows)[None, :]
        if V_SCALE == 2:
            v_scale = tl.load(VScale + rows)[None, :]
    if K_SCALE == 1:
        qk_scale = scale * tl.load(KScale + kvh)
    if V_SCALE == 1:
        v_scale = tl.load(VScale + kvh)
    return qk_scale, v_scale


@triton.jit
def _fold_values(acc, m_i, l_i, s, v_ptrs, key_ok, offs_d, q, v_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, V_SCALED: tl.constexpr):
    """The online-softmax step over logits ``s`` (masked already) and its value tile (keys ``key_ok`` on a
    ``MASKED`` step): (acc, m_i, l_i). Values of another dtype than the query's (a quantized cache) multiply
    in the query's; ``V_SCALED``: the values are dequantized by ``v_scale`` (a scalar, or ``[1, BLOCK_N]``
    per key), folded into the probabilities, which the denominator does not see."""
    p, m_i, l_i, acc = softmax_update(s, m_i, l_i, acc)
    v = load_tile(v_ptrs, key_ok[:, None], offs_d, D, BLOCK_D, MASKED).to(q.dtype)
    if V_SCALED:
        p = p * v_scale
    return tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION), m_i, l_i


@triton.jit
def _fold_keys(acc, m_i, l_i, q, K, V, Tables, b, kvh, start, stop, offs_n, offs_d, scale, softcap, first,
               MASKED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr,
               PAGE_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr,
               SEQ_STRIDE: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
               V_SHIFT: tl.constexpr, LOWER: tl.constexpr, KScale, VScale, K_SCALE: tl.constexpr,
               V_SCALE: tl.constexpr, KV_HEADS: tl.constexpr):
    """Online softmax over keys ``[start, stop)`` (``MASKED``: the last, partial step; ``LOWER``: keys below
    ``first`` are masked too, for ranges that start inside a step). ``V_SHIFT``: elements from a key to its
    value when both live in one buffer. A quantized cache's keys multiply in ``q``'s dtype (``_compute_query``);
    ``K_SCALE`` / ``V_SCALE`` (paged caches; 0: none, 1: ``KScale``/``VScale`` per kv head ``[KV_HEADS]``, 2: per
    page and kv head ``[num_pages, KV_HEADS]``) dequantize keys/values (a key's scale multiplies its logit before
    the soft cap)."""
    for n0 in range(start, stop, BLOCK_N):
        offs = _kv_offsets(Tables, b, kvh, n0, offs_n, offs_d, stop, MASKED, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                           PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, BLOCK_N)
        key_ok = (n0 + offs_n) < stop  # (only masked steps use it)
        if LOWER:
            key_ok = key_ok & ((n0 + offs_n) >= first)
        k = load_tile(K + offs, key_ok[:, None], offs_d, D, BLOCK_D, MASKED).to(q.dtype)
        qk_scale, v_scale = _step_scales(Tables, b, kvh, n0, offs_n, stop, scale, KScale, VScale, MASKED, PAGE_SIZE,
                                         MAX_PAGES, NUM_PAGES, KV_HEADS, BLOCK_N, K_SCALE, V_SCALE)
        s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        if MASKED:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        acc, m_i, l_i = _fold_values(acc, m_i, l_i, s, V + V_SHIFT + offs, key_ok, offs_d, q, v_scale, D, BLOCK_D,
                                     MASKED, DOT_PRECISION, V_SCALE > 0)
    return acc, m_i, l_i


# ---- kernels -----------------------------------------------------------------------------------------


@triton.jit
def _merge_splits(Aux, PartAcc, PartM, PartL, b, heads, row_ok, valid, offs_d, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_SINKS: tl.constexpr,
                  BLOCK_SINKS: tl.constexpr):
    """The normalized output of rows ``heads`` of sequence ``b`` from its first ``valid`` splits' partials (and
    the sinks). Partials are read past L1 (``.cg``): other SMs wrote them during this launch."""
    m_i, l_i = _sink_state(Aux, heads, row_ok, NUM_SINKS, BLOCK_SINKS, BLOCK_ROWS)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    mask = row_ok[:, None] & (offs_d[None, :] < D)
    for split in range(0, valid):
        part = (b.to(tl.int64) * NUM_SPLITS + split) * H + heads
        m_s = tl.load(PartM + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PartL + part, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(PartAcc + part[:, None] * D + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _split_program(
    split, b, head_block,  # the program's place in the grid
    Q, K, V, Starts, Ends, Tables, Aux, QRows, KScale, VScale, scale, softcap,  # inputs
    Out, PartAcc, PartM, PartL, Counter,  # outputs (Out with one split, the partials with several)
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr,
    HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr, SEQ_STRIDE: tl.constexpr,
    HAS_START: tl.constexpr, WINDOW_LEFT: tl.constexpr, MAX_LEN: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, V_SHIFT: tl.constexpr,
    HAS_QROWS: tl.constexpr, ALIGN_LO: tl.constexpr, INLINE_COMBINE: tl.constexpr, K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr,
):
    """One split program: keys ``[lo + split * CHUNK, ...)`` of sequence ``b`` for the query heads of head block
    ``head_block`` (kv head ``head_block // HEAD_BLOCKS``). A function so that other kernels (the mixed
    prefill + decode launch of ``ragged_page_attention``) run the same program."""
    kvh = head_block // HEAD_BLOCKS
    g0 = (head_block % HEAD_BLOCKS) * BLOCK_H
    lo, hi = _sequence_range(Starts, Ends, b, HAS_START, WINDOW_LEFT, MAX_LEN)
    s_lo = _split_base(lo, ALIGN_LO, BLOCK_N) + split * CHUNK
    s_hi = tl.minimum(hi, s_lo + CHUNK)
    # splits past the sequence's end write nothing: the combine pass never reads them
    if (s_lo < s_hi) | (NUM_SPLITS == 1):
        offs_h = tl.arange(0, BLOCK_H)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = g0 + offs_h < GROUP
        heads = kvh * GROUP + g0 + offs_h
        rows = b.to(tl.int64) * H + heads
        q_rows = rows
        if HAS_QROWS:  # the query of sequence b is row QRows[b] of a packed [tokens, H, D] array
            q_rows = tl.load(QRows + b).to(tl.int64) * H + heads
        q = tl.load(Q + q_rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        q, scale = _compute_query(q, scale, K)
        if NUM_SPLITS == 1:
            m_i, l_i = _sink_state(Aux, heads, row_ok, NUM_SINKS, BLOCK_SINKS, BLOCK_H)
        else:  # sinks join once, in the combine pass
            m_i, l_i = _sink_state(Aux, heads, row_ok, 0, BLOCK_SINKS, BLOCK_H)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if ALIGN_LO:  # steps start on BLOCK_N boundaries (one page per step); keys below lo are masked
            acc, m_i, l_i = _fold_keys(acc, m_i, l_i, q, K, V, Tables, b, kvh, s_lo, s_hi, offs_n, offs_d, scale,
                                       softcap, lo, True, D, BLOCK_D, BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                                       PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, USE_SOFTCAP, DOT_PRECISION,
                                       V_SHIFT, True, KScale, VScale, K_SCALE, V_SCALE, H // GROUP)
        else:
            full_hi = s_lo + tl.maximum(s_hi - s_lo, 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _fold_keys(acc, m_i, l_i, q, K, V, Tables, b, kvh, s_lo, full_hi, offs_n, offs_d, scale,
                                       softcap, lo, False, D, BLOCK_D, BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                                       PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, USE_SOFTCAP, DOT_PRECISION,
                                       V_SHIFT, False, KScale, VScale, K_SCALE, V_SCALE, H // GROUP)
            acc, m_i, l_i = _fold_keys(acc, m_i, l_i, q, K, V, Tables, b, kvh, full_hi, s_hi, offs_n, offs_d, scale,
                                       softcap, lo, True, D, BLOCK_D, BLOCK_N, PAGE_SIZE, MAX_PAGES, NUM_PAGES,
                                       PAGE_STRIDE, HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, USE_SOFTCAP, DOT_PRECISION,
                                       V_SHIFT, False, KScale, VScale, K_SCALE, V_SCALE, H // GROUP)
        out_mask = row_ok[:, None] & (offs_d[None, :] < D)
        if NUM_SPLITS == 1:
            # no visible key: the value sum is 0 and so is the output (sinks or not)
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(Out + rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=out_mask)
        else:
            part = (b.to(tl.int64) * NUM_SPLITS + split) * H + heads
            tl.store(PartAcc + part[:, None] * D + offs_d[None, :], acc, mask=out_mask)
            tl.store(PartM + part, m_i, mask=row_ok)
            tl.store(PartL + part, l_i, mask=row_ok)
            if INLINE_COMBINE:
                # the last split of (b, head block) to finish merges: every thread's stores are done
                # (barrier) before the counter's release; the merge reads after its acquire
                tl.debug_barrier()
                done = tl.atomic_add(Counter + b * (HEAD_BLOCKS * (H // GROUP)) + head_block, 1, sem="acq_rel")
                valid = (hi - _split_base(lo, ALIGN_LO, BLOCK_N) + CHUNK - 1) // CHUNK
                if done == valid - 1:
                    out = _merge_splits(Aux, PartAcc, PartM, PartL, b, heads, row_ok, valid, offs_d, H, D, BLOCK_H,
                                        BLOCK_D, NUM_SPLITS, NUM_SINKS, BLOCK_SINKS)
                    tl.store(Out + rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=out_mask)
    elif INLINE_COMBINE:
        if split == 0:
            if hi <= lo:  # no split saw a key: zeros (sinks or not)
                offs_h = tl.arange(0, BLOCK_H)
                offs_d = tl.arange(0, BLOCK_D)
                row_ok = g0 + offs_h < GROUP
                rows = b.to(tl.int64) * H + kvh * GROUP + g0 + offs_h
                tl.store(Out + rows[:, None] * D + offs_d[None, :], tl.zeros([BLOCK_H, BLOCK_D], Out.dtype.element_ty),
                         mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _split_kernel(
    Q, K, V, Starts, Ends, Tables, Aux, QRows, KScale, VScale, scale, softcap,  # inputs
    Out, PartAcc, PartM, PartL, Counter,  # outputs (Out with one split, the partials with several)
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, PAGE_STRIDE: tl.constexpr,
    HEAD_STRIDE: tl.constexpr, ROW_STRIDE: tl.constexpr, SEQ_STRIDE: tl.constexpr,
    HAS_START: tl.constexpr, WINDOW_LEFT: tl.constexpr, MAX_LEN: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, V_SHIFT: tl.constexpr,
    HAS_QROWS: tl.constexpr, ALIGN_LO: tl.constexpr, INLINE_COMBINE: tl.constexpr, K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr,
):
    _split_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), Q, K, V, Starts, Ends, Tables, Aux, QRows,
                   KScale, VScale, scale, softcap, Out, PartAcc, PartM, PartL, Counter, H, GROUP, HEAD_BLOCKS, D,
                   BLOCK_D, BLOCK_H, BLOCK_N, CHUNK, NUM_SPLITS, PAGE_SIZE, MAX_PAGES, NUM_PAGES, PAGE_STRIDE,
                   HEAD_STRIDE, ROW_STRIDE, SEQ_STRIDE, HAS_START, WINDOW_LEFT, MAX_LEN, USE_SOFTCAP, NUM_SINKS,
                   BLOCK_SINKS, DOT_PRECISION, V_SHIFT, HAS_QROWS, ALIGN_LO, INLINE_COMBINE, K_SCALE, V_SCALE)


@triton.jit
def _combine_kernel(
    Starts, Ends, Aux, PartAcc, PartM, PartL,  # inputs
    Out,  # output
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_START: tl.constexpr, WINDOW_LEFT: tl.constexpr, MAX_LEN: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, ALIGN_LO: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.program_id(1) * BLOCK_H + offs_h
    row_ok = heads < H
    lo, hi = _sequence_range(Starts, Ends, b, HAS_START, WINDOW_LEFT, MAX_LEN)
    valid = (tl.maximum(hi - _split_base(lo, ALIGN_LO, BLOCK_N), 0) + CHUNK - 1) // CHUNK  # splits that saw keys
    out = _merge_splits(Aux, PartAcc, PartM, PartL, b, heads, row_ok, valid, offs_d, H, D, BLOCK_H, BLOCK_D,
                        NUM_SPLITS, NUM_SINKS, BLOCK_SINKS)
    rows = b.to(tl.int64) * H + heads
    tl.store(Out + rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


# ---- host side ---------------------------------------------------------------------------------------

_COMBINE_HEADS = 16


def _placeholder(dtype):
    """The argument passed for an absent input (block table, starts, sinks): never read."""
    return jnp.zeros((1,), dtype)


def _scale_kind(scale) -> int:
    """The kernels' ``K_SCALE``/``V_SCALE``: 0 without a scale, 1 per kv head ``[Hkv]``, 2 per page ``[pages, Hkv]``."""
    return 0 if scale is None else scale.ndim


def split_decode(q, k, v, starts, ends, tables, aux, st: DecodeStatic, q_rows=None, run_split=None, key_scale=None,
                 value_scale=None):
    """``q`` [B, H, D]; ``k``/``v`` paged ``[num_pages, Hkv, page_size, D]`` (``st.page_size > 0``) or dense
    ``[B, S, Hkv, D]``; ``starts`` (dense only) and ``ends`` int32 [B]; ``tables`` int32 [B, max_pages] (paged
    only); ``aux`` float32 [H, num_sinks] or None. Returns [B, H, D] in q's dtype.

    ``st.interleaved``: ``k`` is ``[num_pages, page_size, 2 * Hkv, D]`` with the value of kv head ``h`` at
    ``2h + 1`` (``v`` is ignored). ``q_rows`` int32 [B]: ``q`` is a packed ``[tokens, H, D]`` array and sequence
    ``b``'s query is its row ``q_rows[b]`` (the batch is then ``len(ends)``). ``run_split(args, out_shapes,
    grid, num_warps, num_stages, zeroed_outputs, constexprs)``: runs the split programs instead of a launch of
    ``_split_kernel`` and returns their outputs (the mixed launch of ``ragged_page_attention`` adds its prefill programs).
    ``key_scale``/``value_scale`` (paged caches): float32 dequantization scales ``[Hkv]`` or ``[num_pages, Hkv]``,
    or None."""
    batch = ends.shape[0]
    num_heads, head_dim = q.shape[1:]
    paged = st.page_size > 0
    v_shift = 0
    if st.interleaved:
        num_pages, page_size, combined, _ = k.shape
        kv_heads = combined // 2
        v, v_shift = k, head_dim
        max_pages = tables.shape[1]
        max_len = max_tokens = max_pages * page_size if st.max_len < 0 else min(st.max_len, max_pages * page_size)
        strides = dict(PAGE_SIZE=page_size, MAX_PAGES=max_pages, NUM_PAGES=num_pages,
                       PAGE_STRIDE=page_size * combined * head_dim, HEAD_STRIDE=2 * head_dim,
                       ROW_STRIDE=combined * head_dim, SEQ_STRIDE=0)
    elif paged:
        num_pages, kv_heads, page_size, _ = k.shape
        max_pages = tables.shape[1]
        max_len = max_tokens = max_pages * page_size if st.max_len < 0 else min(st.max_len, max_pages * page_size)
        strides = dict(PAGE_SIZE=page_size, MAX_PAGES=max_pages, NUM_PAGES=num_pages,
                       PAGE_STRIDE=kv_heads * page_size * head_dim, HEAD_STRIDE=page_size * head_dim,
                       ROW_STRIDE=head_dim, SEQ_STRIDE=0)
    else:
        seq_len, kv_heads = k.shape[1], k.shape[2]
        max_len = seq_len
        max_tokens = seq_len if st.window_left < 0 else min(seq_len, st.window_left + 1)
        strides = dict(PAGE_SIZE=0, MAX_PAGES=1, NUM_PAGES=1, PAGE_STRIDE=0, HEAD_STRIDE=head_dim,
                       ROW_STRIDE=kv_heads * head_dim, SEQ_STRIDE=seq_len * kv_heads * head_dim)
    group = num_heads // kv_heads
    cfg = st.config
    # a window starts the range mid-page: paged steps then start on step boundaries (one more step of keys)
    align_lo = paged and st.window_left >= 0
    if paged and st.window_left >= 0:
        max_tokens = min(max_tokens, st.window_left + cfg.block_n)
    chunk, splits = split_plan(max_tokens, cfg.block_n, cfg.num_splits)
    block_h = block_heads(group)
    head_blocks = -(-group // block_h)
    num_sinks = 0 if aux is None else aux.shape[1]
    bounds = dict(HAS_START=not paged, WINDOW_LEFT=st.window_left, MAX_LEN=max_len, NUM_SINKS=num_sinks,
                  BLOCK_SINKS=max(2, 1 << max(num_sinks - 1, 0).bit_length()), ALIGN_LO=align_lo,
                  BLOCK_N=cfg.block_n)
    block_d = padded_dim(head_dim)
    starts = starts if starts is not None else _placeholder(jnp.int32)
    tables = tables if tables is not None else _placeholder(jnp.int32)
    aux = aux if aux is not None else _placeholder(jnp.float32)
    has_q_rows = q_rows is not None
    q_rows = q_rows if has_q_rows else _placeholder(jnp.int32)
    f32 = jax.ShapeDtypeStruct
    out_shape = f32((batch, num_heads, head_dim), q.dtype)
    inline = cfg.inline_combine and splits > 1
    if splits == 1:
        partials = [f32((1,), jnp.float32)] * 3
    else:
        partials = [f32((batch, splits, num_heads, head_dim), jnp.float32),
                    f32((batch, splits, num_heads), jnp.float32), f32((batch, splits, num_heads), jnp.float32)]
    # the inline combine's arrival counters, one per (sequence, head block), zeroed before the launch
    counter = f32((batch * kv_heads * head_blocks,) if inline else (1,), jnp.int32)
    constexprs = dict(H=num_heads, GROUP=group, HEAD_BLOCKS=head_blocks, D=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
                      CHUNK=chunk, NUM_SPLITS=splits, USE_SOFTCAP=st.softcap > 0, V_SHIFT=v_shift,
                      HAS_QROWS=has_q_rows, DOT_PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
                      INLINE_COMBINE=inline, K_SCALE=_scale_kind(key_scale), V_SCALE=_scale_kind(value_scale),
                      **strides, **bounds)
    if _scale_kind(key_scale) == 2 or _scale_kind(value_scale) == 2:
        if not paged:
            raise UnsupportedFeature(f"triton {st.operation}: per-page dequantization scales need a paged cache")
    args = [q, k, v, starts, ends, tables, aux, q_rows,
            key_scale if key_scale is not None else _placeholder(jnp.float32),
            value_scale if value_scale is not None else _placeholder(jnp.float32),
            np.float32(st.scale), np.float32(st.softcap)]
    out_shapes = [out_shape if splits == 1 or inline else f32((1,), q.dtype), *partials, counter]
    zeroed = (4,) if inline else ()
    grid = (splits, batch, kv_heads * head_blocks)
    if run_split is None:
        outs = launch(_split_kernel, args, out_shapes, grid, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages(paged), zeroed_outputs=zeroed, interpret=st.interpret, **constexprs)
    else:
        outs = run_split(args, out_shapes, grid, cfg.num_warps, cfg.num_stages(paged), zeroed, constexprs)
    if splits == 1 or inline:
        return outs[0]
    (out,) = launch(
        _combine_kernel, [starts, ends, aux, *outs[1:4]], [out_shape], (batch, -(-num_heads // _COMBINE_HEADS)),
        num_warps=4, num_stages=2, interpret=st.interpret, H=num_heads, D=head_dim, BLOCK_D=block_d,
        BLOCK_H=_COMBINE_HEADS, CHUNK=chunk, NUM_SPLITS=splits, **bounds)
    return out


def _map_rule(call):
    """vmap rule (jax-triton's primitive has none): one call per element of the vmapped axis."""

    def rule(axis_size, in_batched, *args):
        full = [a if a is None or batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, batched in zip(args, in_batched)]
        return jax.lax.map(lambda xs: call(*xs), full), True

    return rule


def forward_only(forward, operation: str):
    """``forward`` (positional array arguments, None for absent ones) made vmappable, with a gradient that
    raises :class:`UnsupportedFeature` (these are inference kernels). Callers cache the result per static."""

    @jax.custom_batching.custom_vmap
    def batched(*args):
        return forward(*args)

    batched.def_vmap(_map_rule(batched))

    @jax.custom_vjp
    def attend(*args):
        return batched(*args)

    def attend_fwd(*args):
        return batched(*args), None

    def attend_bwd(_, d_out):
        raise UnsupportedFeature(f"triton {operation} is forward-only (an inference kernel); for gradients "
                                 "use platform='xla'")

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


@functools.lru_cache(maxsize=None)
def _attend_fn(st: DecodeStatic):
    def attend(q, k, v, starts, ends, tables, aux, key_scale, value_scale):
        return split_decode(q, k, v, starts, ends, tables, aux, st, key_scale=key_scale, value_scale=value_scale)

    return forward_only(attend, st.operation)


def decode_attention(q, k, v, starts, ends, tables, aux, st: DecodeStatic, key_scale=None,
                     value_scale=None) -> jax.Array:
    """See :func:`split_decode` for the arguments (None for absent ones)."""
    return _attend_fn(st)(q, k, v, starts, ends, tables, aux, key_scale, value_scale)
