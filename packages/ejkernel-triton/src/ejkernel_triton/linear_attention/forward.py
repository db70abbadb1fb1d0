"""Forward kernels of chunked gated linear attention: the chunk states and the outputs.

Arrays (after `vjp.prepare`): q, k [B, T, H, K]; v [B, T, H, V] with T a multiple of the chunk (64);
``gc`` float32 [B, T, H, K], the log gates cumulated inside each chunk (row r of a chunk holds the sum of
the chunk's gates up to and including r). Per chunk ``n`` with entering state ``h_n`` [K, V]::

    h_{n+1} = exp(gc_last) * h_n + sum_s (k_s * exp(gc_last - gc_s)) v_s^T
    o_t     = (scale q_t * exp(gc_t)) h_n + sum_{s <= t in the chunk} A[t, s] v_s
    A[t, s] = sum_k scale q_t[k] k_s[k] exp(gc_t[k] - gc_s[k])

Scalar gates (``SCALAR_GATE``: one log gate per token and head, ``gc`` [B, T, H, 1]: ``recurrent``'s scalar
``g``, ``g_gamma``, ``lightning_attention``) make A a plain matmul, ``scale (q k^T)[t, s] exp(gc_t - gc_s)``,
formed by the output kernel with one dot per key tile (no sub-chunk splitting, no pair loop) and stored for the
backward (forming it again in the dv kernel by a dot gave wrong dv on an H100 with Triton 3.6 at K=V=128,
right in the interpreter); the other kernels read one gate per row (:func:`load_gates`).

No exponent the kernels form overflows, however strong the decay: across sub-chunks of 16 the pair factor
splits at a reference row between the two tokens (both exponents <= 0 for log gates <= 0); inside a sub-chunk
it splits at the sub-chunk's first row too where the sub-chunk's gates span at most ``SPAN_LIMIT`` (every
factor within ``e^SPAN_LIMIT``: matmuls instead of pair loops), and is formed pair by pair otherwise
(``_diag_pairs``, ``_intra_inside``; the output kernel's own A always pairs). ``_state_kernel`` runs the
recurrence over chunks (one program per K x V tile and head) and writes every ``h_n``; ``_output_kernel`` is
parallel over chunks. Fixed-length calls with K <= 128 instead cut each sequence into segments of chunks:
``_state_kernel`` sums each segment from a zero state, and ``_carried_output_kernel`` runs every segment at
once, its entering state carried through the earlier segments' sums, then the state carried in registers
through its chunks (nothing stored).
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64
"""Tokens per chunk."""
SUB_CHUNK = 16
"""Tokens per sub-chunk: pairs inside one are formed by a matmul split at its first row while its gates span at
most ``SPAN_LIMIT``, exactly pair by pair otherwise."""
SPAN_LIMIT = tl.constexpr(40.0)
"""Largest |gc_t - gc_r| (r: the sub-chunk's first row, any t and key column of it) for which the pairs inside
a sub-chunk go through the split factors ``exp(gc_t - gc_r) exp(gc_r - gc_s)``: each within [e^-40, e^40], far
from float32's limits (e^88) for any q, k, dA of a sane model, and log-sigmoid gates of real models span a
few units over 16 tokens."""


@triton.jit
def wide(x):
    """``x`` as int64 (element offsets of large inputs overflow int32); works on loop counters too."""
    return x + tl.full([], 0, tl.int64)


@triton.jit
def load_gates(G, rows, head, offs_k, row_mask, H: tl.constexpr, K: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """The log gates of ``rows`` [R] at key columns ``offs_k`` [BK]: per-dimension gates ([B, T, H, K]) as
    [R, BK], scalar ones ([B, T, H, 1]) as [R, 1], broadcast by the arithmetic that uses them (one load per
    row, not one per column)."""
    if SCALAR_GATE:
        return tl.load(G + rows[:, None] * H + head, mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(G + rows[:, None] * (H * K) + head * K + offs_k[None, :],
                       mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def load_row_gate(G, row, head, offs_k, H: tl.constexpr, K: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """The log gate of one row at key columns ``offs_k`` as [BK] (scalar gates: the row's gate in each)."""
    if SCALAR_GATE:
        return tl.zeros_like(offs_k).to(tl.float32) + tl.load(G + row * H + head)
    else:
        return tl.load(G + row * (H * K) + head * K + offs_k, mask=offs_k < K, other=0.0)


@triton.jit
def chunk_span(c, CH_START, CH_LEN, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row, number of tokens) of chunk ``c``, rows counted over the flattened [B * T] tokens.

    Fixed length: chunk c covers rows c * BT ... (T is a multiple of BT). Varlen: the chunk table built by
    ``vjp.chunk_table`` (chunks never straddle two sequences; a sequence's last chunk may be short)."""
    if IS_VARLEN:
        row0 = tl.load(CH_START + c).to(tl.int64)
        length = tl.load(CH_LEN + c)
    else:
        row0 = wide(c) * BT
        length = BT
    return row0, length


@triton.jit
def sequence_chunks(s, SEQ_FIRST, NUM_CHUNKS, SEGMENTS, IS_VARLEN: tl.constexpr):
    """[first, last) chunk ids of sequence ``s``. Fixed lengths with ``SEGMENTS`` > 1: ``s`` counts (sequence,
    segment) pairs, each sequence's chunks cut into SEGMENTS runs of cdiv(NUM_CHUNKS, SEGMENTS) (the last runs
    shorter, or empty)."""
    if IS_VARLEN:
        lo = tl.load(SEQ_FIRST + s)
        hi = tl.load(SEQ_FIRST + s + 1)
    else:
        per_segment = tl.cdiv(NUM_CHUNKS, SEGMENTS)
        first = (s // SEGMENTS) * NUM_CHUNKS
        lo = first + (s % SEGMENTS) * per_segment
        hi = tl.minimum(lo + per_segment, first + NUM_CHUNKS)
    return lo, hi


@triton.jit
def carry_through_segment(state, SUMS, TOTALS, j, head, offs_k, mk, tile_offs, mkv, H: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """A state (or a state gradient) carried across segment ``j`` (an index into [sequences * segments]):
    decayed by the segment's summed log gates TOTALS ([.., H, K or 1]) and added to its own sum from zero SUMS
    ([.., H, K, V] float32). The forward carries forward, the state gradients backward, by the same rule."""
    if SCALAR_GATE:
        decay = tl.exp(tl.load(TOTALS + wide(j) * H + head))
    else:
        decay = tl.exp(tl.load(TOTALS + (wide(j) * H + head) * K + offs_k, mask=mk, other=0.0))[:, None]
    return state * decay + tl.load(SUMS + (wide(j) * H + head) * K * V + tile_offs, mask=mkv, other=0.0)


@triton.jit
def scalar_pair_decay(b, causal):
    """``exp(b_t - b_s)`` where ``causal`` [BT, BT] (t >= s), zero elsewhere: scalar gates' pair factor (``b``
    the rows' cumulative gates, [BT])."""
    return tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))


@triton.jit
def state_tile(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The K x V state tile of a recurrence program (grid: K tiles, V tiles, sequence x head): (sequence x head,
    sequence, head, key and value offsets, their masks, the tile's mask and its element offsets)."""
    sh = tl.program_id(2)
    offs_k = tl.program_id(0) * BK + tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    return sh, sh // H, sh % H, offs_k, offs_v, mk, mv, mk[:, None] & mv[None, :], offs_k[:, None] * V + offs_v[None, :]


@triton.jit
def chunk_rows(c, CH_START, CH_LEN, offs_t, offs_k, head, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """Chunk ``c`` as a recurrence step reads it: (first row, number of tokens, its rows, their mask [BT, 1],
    the element offsets of its [BT, BK] key-width tile)."""
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    rows = row0 + offs_t
    k_offs = rows[:, None] * (H * K) + head * K + offs_k[None, :]
    return row0, length, rows, (offs_t < length)[:, None], k_offs


@triton.jit
def _cumsum_kernel(G, K_, CH_START, CH_LEN, GC, KD, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, IS_VARLEN: tl.constexpr, WRITE_DECAYED: tl.constexpr):
    """GC = the log gates G ([B, T, H, K]) cumulated inside each chunk; one program per (chunk, head).

    WRITE_DECAYED: also KD = k * exp(gc_last - gc) in k's dtype (the state kernel's decayed keys, so that its
    sequential loop only loads and multiplies); the exponent is the suffix sum of the raw gates after each row
    (exact near the chunk's end, as in ``_state_kernel``)."""
    c = tl.program_id(0)
    head = tl.program_id(1)
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    offs_t = tl.arange(0, BT)
    rows = row0 + offs_t
    rmask = offs_t < length
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        offs = rows[:, None] * (H * K) + head * K + offs_k[None, :]
        m = rmask[:, None] & (offs_k[None, :] < K)
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        if WRITE_DECAYED:  # both loads in flight before the first store (no aliasing is known across it)
            k = tl.load(K_ + offs, mask=m, other=0.0)
        tl.store(GC + offs, tl.cumsum(g, axis=0), mask=m)
        if WRITE_DECAYED:
            g_after = tl.cumsum(g, axis=0, reverse=True) - g
            tl.store(KD + offs, (k.to(tl.float32) * tl.exp(g_after)).to(KD.dtype.element_ty), mask=m)


@triton.jit
def decay_to_chunk_end(k, G, rows, offs_t, length, offs_k, head, H: tl.constexpr, K: tl.constexpr,
                       SCALAR_GATE: tl.constexpr):
    """The keys [BT, BK] of one chunk decayed to its end, ``k_s exp(gc_last - gc_s)`` (float32), the exponent
    summed from the raw log gates ``G`` after s: exact for the keys near the chunk's end, which dominate the
    state (a difference of two long cumulative sums would lose float32 digits to strong gates)."""
    if SCALAR_GATE:  # one gate per row: the scan over [BT] (Triton's scan of a [BT, 1] column fails on sm_90)
        raw = tl.load(G + rows * H + head, mask=offs_t < length, other=0.0)
        g_after = (tl.cumsum(raw, axis=0, reverse=True) - raw)[:, None]
    else:
        raw = load_gates(G, rows, head, offs_k, offs_t < length, H, K, SCALAR_GATE)
        g_after = tl.cumsum(raw, axis=0, reverse=True) - raw
    return k.to(tl.float32) * tl.exp(g_after)


@triton.jit
def _state_kernel(
    K_, V_, GC, G, H0, CH_START, CH_LEN, SEQ_FIRST, NUM_CHUNKS, SEGMENTS,  # inputs (G: the raw log gates)
    HS, HT,  # outputs: h_c entering every chunk c [chunks, H, K, V], final state per sequence (float32)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, DECAYED_KEYS: tl.constexpr,
    SCALAR_GATE: tl.constexpr, STORE_STATES: tl.constexpr,
):
    """The chunk recurrence for one K x V tile of one (sequence, head), or of one segment of a sequence's
    chunks (``SEGMENTS`` > 1: H0 and HT then hold the states entering and leaving each segment). DECAYED_KEYS:
    K_ holds the decayed keys of ``_cumsum_kernel`` (G unused): the loop is loads, one scaling and one dot.
    Without STORE_STATES only HT is written (each segment's own sum, carried across the segments by
    ``_carried_output_kernel``)."""
    sh, s, head, offs_k, offs_v, mk, mv, mkv, state_offs = state_tile(H, K, V, BK, BV)
    offs_t = tl.arange(0, BT)
    if HAS_H0:
        state = tl.load(H0 + sh.to(tl.int64) * K * V + state_offs, mask=mkv, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    lo, hi = sequence_chunks(s, SEQ_FIRST, NUM_CHUNKS, SEGMENTS, IS_VARLEN)
    for c in range(lo, hi):
        if STORE_STATES:
            tl.store(HS + (wide(c) * H + head) * K * V + state_offs, state.to(HS.dtype.element_ty), mask=mkv)
        row0, length, rows, rmask, k_offs = chunk_rows(c, CH_START, CH_LEN, offs_t, offs_k, head, H, K, BT,
                                                       IS_VARLEN)
        k = tl.load(K_ + k_offs, mask=rmask & mk[None, :], other=0.0)
        g_last = load_row_gate(GC, row0 + length - 1, head, offs_k, H, K, SCALAR_GATE)
        v = tl.load(V_ + rows[:, None] * (H * V) + head * V + offs_v[None, :], mask=rmask & mv[None, :], other=0.0)
        if DECAYED_KEYS:
            k_decayed = k.to(v.dtype)
        else:
            k_decayed = decay_to_chunk_end(k, G, rows, offs_t, length, offs_k, head, H, K, SCALAR_GATE).to(v.dtype)
        state = state * tl.exp(g_last)[:, None]
        state = tl.dot(tl.trans(k_decayed), v, state, input_precision=DOT_PRECISION)
    tl.store(HT + sh.to(tl.int64) * K * V + state_offs, state, mask=mkv)


@triton.jit
def across_sub_chunks(x, x_gates, y, y_gates, offs_t, length, BC: tl.constexpr, NC: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """``sum_k x_t[k] y_s[k] exp(gx_t[k] - gy_s[k])`` [BT, BT] for pairs in different sub-chunks, s before t.

    The factor splits at the first row of t's sub-chunk, ``r``: ``exp(gx_t - g_r) * exp(g_r - gy_s)``,
    both <= 0 for decays. ``x_gates``/``y_gates`` are gc [BT, BK]; rows of x outside sub-chunk i and
    columns of y not before it are zeroed for sub-chunk i's matmul."""
    acc = tl.zeros([x.shape[0], x.shape[0]], dtype=tl.float32)
    sub = offs_t // BC
    for i in range(1, NC):
        if i * BC < length:  # a sub-chunk past a short (varlen) chunk's end has no reference row
            ref = tl.sum(tl.where((offs_t == i * BC)[:, None], x_gates, 0.0), 0)  # gc of row i * BC
            rows = (sub == i)[:, None]
            cols = (sub < i)[:, None]
            xi = tl.where(rows, x * tl.exp(tl.where(rows, x_gates - ref[None, :], 0.0)), 0.0)
            yi = tl.where(cols, y * tl.exp(tl.where(cols, ref[None, :] - y_gates, 0.0)), 0.0)
            # float32 operands (TF32 for 16-bit inputs, IEEE for float32), as fla keeps its intra-chunk A
            acc = tl.dot(xi, tl.trans(yi), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _intra_kernel(
    Q, K_, GC, CH_START, CH_LEN, scale,  # inputs
    A_PREV, EXACT_PREV,  # the second launch of a split: the first's A and flags, aliased to A / EXACT
    A,  # output: A [B, T, H, BT] float32 (scale included; zero above the diagonal)
    EXACT,  # output of a split's first launch: [chunks * BT / BC, H] int32, 1 where the own block is left
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, ACROSS: tl.constexpr, INSIDE: tl.constexpr,
):
    """The rows of one sub-chunk of A (``BC`` x ``BT``): small programs (grid: sub-chunks x chunks x heads), so
    many share an SM and hide each other's load latency (the output kernel then only reads A). Same numerics as
    the output kernel's own A: split at the sub-chunk's first row, and the pairs inside the sub-chunk exactly
    where its gates span more than ``SPAN_LIMIT``.

    ``_intra_across`` forms every column by dots (its own block's lower triangle only while the span allows);
    `_intra_inside` forms the own block's lower triangle exactly, pair by pair (H100, 2026-11-24: the former
    scatter loop at 4 warps took 350 us at B=4 T=4k H=8 K=V=128, 54 % of the forward; a [16, 16, 16]
    broadcast per key slice, tried instead, 412 us). ``ACROSS`` / ``INSIDE``: which of the two parts this
    launch runs; as two launches (``EXACT`` tells the second which sub-chunks need it) each part keeps its own
    registers and shared memory (one launch: 112 registers and 51 KB per program, 4 programs per SM, half the
    cycles waiting on loads: ncu, H100, T=16k)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    head = tl.program_id(2)
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    if i * BC >= length:  # a sub-chunk past a short (varlen) chunk's end, or an unused table entry
        return
    offs_r = tl.arange(0, BC)
    local = i * BC + offs_r  # this sub-chunk's rows in the chunk
    rmask = local < length
    row_base = (row0 + local)[:, None] * (H * K) + head * K
    a_rows = A + (row0 + local) * (H * BT) + head * BT  # [BC] pointers to column 0 of each row
    flag = EXACT + (wide(c) * (BT // BC) + i) * H + head
    if ACROSS:
        exact = _intra_across(Q, K_, GC, scale, a_rows, row0, i, head, rmask, row_base, H, K, BT, BC, BK,
                              DOT_PRECISION)
        if INSIDE:
            if exact:
                _intra_inside(Q, K_, GC, scale, a_rows, row0, length, i, head, offs_r, rmask, row_base, H, K, BT,
                              BC, KP)
        else:
            tl.store(flag, exact.to(tl.int32))
    elif tl.load(flag) != 0:
        _intra_inside(Q, K_, GC, scale, a_rows, row0, length, i, head, offs_r, rmask, row_base, H, K, BT, BC, KP)


@triton.jit
def _intra_across(Q, K_, GC, scale, a_rows, row0, i, head, rmask, row_base, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A sub-chunk's rows of A by dots per key tile, every factor split at its first row r: the earlier
    sub-chunks' columns (both exponents <= 0 for decays) and the own block (``exp(gc_r - gc_s)`` up to
    ``e^SPAN_LIMIT``), whose lower triangle is stored only if the sub-chunk's gates span at most
    ``SPAN_LIMIT``; zeros above the diagonal. Returns whether the own block's lower triangle is left to
    `_intra_inside`."""
    offs_c = tl.arange(0, BT)
    offs_r = tl.arange(0, BC)
    acc = tl.zeros([BC, BT], dtype=tl.float32)
    own = tl.zeros([BC, BC], dtype=tl.float32)
    span = tl.zeros([BC], dtype=tl.float32)
    before = offs_c < i * BC
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        m = rmask[:, None] & mk[None, :]
        q = tl.load(Q + row_base + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * scale
        gq = tl.load(GC + row_base + offs_k[None, :], mask=m, other=0.0)
        ref = tl.load(GC + (row0 + i * BC) * (H * K) + head * K + offs_k, mask=mk, other=0.0)
        ko = tl.load(K_ + row_base + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        exponent = tl.where(m, gq - ref[None, :], 0.0)
        span = tl.maximum(span, tl.max(tl.abs(exponent), 1))
        xq = q * tl.exp(exponent)
        own = tl.dot(xq, tl.trans(ko * tl.exp(-exponent)), own, input_precision=DOT_PRECISION)
        if i > 0:
            mc = before[:, None] & mk[None, :]
            c_offs = (row0 + offs_c)[:, None] * (H * K) + head * K + offs_k[None, :]
            kc = tl.load(K_ + c_offs, mask=mc, other=0.0).to(tl.float32)
            gk = tl.load(GC + c_offs, mask=mc, other=0.0)
            yk = kc * tl.exp(tl.where(mc, ref[None, :] - gk, 0.0))
            # float32 operands (TF32 for 16-bit inputs, IEEE for float32), as fla keeps its intra-chunk A
            acc = tl.dot(xq, tl.trans(yk), acc, input_precision=DOT_PRECISION)
    # every column but the own block's lower triangle (zeros above the diagonal included)
    local = i * BC + offs_r
    skip = (offs_c[None, :] >= i * BC) & (offs_c[None, :] <= local[:, None])
    tl.store(a_rows[:, None] + offs_c[None, :], acc, mask=rmask[:, None] & ~skip)
    within = tl.max(span, 0) <= SPAN_LIMIT  # (not for NaN gates: they take the exact loop)
    if within:
        lower = offs_r[:, None] >= offs_r[None, :]
        tl.store(a_rows[:, None] + i * BC + offs_r[None, :], own, mask=rmask[:, None] & lower)
    return within == 0


@triton.jit
def _intra_inside(Q, K_, GC, scale, a_rows, row0, length, i, head, offs_r, rmask, row_base, H: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr):
    """The lower triangle of the sub-chunk's own block of A, exactly, over whole key rows (``KP``: K padded to
    a power of two). The diagonal is q . k (no decay). Below it, step j serves two source columns at once:
    tile rows t > j pair with column j (row t), tile rows t < j with column BC-1-j (row BC-1-t, the rows read
    in reverse), so BC/2 steps form every pair once, each exponent <= 0 (a row never precedes its column),
    half the exponentials of one column per step (H100, T=16k: 664 us with a column per step)."""
    offs_k = tl.arange(0, KP)
    mk = offs_k < K
    m = rmask[:, None] & mk[None, :]
    q = tl.load(Q + row_base + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * scale
    gq = tl.load(GC + row_base + offs_k[None, :], mask=m, other=0.0)
    own = tl.load(K_ + row_base + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(a_rows + i * BC + offs_r, tl.sum(q * own, 1), mask=rmask)
    rev = BC - 1 - offs_r
    rev_base = (row0 + i * BC + rev)[:, None] * (H * K) + head * K + offs_k[None, :]
    mr = ((i * BC + rev) < length)[:, None] & mk[None, :]
    q_rev = tl.load(Q + rev_base, mask=mr, other=0.0).to(tl.float32) * scale
    g_rev = tl.load(GC + rev_base, mask=mr, other=0.0)
    for j in range(BC // 2):
        lo = i * BC + j
        hi = i * BC + BC - 1 - j
        y_lo = tl.load(K_ + (row0 + lo) * (H * K) + head * K + offs_k, mask=mk & (lo < length), other=0.0)
        g_lo = tl.load(GC + (row0 + lo) * (H * K) + head * K + offs_k, mask=mk & (lo < length), other=0.0)
        y_hi = tl.load(K_ + (row0 + hi) * (H * K) + head * K + offs_k, mask=mk & (hi < length), other=0.0)
        g_hi = tl.load(GC + (row0 + hi) * (H * K) + head * K + offs_k, mask=mk & (hi < length), other=0.0)
        below = (offs_r > j)[:, None]
        used = (offs_r != j)[:, None] & mk[None, :]
        rows_q = tl.where(below, q, q_rev)
        exponent = tl.where(below, gq, g_rev) - tl.where(below, g_lo[None, :], g_hi[None, :])
        keys = tl.where(below, y_lo[None, :], y_hi[None, :]).to(tl.float32)
        value = tl.sum(rows_q * keys * tl.exp(tl.where(used, exponent, 0.0)), 1)
        row = tl.where(offs_r > j, offs_r, rev)
        col = tl.where(offs_r > j, j, BC - 1 - j)
        ok = (offs_r != j) & (i * BC + row < length)
        tl.store(a_rows + (row - offs_r) * (H * BT) + i * BC + col, value, mask=ok)  # row `row`, not t


@triton.jit
def _output_kernel(
    Q, K_, V_, GC, HS, A_IN, CH_START, CH_LEN, scale,  # inputs (A_IN: ``_intra_kernel``'s A if PRECOMPUTED_A)
    O, A,  # outputs: o [B, T, H, V]; A [B, T, H, BT] float32 (scale included; zero above the diagonal)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECOMPUTED_A: tl.constexpr,
    SCALAR_GATE: tl.constexpr, STORE_A: tl.constexpr,
):
    """The outputs of one chunk and value tile from the stored entering state (and A, stored with STORE_A: the
    backward's residual, computed here unless PRECOMPUTED_A)."""
    iv = tl.program_id(0)
    c = tl.program_id(1)
    head = tl.program_id(2)
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    if length <= 0:  # varlen: table entries past the last chunk
        return
    offs_t = tl.arange(0, BT)
    offs_v = iv * BV + tl.arange(0, BV)
    mv = offs_v < V
    rows = row0 + offs_t
    rmask = (offs_t < length)[:, None]
    qk_offs = rows[:, None] * (H * K) + head * K
    sub_first = (offs_t // BC) * BC  # first row of each row's sub-chunk
    acc_o = tl.zeros([BT, BV], dtype=tl.float32)
    acc_a = tl.zeros([BT, BT], dtype=tl.float32)
    h_base = HS + (wide(c) * H + head) * K * V
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        m = rmask & mk[None, :]
        q = tl.load(Q + qk_offs + offs_k[None, :], mask=m, other=0.0)
        g = load_gates(GC, rows, head, offs_k, offs_t < length, H, K, SCALAR_GATE)
        q_scaled = q.to(tl.float32) * scale
        h = tl.load(h_base + offs_k[:, None] * V + offs_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        acc_o = tl.dot((q_scaled * tl.exp(g)).to(q.dtype), h.to(q.dtype), acc_o, input_precision=DOT_PRECISION)
        if SCALAR_GATE:  # q k^T in the inputs' dtype (exact products), decayed and scaled after the loop
            k = tl.load(K_ + qk_offs + offs_k[None, :], mask=m, other=0.0)
            acc_a = tl.dot(q, tl.trans(k), acc_a, input_precision=DOT_PRECISION)
        elif not PRECOMPUTED_A:
            k = tl.load(K_ + qk_offs + offs_k[None, :], mask=m, other=0.0)
            acc_a += across_sub_chunks(q_scaled, g, k, g, offs_t, length, BC, BT // BC, DOT_PRECISION)
            acc_a += _diag_pairs(q_scaled, g, K_ + head * K, GC + head * K, row0, sub_first, length, offs_t, offs_k,
                                 mk, H * K, BC)
    a_offs = rows[:, None] * (H * BT) + head * BT + offs_t[None, :]
    if SCALAR_GATE:
        b = tl.load(GC + rows * H + head, mask=offs_t < length, other=0.0)
        causal = offs_t[:, None] >= offs_t[None, :]
        acc_a = acc_a * scale * scalar_pair_decay(b, causal)
    elif PRECOMPUTED_A:
        acc_a = tl.load(A_IN + a_offs, mask=rmask, other=0.0)
    v_offs = rows[:, None] * (H * V) + head * V + offs_v[None, :]
    v = tl.load(V_ + v_offs, mask=rmask & mv[None, :], other=0.0)
    acc_o = tl.dot(acc_a.to(v.dtype), v, acc_o, input_precision=DOT_PRECISION)
    tl.store(O + v_offs, acc_o.to(O.dtype.element_ty), mask=rmask & mv[None, :])
    if STORE_A and not PRECOMPUTED_A and iv == 0:
        tl.store(A + a_offs, acc_a, mask=rmask)


@triton.jit
def _carried_output_kernel(
    Q, K_, V_, GC, G, A_IN, H0, SUMS, TOTALS, scale, NUM_CHUNKS, SEGMENTS,  # inputs
    CH_START, CH_LEN, SEG_FIRST, SEG_INFO,  # varlen: the chunk table, the segments' chunk bounds and (sequence,
                                            # its first segment, last-of-sequence flag) per segment
    O, A, CARRY, HT,  # outputs: o; A (SCALAR_GATE with STORE_A); entering states (STORE_CARRY); final state
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr, DECAYED_KEYS: tl.constexpr, STORE_A: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_CARRY: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The outputs of one segment of chunks (fixed lengths; grid: value tiles x sequence-segments x heads) with
    the chunk state carried in registers from the segment's entering state: the recurrence of
    ``_state_kernel`` and the outputs of ``_output_kernel`` in one pass, so no state is stored and read back
    (at B=4 T=16k H=8 K=V=128 the stored bf16 states are 268 MB written and read again). Every segment runs at
    once. Its entering state is carried here from the initial state H0 through the earlier segments' own sums
    SUMS ([B * SEGMENTS, H, K, V], ``_state_kernel`` from zero) and summed log gates TOTALS ([B, SEGMENTS, H,
    K or 1]): a few tile loads and FMAs instead of a chain of small XLA kernels between two launches; it is
    written to CARRY for the backward (STORE_CARRY), and the last segment writes the final state HT ([B, H, K,
    V]). The whole key width is one tile (``KP``: K rounded up to a power of two). SCALAR_GATE: K_ holds the
    keys, A is formed here (one dot) and stored with STORE_A, the rows' decays scale the dots' results and v
    (the same products as the stored-state kernels, whose rounding to the inputs' dtype falls on q and k
    instead); else A_IN holds A and, with DECAYED_KEYS, K_ the decayed keys (only the state update reads
    keys). IS_VARLEN: the segments are runs of chunks inside each packed sequence (``vjp.varlen_segments``; a
    padding entry has sequence -1 and does nothing), chunks may be short (rows masked)."""
    iv = tl.program_id(0)
    sp = tl.program_id(1)
    head = tl.program_id(2)
    if IS_VARLEN:
        seq = tl.load(SEG_INFO + sp * 3)
        if seq < 0:
            return
        first_segment = tl.load(SEG_INFO + sp * 3 + 1)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, KP)
    offs_v = iv * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    tile_offs = offs_k[:, None] * V + offs_v[None, :]
    if not IS_VARLEN:
        seq = sp // SEGMENTS
        first_segment = sp - sp % SEGMENTS
    if HAS_H0:
        state = tl.load(H0 + (wide(seq) * H + head) * K * V + tile_offs, mask=mkv, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([KP, BV], dtype=tl.float32)
    for j in range(first_segment, sp):  # the earlier segments of this sequence, in order
        state = carry_through_segment(state, SUMS, TOTALS, j, head, offs_k, mk, tile_offs, mkv, H, K, V, SCALAR_GATE)
    if STORE_CARRY:
        tl.store(CARRY + (wide(sp) * H + head) * K * V + tile_offs, state, mask=mkv)
    causal = offs_t[:, None] >= offs_t[None, :]
    lo, hi = sequence_chunks(sp, SEG_FIRST, NUM_CHUNKS, SEGMENTS, IS_VARLEN)
    for c in range(lo, hi):
        row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
        rows = row0 + offs_t
        if IS_VARLEN:  # a sequence's last chunk may be short
            on_rows = offs_t < length
            tile_rows = on_rows[:, None]
        else:  # whole chunks: the tiles masked only where the widths need it
            tile_rows = True
        qk_offs = rows[:, None] * (H * K) + head * K + offs_k[None, :]
        v_offs = rows[:, None] * (H * V) + head * V + offs_v[None, :]
        a_offs = rows[:, None] * (H * BT) + head * BT + offs_t[None, :]
        q = tl.load(Q + qk_offs, mask=tile_rows & mk[None, :], other=0.0)
        k = tl.load(K_ + qk_offs, mask=tile_rows & mk[None, :], other=0.0)
        v = tl.load(V_ + v_offs, mask=tile_rows & mv[None, :], other=0.0)
        if SCALAR_GATE:
            # one decay per row: applied to the dots' results and to v's rows, never to [BT, K] float32 copies
            # of q or k (registers: 255 per thread and spills with them, sm_90)
            if IS_VARLEN:
                b = tl.load(GC + rows * H + head, mask=on_rows, other=0.0)
            else:
                b = tl.load(GC + rows * H + head)
            acc = tl.dot(q, state.to(q.dtype), input_precision=DOT_PRECISION) * (scale * tl.exp(b))[:, None]
            a = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            a = a * scale * scalar_pair_decay(b, causal)
            if STORE_A and iv == 0:
                if IS_VARLEN:
                    tl.store(A + a_offs, a, mask=tile_rows)
                else:
                    tl.store(A + a_offs, a)
            acc = tl.dot(a.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            if IS_VARLEN:
                raw = tl.load(G + rows * H + head, mask=on_rows, other=0.0)
            else:
                raw = tl.load(G + rows * H + head)
            # to the chunk's end, from the raw gates after each row (as `decay_to_chunk_end`)
            value_decay = tl.exp(tl.cumsum(raw, axis=0, reverse=True) - raw)
            v_decayed = (v.to(tl.float32) * value_decay[:, None]).to(v.dtype)
            state = state * tl.exp(tl.load(GC + (row0 + length - 1) * H + head))
            state = tl.dot(tl.trans(k), v_decayed, state, input_precision=DOT_PRECISION)
        else:
            g = load_gates(GC, rows, head, offs_k, offs_t < length, H, K, SCALAR_GATE)
            q_decayed = (q.to(tl.float32) * scale * tl.exp(g)).to(q.dtype)
            acc = tl.dot(q_decayed, state.to(q.dtype), input_precision=DOT_PRECISION)
            if IS_VARLEN:
                a = tl.load(A_IN + a_offs, mask=tile_rows, other=0.0)
            else:
                a = tl.load(A_IN + a_offs)
            acc = tl.dot(a.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            if DECAYED_KEYS:
                k_decayed = k.to(v.dtype)
            else:
                k_decayed = decay_to_chunk_end(k, G, rows, offs_t, length, offs_k, head, H, K, SCALAR_GATE).to(v.dtype)
            g_last = load_row_gate(GC, row0 + length - 1, head, offs_k, H, K, SCALAR_GATE)
            state = state * tl.exp(g_last)[:, None]
            state = tl.dot(tl.trans(k_decayed), v, state, input_precision=DOT_PRECISION)
        tl.store(O + v_offs, acc.to(O.dtype.element_ty), mask=tile_rows & mv[None, :])
    if IS_VARLEN:
        last_of_sequence = tl.load(SEG_INFO + sp * 3 + 2) != 0
    else:
        last_of_sequence = sp % SEGMENTS == SEGMENTS - 1
    if last_of_sequence:
        tl.store(HT + (wide(seq) * H + head) * K * V + tile_offs, state, mask=mkv)


@triton.jit
def _diag_pairs(x, x_gates, Y, GY, row0, sub_first, length, offs_t, offs_k, mk, row_stride, BC: tl.constexpr):
    """[BT, BT]: ``sum_k x_t[k] y_s[k] exp(gx_t[k] - gy_s[k])`` for s <= t in the same sub-chunk, zero
    elsewhere; column j of every sub-chunk at once (row t reads y at its sub-chunk's row j). `Y`/`GY`
    point at token 0 of this head; `sub_first`: the first row in the chunk of each row's sub-chunk."""
    acc = tl.zeros([x.shape[0], x.shape[0]], dtype=tl.float32)
    local = offs_t % BC
    for j in range(BC):
        src_local = sub_first + j
        on_src = (src_local < length)[:, None] & mk[None, :]
        src = row0 + src_local
        y = tl.load(Y + src[:, None] * row_stride + offs_k[None, :], mask=on_src, other=0.0).to(tl.float32)
        gy = tl.load(GY + src[:, None] * row_stride + offs_k[None, :], mask=on_src, other=0.0)
        on = (local >= j)[:, None]
        col = tl.sum(x * y * tl.exp(tl.where(on, x_gates - gy, 0.0)), 1)
        col = tl.where(local >= j, col, 0.0)
        acc += tl.where(offs_t[None, :] == src_local[:, None], col[:, None], 0.0)
    return acc
