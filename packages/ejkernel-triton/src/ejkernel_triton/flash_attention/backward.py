"""Backward kernels: dK/dV (`_dkv_kernel`), dQ (`_dq_kernel`) and, for float32, delta (`_delta_kernel`).

The dK/dV kernel runs one program per key block and kv head, looping over every query head of its group:
grouped-query attention needs no repeated kv and no atomics. The dQ kernel runs one program per query
block; it recomputes QKᵀ and dO·Vᵀ (7 matmuls instead of 5: fusing dQ into the dK/dV pass would need fp32
atomics, slower at long sequences). Both recompute the probabilities from the forward's log-sum-exp and
the dropout keep mask from its index hash.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel_triton.flash_attention.common import (
    StaticParams,
    dropout_head_hash,
    kernel_meta,
    kv_range,
    num_sequences,
    padded_dim,
    placeholder,
    q_range,
    query_block,
    seed_arg,
    sequence_bounds,
)
from ejkernel_triton.flash_attention.tiles import (
    dkv_tile,
    dq_tile,
    gradient_rows,
    key_operands,
    query_operands,
    store_token_tile,
    token_tile,
)
from ejkernel_triton.launch import launch


@triton.jit
def _dkv_block_loop(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, q_seg_ptr, start, stop,
                    cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_q_seq, stride_do_seq,
                    qk_scale, softcap, head_hash, q_start, k_start,
                    BLOCK_Q: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for m0 in range(start, stop, BLOCK_Q):
        dk, dv = dkv_tile(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, q_seg_ptr, m0, cols, offs_q, offs_d, offs_dv, q_len,
            k_len, k_seg, stride_q_seq, stride_do_seq, qk_scale, softcap, head_hash, q_start, k_start, D, DV, BLOCK_D,
            BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, MASKED, DOT_PRECISION, DROPOUT,
            DROP_THRESHOLD, DROP_SCALE)
    return dk, dv


@triton.jit
def _dkv_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, CuQ, CuK, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DKOut, DVOut,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
):
    seq_idx = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start, q_len, k_start, k_len = sequence_bounds(CuQ, CuK, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN)
    n0 = tl.program_id(0) * BLOCK_KV
    if n0 >= k_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)  # int64: offsets of large batches overflow int32
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = n0 + offs_kv

    k, v, k_seg = key_operands(K, V, KSeg, batch, kv_head, k_start, cols, k_len, offs_d, offs_dv, SEQ_KV, stride_ks,
                               stride_kh, stride_vs, stride_vh, D, DV, HAS_SEGMENTS)
    q_seg_ptr = QSeg + batch * SEQ_Q + q_start

    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_DV], dtype=tl.float32)
    lo, hi, full_lo, full_hi = q_range(n0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                        WINDOW_RIGHT, HAS_SEGMENTS)
    # Every query head of this kv head's group adds to the same dK/dV: no repeated kv, no atomics.
    for g in range(GROUP):
        head = kv_head * GROUP + g
        head_hash = dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0
        q_ptrs = token_tile(Q, batch, q_start, head, offs_q, offs_d, SEQ_Q, stride_qs, stride_qh)
        do_ptrs = token_tile(DO, batch, q_start, head, offs_q, offs_dv, SEQ_Q, stride_os, stride_oh)
        row_offset = (batch * NUM_HEADS + head) * SEQ_Q + q_start
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, full_lo,
            full_hi, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, lo,
            full_lo, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, full_hi,
            hi, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)

    dk = dk * qk_scale
    store_token_tile(DKOut, dk, batch, k_start, kv_head, cols, k_len, offs_d, D, SEQ_KV, stride_ks, stride_kh)
    store_token_tile(DVOut, dv, batch, k_start, kv_head, cols, k_len, offs_dv, DV, SEQ_KV, stride_vs, stride_vh)


@triton.jit
def _dq_block_loop(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, start, stop,
                   rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
                   head_hash, q_start, k_start,
                   BLOCK_KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                   WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                   MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                   DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for n0 in range(start, stop, BLOCK_KV):
        dq = dq_tile(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, n0, rows, offs_kv, offs_d, offs_dv,
            q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, D, DV, BLOCK_D, BLOCK_DV,
            CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, MASKED, DOT_PRECISION, DROPOUT,
            DROP_THRESHOLD, DROP_SCALE)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, CuQ, CuK, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DQ,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, REVERSE_BLOCKS: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
):
    seq_idx = tl.program_id(1)
    head = tl.program_id(2)
    m0, q_start, q_len, k_start, k_len = query_block(CuQ, CuK, seq_idx, SEQ_Q, SEQ_KV, BLOCK_Q, IS_VARLEN,
                                                      REVERSE_BLOCKS)
    if m0 >= q_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)  # int64: offsets of large batches overflow int32
    kv_head = head // GROUP
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q

    q, k_ptrs, v_ptrs, k_seg_ptr, q_seg = query_operands(
        Q, K, V, QSeg, KSeg, batch, head, kv_head, q_start, k_start, rows, q_len, offs_kv, offs_d, offs_dv, SEQ_Q,
        SEQ_KV, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, D, HAS_SEGMENTS)
    do, lse, delta = gradient_rows(DO, LSE, Delta, batch, head, q_start, rows, q_len, offs_dv, SEQ_Q, stride_os,
                                   stride_oh, NUM_HEADS, DV)

    head_hash = dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    lo, hi, full_lo, full_hi = kv_range(m0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT, HAS_SEGMENTS)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, full_lo, full_hi, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, lo, full_lo, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, full_hi, hi, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = dq * qk_scale
    store_token_tile(DQ, dq, batch, q_start, head, rows, q_len, offs_d, D, SEQ_Q, stride_qs, stride_qh)


@triton.jit
def _delta_kernel(
    O, DO, CuQ, SEQ_Q,
    Delta,
    NUM_HEADS: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_Q: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """delta_i = <dO_i, O_i> through the same IEEE dot the backward kernels use for dP (float32 only).

    Taken as the diagonal of dO Oᵀ, delta is summed in the order dP_ij = <dO_i, V_j> is, so a row that sees
    a single key (O_i == V_j bitwise) gets dP_ij - delta_i == 0 exactly, as the exact gradient is."""
    seq_idx = tl.program_id(1)
    head = tl.program_id(2)
    q_start, q_len, _, _ = sequence_bounds(CuQ, CuQ, seq_idx, SEQ_Q, SEQ_Q, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_Q
    if m0 >= q_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q
    ptrs = (batch * SEQ_Q * stride_os + q_start * stride_os + head * stride_oh
            + rows[:, None] * stride_os + offs_dv[None, :])
    mask = (rows[:, None] < q_len) & (offs_dv[None, :] < DV)
    o = tl.load(O + ptrs, mask=mask, other=0.0)
    do = tl.load(DO + ptrs, mask=mask, other=0.0)
    gram = tl.dot(do, tl.trans(o), input_precision="ieee")
    delta = tl.sum(tl.where(offs_q[:, None] == offs_q[None, :], gram, 0.0), 1)
    tl.store(Delta + (batch * NUM_HEADS + head) * SEQ_Q + q_start + rows, delta, mask=rows < q_len)


def row_delta(out, do, cu_q, st: StaticParams):
    """delta_i = <dO_i, O_i> in float32, [B, H, Sq]."""
    if out.dtype != jnp.float32:  # one cheap pass, left to XLA
        return jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    b, sq, h, dv = out.shape
    block_q = 32
    varlen = cu_q is not None
    (delta,) = launch(
        _delta_kernel, (out, do, cu_q if varlen else placeholder(), sq),
        (jax.ShapeDtypeStruct((b, h, sq), jnp.float32),), (triton.cdiv(sq, block_q), num_sequences(out, cu_q), h),
        num_warps=4, num_stages=1, zeroed_outputs=(0,) if varlen else (), interpret=st.interpret, NUM_HEADS=h,
        stride_os=h * dv, stride_oh=dv, DV=dv, BLOCK_DV=padded_dim(dv), BLOCK_Q=block_q, IS_VARLEN=varlen)
    return delta


def run_backward(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed, st: StaticParams):
    """(dq, dk, dv, delta): the gradients of q, k, v and delta_i = <dO_i, O_i> (the sinks' gradient needs it)."""
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    config = st.config
    varlen = cu_q is not None
    has_seg = q_seg is not None
    meta = kernel_meta(q, k, v, st, has_seg, varlen)
    n_seq = num_sequences(q, cu_q)
    delta = row_delta(out, do, cu_q, st)
    args = (q, k, v, do, lse, delta, q_seg if has_seg else placeholder(), kv_seg if has_seg else placeholder(),
            cu_q if varlen else placeholder(), cu_k if varlen else placeholder(), seed_arg(seed),
            np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, skv)
    zeroed = lambda n: tuple(range(n)) if varlen else ()  # noqa: E731  padding rows belong to no program
    dk, dv = launch(
        _dkv_kernel, args, (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        (triton.cdiv(skv, config.dkv_block_kv), n_seq, hkv), num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages, zeroed_outputs=zeroed(2), interpret=st.interpret, **meta,
        BLOCK_Q=config.dkv_block_q, BLOCK_KV=config.dkv_block_kv)
    (dq,) = launch(
        _dq_kernel, args, (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        (triton.cdiv(sq, config.dq_block_q), n_seq, h), num_warps=config.bwd_num_warps,
        num_stages=config.bwd_num_stages, zeroed_outputs=zeroed(1), interpret=st.interpret, **meta,
        BLOCK_Q=config.dq_block_q, BLOCK_KV=config.dq_block_kv, REVERSE_BLOCKS=st.causal and not varlen)
    return dq, dk, dv, delta
