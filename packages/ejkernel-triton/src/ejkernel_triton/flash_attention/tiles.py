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
    if MASKED:
        k = tl.load(k_ptrs + n0 * stride_k_seq, mask=(cols[:, None] < k_len) & (offs_d[None, :] < D),
                    other=0.0)
    elif BLOCK_D != D:
        k = tl.load(k_ptrs + n0 * stride_k_seq, mask=offs_d[None, :] < D, other=0.0)
    else:
        k = tl.load(k_ptrs + n0 * stride_k_seq)
    s = scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
    if MASKED:
        ok = visible(rows[:, None], cols[None, :], q_len, k_len, k_seg_ptr, q_seg[:, None],
                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
        s = tl.where(ok, s, float("-inf"))
    p, m_i, l_i, acc = softmax_update(s, m_i, l_i, acc)
    if MASKED:
        v = tl.load(v_ptrs + n0 * stride_v_seq, mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV),
                    other=0.0)
    elif BLOCK_DV != DV:
        v = tl.load(v_ptrs + n0 * stride_v_seq, mask=offs_dv[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs + n0 * stride_v_seq)
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
    if MASKED:
        q = tl.load(q_ptrs + m0 * stride_q_seq, mask=(rows[:, None] < q_len) & (offs_d[None, :] < D),
                    other=0.0)
        do = tl.load(do_ptrs + m0 * stride_do_seq,
                     mask=(rows[:, None] < q_len) & (offs_dv[None, :] < DV), other=0.0)
        lse = tl.load(lse_ptr + rows, mask=rows < q_len, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=rows < q_len, other=0.0)
    else:
        if BLOCK_D != D:
            q = tl.load(q_ptrs + m0 * stride_q_seq, mask=offs_d[None, :] < D, other=0.0)
        else:
            q = tl.load(q_ptrs + m0 * stride_q_seq)
        if BLOCK_DV != DV:
            do = tl.load(do_ptrs + m0 * stride_do_seq, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            do = tl.load(do_ptrs + m0 * stride_do_seq)
        lse = tl.load(lse_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    # Transposed scores [keys, queries]: dK and dV then need no transposes of the accumulators.
    st = scores(k, q, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
    pt = tl.math.exp2(st - lse[None, :])
    if MASKED:
        if HAS_SEGMENTS:
            q_seg = tl.load(q_seg_ptr + rows, mask=rows < q_len, other=-2)
        else:
            q_seg = rows
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
    if MASKED:
        k = tl.load(k_ptrs + n0 * stride_k_seq, mask=(cols[:, None] < k_len) & (offs_d[None, :] < D),
                    other=0.0)
        v = tl.load(v_ptrs + n0 * stride_v_seq, mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV),
                    other=0.0)
    else:
        if BLOCK_D != D:
            k = tl.load(k_ptrs + n0 * stride_k_seq, mask=offs_d[None, :] < D, other=0.0)
        else:
            k = tl.load(k_ptrs + n0 * stride_k_seq)
        if BLOCK_DV != DV:
            v = tl.load(v_ptrs + n0 * stride_v_seq, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            v = tl.load(v_ptrs + n0 * stride_v_seq)
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
