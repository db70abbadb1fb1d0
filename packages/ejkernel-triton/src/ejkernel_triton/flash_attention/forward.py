"""Forward kernels: the pointer-load kernel every call can take (`_fwd_kernel`) and, on Hopper, the TMA +
warp-specialized one for unmasked calls (`_fwd_tma_kernel`); both write the output and the per-row
log-sum-exp (log2 units) that the backward pass recomputes probabilities from.

`_fwd_kernel`: one program per (query block, sequence, head), online softmax in exp2 units; the key range
is split into a mask-free middle visited without per-element masking and masked edge ranges; causal
programs are launched longest-first.
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
    placeholder,
    query_block,
    seed_arg,
)
from ejkernel_triton.flash_attention.tiles import (
    fwd_tile,
    query_operands,
    sink_blocks,
    sink_state,
    store_rows,
    store_tma_rows,
    tma_descriptors,
    tma_tile,
    token_tile,
)
from ejkernel_triton.launch import launch


@triton.jit
def _fwd_block_loop(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, start, stop,
                    rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
                    head_hash, q_start, k_start,
                    BLOCK_KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                    WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for n0 in range(start, stop, BLOCK_KV):
        acc, m_i, l_i = fwd_tile(
            acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, n0, rows, offs_kv, offs_d, offs_dv,
            q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, D, DV, BLOCK_D,
            BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, MASKED, DOT_PRECISION, DROPOUT,
            DROP_THRESHOLD, DROP_SCALE)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, QSeg, KSeg, CuQ, CuK, Aux, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs and scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REVERSE_BLOCKS: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
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

    head_hash = dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0

    acc = tl.zeros([BLOCK_Q, BLOCK_DV], dtype=tl.float32)
    m_i, l_i = sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)

    lo, hi, full_lo, full_hi = kv_range(m0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT, HAS_SEGMENTS)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, full_lo, full_hi, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, lo, full_lo, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, full_hi, hi, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)

    o_ptrs = token_tile(O, batch, q_start, head, rows, offs_dv, SEQ_Q, stride_os, stride_oh)
    store_rows(o_ptrs, LSE + (batch * NUM_HEADS + head) * SEQ_Q + q_start + rows, acc, m_i, l_i,
                (rows[:, None] < q_len) & (offs_dv[None, :] < DV), rows < q_len)


@triton.jit
def _fwd_tma_kernel(
    Q, K, V, Aux, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs and scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr, USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
):
    """The forward for Hopper when no logit needs a mask: tiles arrive by TMA (device-side descriptors) and
    the loop over key blocks is warp-specialized, a producer warpgroup issuing the loads while two consumer
    warpgroups, each owning half of the query rows, run the matmuls and the softmax.

    Same results as `_fwd_kernel` for the calls `tuning.tma_forward_applies` admits: dense batches whose lengths
    are multiples of the blocks, no causal/window/segment mask, no dropout, q/v head dim 128.
    Triton 3.6 warp-specializes only a loop without run-time branches whose state does not come from another
    loop, so masked (edge) blocks would have to be masked in every iteration: slower than `_fwd_kernel` on
    causal calls (measured), hence the restriction. The descriptors see 2-D [batch * seq, heads * dim]
    matrices (the data partitioning refuses the reshape of a 3-D view)."""
    batch = tl.program_id(1)
    head = tl.program_id(2)
    m0 = tl.program_id(0) * BLOCK_Q
    kv_head = head // GROUP
    q_desc, k_desc, v_desc = tma_descriptors(Q, K, V, tl.num_programs(1) * SEQ_Q, tl.num_programs(1) * SEQ_KV,
                                             NUM_HEADS, GROUP, D, BLOCK_Q, BLOCK_KV)
    q = q_desc.load([batch * SEQ_Q + m0, head * D])
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    m_i, l_i = sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)
    for n0 in tl.range(0, SEQ_KV, BLOCK_KV, warp_specialize=True):
        acc, m_i, l_i = tma_tile(acc, m_i, l_i, q, k_desc, v_desc, batch * SEQ_KV + n0, kv_head * D, qk_scale,
                                 softcap, USE_SOFTCAP)
    store_tma_rows(O, LSE, acc, m_i, l_i, batch, head, m0, SEQ_Q, NUM_HEADS, D, BLOCK_Q)


def forward_tma(q, k, v, aux, st: StaticParams):
    """`_fwd_tma_kernel` on a call `tuning.tma_forward_applies` admits: (out, lse)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    config = st.config
    num_sinks = aux.shape[-1] if aux is not None else 0
    out_shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    args = (q, k, v, aux if aux is not None else jnp.zeros((1,), jnp.float32), np.float32(st.softmax_scale),
            np.float32(st.softcap or 1.0), sq, skv)
    return launch(
        _fwd_tma_kernel, args, out_shapes, (triton.cdiv(sq, config.fwd_block_q), b, h),
        num_warps=config.fwd_num_warps, num_stages=config.fwd_num_stages, zeroed_outputs=(), interpret=st.interpret,
        tma=True, NUM_HEADS=h, GROUP=h // k.shape[2], D=d, BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv,
        USE_SOFTCAP=st.softcap > 0, NUM_SINKS=num_sinks, BLOCK_SINKS=sink_blocks(num_sinks))


def run_forward(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: StaticParams):
    """The forward kernel `st` selects: (out [B, Sq, H, Dv], lse [B, H, Sq] float32)."""
    if st.tma_forward:
        return forward_tma(q, k, v, aux, st)
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    config = st.config
    varlen = cu_q is not None
    has_seg = q_seg is not None
    num_sinks = aux.shape[-1] if aux is not None else 0
    meta = kernel_meta(q, k, v, st, has_seg, varlen)
    grid = (triton.cdiv(sq, config.fwd_block_q), num_sequences(q, cu_q), h)
    out_shapes = (jax.ShapeDtypeStruct((b, sq, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    args = (q, k, v, q_seg if has_seg else placeholder(), kv_seg if has_seg else placeholder(),
            cu_q if varlen else placeholder(), cu_k if varlen else placeholder(),
            aux if aux is not None else jnp.zeros((1,), jnp.float32), seed_arg(seed),
            np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, k.shape[1])
    return launch(
        _fwd_kernel, args, out_shapes, grid, num_warps=config.fwd_num_warps, num_stages=config.fwd_num_stages,
        zeroed_outputs=(0, 1) if varlen else (), interpret=st.interpret, **meta,
        BLOCK_Q=config.fwd_block_q, BLOCK_KV=config.fwd_block_kv, NUM_SINKS=num_sinks,
        BLOCK_SINKS=sink_blocks(num_sinks), REVERSE_BLOCKS=st.causal and not varlen)
