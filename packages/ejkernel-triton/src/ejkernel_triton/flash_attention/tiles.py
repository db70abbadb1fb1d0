"""The per-tile steps of the attention kernels, shared by flash attention and block-sparse attention.

A kernel decides *which* tiles it visits (flash attention: a contiguous key or query range split into a
mask-free middle and masked edges; block-sparse attention: the blocks of a schedule); the steps below do
the work of one tile: the online-softmax update of the forward (`fwd_tile`), the dK/dV and dQ
accumulations of the backward (`dkv_tile`, `dq_tile`), and the helpers around them (`softmax_update`,
`sink_state`, `store_rows`, `softcap_grad`). Triton inlines them, so a loop calling a step compiles as if
the body were written in place. ``MASKED`` steps bound-check their loads and apply the token rules
(`common.visible`); unmasked ones assume the whole tile is in bounds and visible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.flash_attention.common import dropout_scale, scores, visible


def sink_blocks(num_sinks: int) -> int:
    """BLOCK_SINKS for `sink_state` (a power of two >= 2)."""
    return max(2, triton.next_power_of_2(max(num_sinks, 1)))


@triton.jit
def softmax_update(s, m_i, l_i, acc):
    """One online-softmax step over logits `s` (log2 units): the block's numerators and the running max,
    sum and accumulator rescaled to the new max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def sink_state(Aux, head, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Initial running max and sum of a query block: attention sinks only add to the denominator."""
    if NUM_SINKS > 0:
        offs_s = tl.arange(0, BLOCK_SINKS)
        aux = tl.load(Aux + head * NUM_SINKS + offs_s, mask=offs_s < NUM_SINKS, other=float("-inf"))
        aux = aux.to(tl.float32) * 1.4426950408889634
        aux_max = tl.max(aux, 0)
        m_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + aux_max
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + tl.sum(tl.math.exp2(aux - aux_max), 0)
    else:
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def store_rows(o_ptrs, lse_ptrs, acc, m_i, l_i, o_mask, row_mask):
    """Normalize and store a query block's output and log-sum-exp (log2 units)."""
    # With no visible key the row's value sum is 0: output zeros, and an infinite lse makes every
    # recomputed probability of the backward pass exactly 0.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(o_ptrs, (acc / safe_l[:, None]).to(o_ptrs.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("inf")), mask=row_mask)


@triton.jit
def softcap_grad(ds, s, softcap, USE_SOFTCAP: tl.constexpr):
    """Chain rule through the soft cap: s (log2 units) = cap * tanh(x / cap) * log2(e), so dx = ds * (1 - tanh^2)."""
    if USE_SOFTCAP:
        capped = s * (0.6931471805599453 / softcap)  # back to natural units, over the cap: tanh
        ds = ds * (1.0 - capped * capped)
    return ds


@triton.jit
def token_tile(Base, batch, start, head, idx, offs, SEQ, stride_s, stride_h):
    """Pointers [len(idx), len(offs)] to tokens `start + idx`, head `head`, of sequence `batch` in a
    [batch, SEQ, heads, dim] array (`start`: the sequence's first token in a packed batch, else 0)."""
    return Base + batch * SEQ * stride_s + start * stride_s + head * stride_h + idx[:, None] * stride_s + offs[None, :]


@triton.jit
def load_token_tile(Base, batch, start, head, idx, n, offs, C, SEQ, stride_s, stride_h):
    """`token_tile`'s elements, zero past `n` tokens or `C` columns."""
    return tl.load(token_tile(Base, batch, start, head, idx, offs, SEQ, stride_s, stride_h),
                   mask=(idx[:, None] < n) & (offs[None, :] < C), other=0.0)


@triton.jit
def store_token_tile(Base, x, batch, start, head, idx, n, offs, C, SEQ, stride_s, stride_h):
    """Store `x` (cast to Base's type) into `token_tile`, skipping what is past `n` tokens or `C` columns."""
    tl.store(token_tile(Base, batch, start, head, idx, offs, SEQ, stride_s, stride_h),
             x.to(Base.dtype.element_ty), mask=(idx[:, None] < n) & (offs[None, :] < C))


@triton.jit
def query_operands(Q, K, V, QSeg, KSeg, batch, head, kv_head, q_start, k_start, rows, q_len, offs_kv, offs_d,
                   offs_dv, SEQ_Q, SEQ_KV, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                   D: tl.constexpr, HAS_SEGMENTS: tl.constexpr):
    """What a program owning query rows `rows` reads once (forward and dQ): its Q tile, the pointers of key
    tile 0 (K, V and key segment ids) that the tile steps offset, and the rows' segment ids."""
    q = load_token_tile(Q, batch, q_start, head, rows, q_len, offs_d, D, SEQ_Q, stride_qs, stride_qh)
    k_ptrs = token_tile(K, batch, k_start, kv_head, offs_kv, offs_d, SEQ_KV, stride_ks, stride_kh)
    v_ptrs = token_tile(V, batch, k_start, kv_head, offs_kv, offs_dv, SEQ_KV, stride_vs, stride_vh)
    q_seg = segment_ids(QSeg + batch * SEQ_Q + q_start, rows, q_len, -2, HAS_SEGMENTS)
    return q, k_ptrs, v_ptrs, KSeg + batch * SEQ_KV + k_start, q_seg


@triton.jit
def key_operands(K, V, KSeg, batch, kv_head, k_start, cols, k_len, offs_d, offs_dv, SEQ_KV, stride_ks, stride_kh,
                 stride_vs, stride_vh, D: tl.constexpr, DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr):
    """What a dK/dV program owning key rows `cols` reads once: its K and V tiles and their segment ids."""
    k = load_token_tile(K, batch, k_start, kv_head, cols, k_len, offs_d, D, SEQ_KV, stride_ks, stride_kh)
    v = load_token_tile(V, batch, k_start, kv_head, cols, k_len, offs_dv, DV, SEQ_KV, stride_vs, stride_vh)
    return k, v, segment_ids(KSeg + batch * SEQ_KV + k_start, cols, k_len, -1, HAS_SEGMENTS)


@triton.jit
def gradient_rows(DO, LSE, Delta, batch, head, q_start, rows, q_len, offs_dv, SEQ_Q, stride_os, stride_oh,
                  NUM_HEADS: tl.constexpr, DV: tl.constexpr):
    """A dQ program's dO tile and its rows' log-sum-exp and delta."""
    row_ok = rows < q_len
    do = load_token_tile(DO, batch, q_start, head, rows, q_len, offs_dv, DV, SEQ_Q, stride_os, stride_oh)
    row_offset = (batch * NUM_HEADS + head) * SEQ_Q + q_start
    lse = tl.load(LSE + row_offset + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_offset + rows, mask=row_ok, other=0.0)
    return do, lse, delta


@triton.jit
def load_tile(ptrs, row_ok, offs, C: tl.constexpr, BLOCK_C: tl.constexpr, MASKED: tl.constexpr):
    """A [rows, BLOCK_C] tile: rows `row_ok` ([rows, 1]) only when MASKED, padded columns only when the block
    is wider than the data, else no mask at all (the mask-free middle of a loop; `row_ok` then goes unused)."""
    if MASKED:
        tile = tl.load(ptrs, mask=row_ok & (offs[None, :] < C), other=0.0)
    elif BLOCK_C != C:
        tile = tl.load(ptrs, mask=offs[None, :] < C, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def segment_ids(Seg, idx, n, other, HAS_SEGMENTS: tl.constexpr):
    """Segment ids of tokens `idx` (`other` past `n`); without segments the positions themselves."""
    if HAS_SEGMENTS:
        seg = tl.load(Seg + idx, mask=idx < n, other=other)
    else:
        seg = idx
    return seg


@triton.jit
def tma_descriptors(Q, K, V, q_rows, kv_rows, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """Device-side TMA descriptors of dense Q, K, V seen as 2-D [tokens, heads * D] matrices (the data
    partitioning refuses the reshape of a 3-D view): Q tiles [BLOCK_Q, D], K and V tiles [BLOCK_KV, D]."""
    kv_width = (NUM_HEADS // GROUP) * D
    q_desc = tl.make_tensor_descriptor(Q, shape=[q_rows, NUM_HEADS * D], strides=[NUM_HEADS * D, 1],
                                       block_shape=[BLOCK_Q, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[kv_rows, kv_width], strides=[kv_width, 1], block_shape=[BLOCK_KV, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[kv_rows, kv_width], strides=[kv_width, 1], block_shape=[BLOCK_KV, D])
    return q_desc, k_desc, v_desc

@triton.jit
def tma_tile(acc, m_i, l_i, q, k_desc, v_desc, k_row, kv_col, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """The TMA forward's step over the key tile at row `k_row` of the 2-D K/V descriptors (no mask)."""
    k = k_desc.load([k_row, kv_col])
    s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, "tf32")
    p, m_i, l_i, acc = softmax_update(s, m_i, l_i, acc)
    v = v_desc.load([k_row, kv_col])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def store_tma_rows(O, LSE, acc, m_i, l_i, batch, head, m0, SEQ_Q, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                   BLOCK_Q: tl.constexpr):
    """`store_rows` for the TMA forwards: output rows `m0 ...` of (batch, head) in a dense [B, SEQ_Q, H, D]."""
    rows = m0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    row0 = batch.to(tl.int64) * SEQ_Q  # element offsets of large batches overflow int32
    o_ptrs = O + (row0 + rows[:, None]) * (NUM_HEADS * D) + head * D + offs_d[None, :]
    store_rows(o_ptrs, LSE + (batch.to(tl.int64) * NUM_HEADS + head) * SEQ_Q + rows, acc, m_i, l_i,
               (rows[:, None] < SEQ_Q) & (offs_d[None, :] < D), rows < SEQ_Q)


@triton.jit
def fwd_tile(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, n0,
             rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
             head_hash, q_start, k_start,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
             WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
             MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
             DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    """The forward's step over the key tile starting at `n0` (local index): (acc, m_i, l_i) updated."""
    cols = n0 + offs_kv
    k = load_tile(k_ptrs + n0 * stride_k_seq, cols[:, None] < k_len, offs_d, D, BLOCK_D, MASKED)
    s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
    if MASKED:
        ok = visible(rows[:, None], cols[None, :], q_len, k_len, k_seg_ptr, q_seg[:, None],
                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
        s = tl.where(ok, s, float("-inf"))
    p, m_i, l_i, acc = softmax_update(s, m_i, l_i, acc)
    v = load_tile(v_ptrs + n0 * stride_v_seq, cols[:, None] < k_len, offs_dv, DV, BLOCK_DV, MASKED)
    if DROPOUT:  # the denominator keeps every probability; only the values see the mask
        p = p * dropout_scale(head_hash, (q_start + rows)[:, None], (k_start + cols)[None, :],
                              DROP_THRESHOLD, DROP_SCALE)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def dkv_tile(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, q_seg_ptr, m0,
             cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_q_seq, stride_do_seq,
             qk_scale, softcap, head_hash, q_start, k_start,
             D: tl.constexpr, DV: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
             WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
             USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
             DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    """The dK/dV step over the query tile starting at `m0` (local index): (dk, dv) updated."""
    rows = m0 + offs_q
    q = load_tile(q_ptrs + m0 * stride_q_seq, rows[:, None] < q_len, offs_d, D, BLOCK_D, MASKED)
    do = load_tile(do_ptrs + m0 * stride_do_seq, rows[:, None] < q_len, offs_dv, DV, BLOCK_DV, MASKED)
    if MASKED:
        lse = tl.load(lse_ptr + rows, mask=rows < q_len, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=rows < q_len, other=0.0)
    else:
        lse = tl.load(lse_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    # Transposed scores [keys, queries]: dK and dV then need no transposes of the accumulators.
    st = scores(k, q, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
    pt = tl.math.exp2(st - lse[None, :])
    if MASKED:
        q_seg = segment_ids(q_seg_ptr, rows, q_len, -2, HAS_SEGMENTS)
        ok = visible(rows[None, :], cols[:, None], q_len, k_len, None, q_seg[None, :],
                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, False)
        if HAS_SEGMENTS:
            ok = ok & (q_seg[None, :] == k_seg[:, None])
        pt = tl.where(ok, pt, 0.0)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = dropout_scale(head_hash, (q_start + rows)[None, :], (k_start + cols)[:, None],
                             DROP_THRESHOLD, DROP_SCALE)
        dv = tl.dot((pt * keep).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = dpt * keep
    else:
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dst = softcap_grad(pt * (dpt - delta[None, :]), st, softcap, USE_SOFTCAP)
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def dq_tile(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, n0,
            rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
            head_hash, q_start, k_start,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
            WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
            MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
            DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    """The dQ step over the key tile starting at `n0` (local index): dq updated."""
    cols = n0 + offs_kv
    k = load_tile(k_ptrs + n0 * stride_k_seq, cols[:, None] < k_len, offs_d, D, BLOCK_D, MASKED)
    v = load_tile(v_ptrs + n0 * stride_v_seq, cols[:, None] < k_len, offs_dv, DV, BLOCK_DV, MASKED)
    s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        ok = visible(rows[:, None], cols[None, :], q_len, k_len, k_seg_ptr, q_seg[:, None],
                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DROPOUT:
        dp = dp * dropout_scale(head_hash, (q_start + rows)[:, None], (k_start + cols)[None, :],
                                DROP_THRESHOLD, DROP_SCALE)
    ds = softcap_grad(p * (dp - delta[:, None]), s, softcap, USE_SOFTCAP)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq
