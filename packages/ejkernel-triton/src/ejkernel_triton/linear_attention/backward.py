"""Backward kernels of chunked gated linear attention (notation of ``forward``; ``q^ = scale q``).

With ``dh_{n+1}`` the gradient of the state leaving chunk ``n`` and ``dA[t, s] = do_t . v_s`` (s <= t)::

    dh_n  = exp(gc_last) * dh_{n+1} + sum_t (q^_t exp(gc_t)) do_t^T           (``_state_grad_kernel``, reverse)
    dv_s  = sum_t A[t, s] do_t + (k_s exp(gc_last - gc_s)) dh_{n+1}            (``_dv_kernel``, also writes dA)
    dq^_t = exp(gc_t) (do_t h_n^T) + sum_{s<=t} dA[t, s] k_s exp(gc_t - gc_s)
    dk_s  = exp(gc_last - gc_s) (v_s dh_{n+1}^T) + sum_{t>=s} dA[t, s] q^_t exp(gc_t - gc_s)

and the gates' gradient from the identity d gc_t = q^_t dq^_t - k_t dk_t (every pair factor and decayed
key depends on gc through exp(gc_t - gc_s)), plus, on the chunk's last row, the state's own decay
``exp(gc_last) h_n . dh_{n+1}`` and the decayed keys ``sum_s k_s dk_s(state part)``; the gradient of the
raw gates is the reversed cumulative sum of d gc inside the chunk (``_dqkg_kernel``). Scalar gates
(``SCALAR_GATE``): the in-chunk pairs by two dots, ``(dA * exp(gc_t - gc_s))`` against k and q, and each
program's d gc summed over its key columns (the key tiles' partial sums are added in JAX). The chunk states
``h_n`` are recomputed by the forward's state kernel rather than kept from the forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.linear_attention.forward import (SPAN_LIMIT, carry_through_segment, chunk_rows, chunk_span,
                                                      load_gates, load_row_gate, scalar_pair_decay,
                                                      sequence_chunks, state_tile, wide)


@triton.jit
def _state_grad_kernel(
    Q, GC, DO, DHT, SUMS, TOTALS, CH_START, CH_LEN, SEQ_FIRST, scale, NUM_CHUNKS, SEGMENTS,  # inputs
    DHS, DH0,  # outputs: dh per chunk (gradient of the state leaving it), dh_0 per sequence (float32)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr, HAS_DHT: tl.constexpr,
    STORE_STATES: tl.constexpr, CARRY_IN: tl.constexpr,
):
    """The state gradients' recurrence (reverse) for one K x V tile of one (sequence, head), or of one segment
    of its chunks (``SEGMENTS`` > 1: DH0 then holds the gradients entering each segment, as in
    ``forward._state_kernel``), from DHT, the gradient leaving the sequence (HAS_DHT; else zeros). Segments
    start from zero, or (CARRY_IN) from DHT carried back through the later segments' own sums SUMS (this
    kernel's launch from zero) and summed log gates TOTALS. Without STORE_STATES only DH0 is written."""
    sh, s, head, offs_k, offs_v, mk, mv, mkv, state_offs = state_tile(H, K, V, BK, BV)
    offs_t = tl.arange(0, BT)
    if HAS_DHT:
        dstate = tl.load(DHT + wide(s // SEGMENTS * H + head) * K * V + state_offs, mask=mkv, other=0.0).to(tl.float32)
    else:
        dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if CARRY_IN:  # fixed lengths: s = sequence * SEGMENTS + segment
        last = s - s % SEGMENTS + SEGMENTS - 1
        for i in range(last - s):  # the later segments of this sequence, last first
            dstate = carry_through_segment(dstate, SUMS, TOTALS, last - i, head, offs_k, mk, state_offs, mkv, H, K,
                                           V, SCALAR_GATE)
    lo, hi = sequence_chunks(s, SEQ_FIRST, NUM_CHUNKS, SEGMENTS, IS_VARLEN)
    for i in range(hi - lo):
        c = hi - 1 - i
        if STORE_STATES:
            tl.store(DHS + (wide(c) * H + head) * K * V + state_offs, dstate.to(DHS.dtype.element_ty), mask=mkv)
        row0, length, rows, rmask, k_offs = chunk_rows(c, CH_START, CH_LEN, offs_t, offs_k, head, H, K, BT,
                                                       IS_VARLEN)
        q = tl.load(Q + k_offs, mask=rmask & mk[None, :], other=0.0)
        g = load_gates(GC, rows, head, offs_k, offs_t < length, H, K, SCALAR_GATE)
        g_last = load_row_gate(GC, row0 + length - 1, head, offs_k, H, K, SCALAR_GATE)
        do = tl.load(DO + rows[:, None] * (H * V) + head * V + offs_v[None, :], mask=rmask & mv[None, :], other=0.0)
        q_decayed = (q.to(tl.float32) * scale * tl.exp(g)).to(do.dtype)
        dstate = dstate * tl.exp(g_last)[:, None]
        dstate = tl.dot(tl.trans(q_decayed), do, dstate, input_precision=DOT_PRECISION)
    tl.store(DH0 + sh.to(tl.int64) * K * V + state_offs, dstate, mask=mkv)


@triton.jit
def _dv_kernel(
    K_, V_, GC, A, DO, DHS, CH_START, CH_LEN,  # inputs
    DV, DA,  # outputs: dv [B, T, H, V]; dA [B, T, H, BT] float32 (zero above the diagonal)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr,
):
    c = tl.program_id(0)
    head = tl.program_id(1)
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    if length <= 0:
        return
    offs_t = tl.arange(0, BT)
    rows = row0 + offs_t
    on_rows = offs_t < length
    a_rows = rows * (H * BT) + head * BT
    a_t = tl.load(A + a_rows[None, :] + offs_t[:, None], mask=on_rows[None, :], other=0.0)  # A^T: [s, t]
    if SCALAR_GATE:  # the keys' decay to the chunk's end, once (not per key tile)
        b = tl.load(GC + rows * H + head, mask=on_rows, other=0.0)
        key_decay = tl.exp(tl.load(GC + (row0 + length - 1) * H + head) - b)
    d_a = tl.zeros([BT, BT], dtype=tl.float32)
    h_base = DHS + (wide(c) * H + head) * K * V
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < V
        v_offs = rows[:, None] * (H * V) + head * V + offs_v[None, :]
        m = on_rows[:, None] & mv[None, :]
        do = tl.load(DO + v_offs, mask=m, other=0.0)
        v = tl.load(V_ + v_offs, mask=m, other=0.0)
        d_a = tl.dot(do, tl.trans(v), d_a, input_precision=DOT_PRECISION)
        dv = tl.dot(a_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < K
            k_offs = rows[:, None] * (H * K) + head * K + offs_k[None, :]
            k = tl.load(K_ + k_offs, mask=on_rows[:, None] & mk[None, :], other=0.0)
            if SCALAR_GATE:
                k_decayed = (k.to(tl.float32) * key_decay[:, None]).to(do.dtype)
            else:
                g = load_gates(GC, rows, head, offs_k, on_rows, H, K, SCALAR_GATE)
                g_last = load_row_gate(GC, row0 + length - 1, head, offs_k, H, K, SCALAR_GATE)
                k_decayed = (k.to(tl.float32) * tl.exp(g_last[None, :] - g)).to(do.dtype)
            dh = tl.load(h_base + offs_k[:, None] * V + offs_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
            dv = tl.dot(k_decayed, dh.to(do.dtype), dv, input_precision=DOT_PRECISION)
        tl.store(DV + v_offs, dv.to(DV.dtype.element_ty), mask=m)
    d_a = tl.where(offs_t[:, None] >= offs_t[None, :], d_a, 0.0)
    tl.store(DA + a_rows[:, None] + offs_t[None, :], d_a, mask=on_rows[:, None])


@triton.jit
def _dqkg_kernel(
    Q, K_, V_, GC, HS, DO, DHS, DA, CH_START, CH_LEN, scale,  # inputs
    DQ, DK, DG,  # outputs: dq, dk in the inputs' dtype; dg float32 (raw gates; scalar gates: [B, T, H, key tiles])
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr,
):
    ik = tl.program_id(0)
    c = tl.program_id(1)
    head = tl.program_id(2)
    row0, length = chunk_span(c, CH_START, CH_LEN, BT, IS_VARLEN)
    if length <= 0:
        return
    NC: tl.constexpr = BT // BC
    offs_t = tl.arange(0, BT)
    offs_k = ik * BK + tl.arange(0, BK)
    mk = offs_k < K
    rows = row0 + offs_t
    on_rows = offs_t < length
    m = on_rows[:, None] & mk[None, :]
    k_offs = rows[:, None] * (H * K) + head * K + offs_k[None, :]
    q = tl.load(Q + k_offs, mask=m, other=0.0)
    k = tl.load(K_ + k_offs, mask=m, other=0.0)
    g = load_gates(GC, rows, head, offs_k, on_rows, H, K, SCALAR_GATE)
    g_last = load_row_gate(GC, row0 + length - 1, head, offs_k, H, K, SCALAR_GATE)
    # (q and k stay in their dtype and are widened where used: two float32 [BT, BK] tiles fewer live)

    # the state's part, over V tiles
    dq_state = tl.zeros([BT, BK], dtype=tl.float32)
    dk_state = tl.zeros([BT, BK], dtype=tl.float32)
    d_last = tl.zeros([BK], dtype=tl.float32)
    state_base = (wide(c) * H + head) * K * V
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < V
        v_offs = rows[:, None] * (H * V) + head * V + offs_v[None, :]
        do = tl.load(DO + v_offs, mask=on_rows[:, None] & mv[None, :], other=0.0)
        v = tl.load(V_ + v_offs, mask=on_rows[:, None] & mv[None, :], other=0.0)
        state_offs = state_base + offs_k[:, None] * V + offs_v[None, :]
        h = tl.load(HS + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        dh = tl.load(DHS + state_offs, mask=mk[:, None] & mv[None, :], other=0.0)
        dq_state = tl.dot(do, tl.trans(h.to(do.dtype)), dq_state, input_precision=DOT_PRECISION)
        dk_state = tl.dot(v, tl.trans(dh.to(v.dtype)), dk_state, input_precision=DOT_PRECISION)
        d_last += tl.sum(h.to(tl.float32) * dh.to(tl.float32), 1)
    dq = dq_state * tl.exp(g)
    dk_state = dk_state * tl.exp(g_last[None, :] - g)
    d_last = d_last * tl.exp(g_last) + tl.sum(k.to(tl.float32) * dk_state, 0)

    # the pairs inside the chunk
    a_offs = rows * (H * BT) + head * BT
    d_a = tl.load(DA + a_offs[:, None] + offs_t[None, :], mask=on_rows[:, None], other=0.0)
    dk = dk_state
    if SCALAR_GATE:  # every pair by two dots: dA * exp(gc_t - gc_s) (t >= s) against the keys and the queries
        b = tl.load(GC + rows * H + head, mask=on_rows, other=0.0)
        causal = offs_t[:, None] >= offs_t[None, :]
        pairs = d_a * scalar_pair_decay(b, causal)
        dq = tl.dot(pairs, k.to(tl.float32), dq, input_precision=DOT_PRECISION)
        dk = tl.dot(tl.trans(pairs), q.to(tl.float32) * scale, dk, input_precision=DOT_PRECISION)
    else:
        # the sub-chunks' own blocks by the dots too while every |gc_t - gc_r| in them (r: a sub-chunk's first
        # row) stays within SPAN_LIMIT, else pair by pair
        first = row0 + (offs_t // BC) * BC
        g_first = tl.load(GC + first[:, None] * (H * K) + head * K + offs_k[None, :], mask=m, other=0.0)
        span = tl.max(tl.max(tl.where(m, tl.abs(g - g_first), 0.0), 1), 0)
        within = span <= SPAN_LIMIT  # (not for NaN gates: they take the exact loop)
        if within:
            refs = GC + row0 * (H * K) + head * K + offs_k  # row 0 of the chunk, this key tile
            dq, dk = _shared_ref_pairs(d_a, q, k, scale, g, g_first, refs, mk, dq, dk, offs_t, on_rows, length,
                                       H, K, BC, NC, DOT_PRECISION)
        else:
            dq, dk = _sub_chunk_pairs(d_a, q.to(tl.float32) * scale, k.to(tl.float32), g, dq, dk, offs_t, on_rows,
                                      length, within, BC, NC,
                                      DOT_PRECISION)
            dq, dk = _own_block_pairs(Q, K_, GC, DA, a_offs, g, dq, dk, row0, length, offs_t, offs_k, mk, on_rows,
                                      head, scale, H, K, BT, BC)
    d_gc = q.to(tl.float32) * scale * dq - k.to(tl.float32) * dk
    tl.store(DQ + k_offs, (dq * scale).to(DQ.dtype.element_ty), mask=m)
    tl.store(DK + k_offs, dk.to(DK.dtype.element_ty), mask=m)
    if SCALAR_GATE:  # this key tile's share of the scalar gate's gradient
        dg_rows = tl.cumsum(tl.sum(d_gc, 1), axis=0, reverse=True) + tl.sum(d_last, 0)
        tl.store(DG + (rows * H + head) * tl.num_programs(0) + ik, dg_rows, mask=on_rows)
    else:
        dg = tl.cumsum(d_gc, axis=0, reverse=True) + d_last[None, :]
        tl.store(DG + k_offs, dg, mask=m)


@triton.jit
def _sub_chunk_pairs(d_a, q_scaled, k32, g, dq, dk, offs_t, on_rows, length, own, BC: tl.constexpr, NC: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """dq and dk from the pairs in different sub-chunks (and, with ``own``, inside the same one), one dot per
    sub-chunk: for dq of sub-chunk i the keys before it (and its own) split at its first row r,
    ``exp(gc_t - gc_r) exp(gc_r - gc_s)``; for dk of sub-chunk j the queries after it (and its own) split at its
    last row (with ``own``: its first row, whose exponents the caller bounded). d_a is zero above the diagonal,
    so a sub-chunk's own block adds only the pairs s <= t."""
    sub = offs_t // BC
    own_blocks = own.to(tl.int32)  # 1: a sub-chunk's own block joins its dot
    for i in range(1 - own_blocks, NC):  # dq
        if i * BC < length:
            ref = tl.sum(tl.where((offs_t == i * BC)[:, None], g, 0.0), 0)
            on_rows_i = ((sub == i) & on_rows)[:, None]
            on_cols = ((sub < i + own_blocks) & on_rows)[:, None]
            keys = tl.where(on_cols, k32 * tl.exp(tl.where(on_cols, ref[None, :] - g, 0.0)), 0.0)
            part = tl.dot(d_a, keys, input_precision=DOT_PRECISION)  # float32 operands: TF32 / IEEE
            dq += tl.where(on_rows_i, part * tl.exp(tl.where(on_rows_i, g - ref[None, :], 0.0)), 0.0)
    for j in range(0, NC - 1 + own_blocks):  # dk
        ref_row = j * BC + (1 - own_blocks) * (BC - 1)
        if ref_row < length:
            ref = tl.sum(tl.where((offs_t == ref_row)[:, None], g, 0.0), 0)
            on_rows_j = ((sub == j) & on_rows)[:, None]
            on_cols = ((sub > j - own_blocks) & on_rows)[:, None]
            queries = tl.where(on_cols, q_scaled * tl.exp(tl.where(on_cols, g - ref[None, :], 0.0)), 0.0)
            part = tl.dot(tl.trans(d_a), queries, input_precision=DOT_PRECISION)
            dk += tl.where(on_rows_j, part * tl.exp(tl.where(on_rows_j, ref[None, :] - g, 0.0)), 0.0)
    return dq, dk


@triton.jit
def _own_block_pairs(Q, K_, GC, DA, d_a_rows, g, dq, dk, row0, length, offs_t, offs_k, mk, on_rows, head, scale,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dq and dk from the pairs inside each sub-chunk, exactly (every exponent <= 0 for decays, however
    strong): column j of every sub-chunk at once, row t reading its sub-chunk's row j."""
    local = offs_t % BC
    for j in range(BC):
        src_local = offs_t - local + j
        on_src = src_local < length
        src_offs = (row0 + src_local)[:, None] * (H * K) + head * K + offs_k[None, :]
        g_src = tl.load(GC + src_offs, mask=on_src[:, None] & mk[None, :], other=0.0)
        k_src = tl.load(K_ + src_offs, mask=on_src[:, None] & mk[None, :], other=0.0).to(tl.float32)
        q_src = tl.load(Q + src_offs, mask=on_src[:, None] & mk[None, :], other=0.0).to(tl.float32) * scale
        # dq_t += dA[t, src] k_src exp(g_t - g_src)       (src <= t)
        later = (local >= j) & on_rows
        a_col = tl.load(DA + d_a_rows + src_local, mask=later, other=0.0)
        dq += a_col[:, None] * k_src * tl.exp(tl.where(later[:, None], g - g_src, 0.0))
        # dk_s += dA[src, s] q_src exp(g_src - g_s)        (src >= s)
        earlier = (local <= j) & on_src
        a_row = tl.load(DA + (row0 + src_local) * (H * BT) + head * BT + offs_t, mask=earlier, other=0.0)
        dk += a_row[:, None] * q_src * tl.exp(tl.where(earlier[:, None], g_src - g, 0.0))
    return dq, dk


@triton.jit
def _shared_ref_pairs(d_a, q, k, scale, g, g_first, REFS, mk, dq, dk, offs_t, on_rows, length, H: tl.constexpr,
                      K: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dq and dk from every pair of the chunk (s <= t), each row's factor referred to its own sub-chunk's first
    row f(t): ``exp(gc_t - gc_s) = X_t c_(i, j) / X_s`` with ``X = exp(gc - gc_f)`` (within e^+-SPAN_LIMIT: the
    caller checked the span) and ``c_(i, j) = exp(gc_f(i) - gc_f(j))`` (i >= j the sub-chunks of t and s; <= 1
    for decays), a [BK] vector per pair of sub-chunks applied to a dot's rows in place: one exponential tile
    (1 / X; X by a reciprocal) instead of two per sub-chunk and side, and only one of X, 1 / X live at a time
    (sm_90, 4 warps: 120 B of spills against 160 B for `_sub_chunk_pairs`). REFS: gc at the chunk's row 0
    in this key tile (rows j * BC are the sub-chunks' first rows)."""
    sub = offs_t // BC
    valid = on_rows[:, None]
    # dq = X * (dq / X + sum_j ...), dk = (1 / X) * (dk X + sum_i ...): one of X, 1/X live at a time
    growth = tl.exp(tl.where(valid, g_first - g, 0.0))  # 1 / X
    dq = dq * growth
    for j in range(NC):  # dq: the keys of sub-chunk j against the rows of sub-chunks i >= j
        if j * BC < length:
            ref_j = tl.load(REFS + j * BC * (H * K), mask=mk, other=0.0)
            keys = tl.where((sub == j)[:, None] & valid, k.to(tl.float32) * growth, 0.0)
            part = tl.dot(d_a, keys, input_precision=DOT_PRECISION)  # rows before sub-chunk j: zero (d_a)
            for i in range(j + 1, NC):  # rows of later sub-chunks: their constant c_(i, j), in place
                if i * BC < length:
                    ref_i = tl.load(REFS + i * BC * (H * K), mask=mk, other=0.0)
                    part = tl.where((sub == i)[:, None], part * tl.exp(ref_i - ref_j)[None, :], part)
            dq += part
    decay = 1.0 / growth  # X
    dq = dq * decay
    dk = dk * decay
    for i in range(NC):  # dk: the queries of sub-chunk i against the keys of sub-chunks j <= i
        if i * BC < length:
            ref_i = tl.load(REFS + i * BC * (H * K), mask=mk, other=0.0)
            queries = tl.where((sub == i)[:, None] & valid, q.to(tl.float32) * (scale * decay), 0.0)
            part = tl.dot(tl.trans(d_a), queries, input_precision=DOT_PRECISION)  # keys after sub-chunk i: zero
            for j in range(i):
                ref_j = tl.load(REFS + j * BC * (H * K), mask=mk, other=0.0)
                part = tl.where((sub == j)[:, None], part * tl.exp(ref_i - ref_j)[None, :], part)
            dk += part
    dk = dk / decay
    return dq, dk
