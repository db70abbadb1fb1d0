"""Kernel launches, the custom VJP and the vmap rules of chunked gated linear attention.

:func:`linear_attention` takes prepared arrays (``__init__`` builds them from the call): q, k [B, T, H, K],
v [B, T, H, V] (one dtype) with kv heads already repeated, ``a`` float32 [B, T, H, K] the summed log gates
(or [B, T, H, 1] with ``StaticParams.scalar_gate``: one gate per token and head),
``h0`` [B or N, H, K, V] or None, and ``tables`` (varlen: :func:`chunk_table` of cu_seqlens, B == 1) or None
(then T is a multiple of ``forward.CHUNK``). It is differentiable in the first five. The
forward saves the in-chunk cumulative gates, the intra-chunk matrix A ([B, T, H, 64] float32, the size
of one more head of q) and, with ``StaticParams.segments`` (the carried-state forward), the states entering
its segments; the backward recomputes the chunk states (per segment, from those). The primal call (no
gradient) stores none of them. Under ``jax.vmap`` the vmapped axis
folds into the batch axis (every array here has the batch first): one launch per kernel; varlen calls loop
(`batching.fold_batch_rule`, shared with flash attention).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton

from ejkernel_triton.batching import fold_batch_rule
from ejkernel_triton.launch import launch
from ejkernel_triton.linear_attention.backward import _dqkg_kernel, _dv_kernel, _state_grad_kernel
from ejkernel_triton.linear_attention.forward import (CHUNK, SUB_CHUNK, _carried_output_kernel, _cumsum_kernel,
                                                      _intra_kernel, _output_kernel, _state_kernel)


@dataclasses.dataclass(frozen=True)
class StaticParams:
    """Everything static about one call (hashable: it keys the custom-VJP and vmap closures)."""

    scale: float
    block_k: int
    block_v: int
    output_block_v: int
    num_warps: int
    num_stages: int
    state_num_warps: int
    interpret: bool
    varlen: bool = False
    backward_num_warps: int = 4
    state_block_k: int = 64
    state_block_v: int = 64
    decayed_keys: bool = False
    intra_kernel: bool = False
    intra_num_warps: int = 4
    intra_split: bool = False
    intra_inside_num_warps: int = 4
    scalar_gate: bool = False
    state_num_stages: int = 2
    segments: int = 0  # > 0: the carried-state forward over that many segments per sequence (0: stored states)
    varlen_run_chunks: int = 0  # varlen, > 0: the carried-state forward over runs of at most that many chunks
    carried_block_v: int = 64
    carried_num_warps: int = 4
    carried_num_stages: int = 2
    cumsum_block_k: int = 128
    cumsum_num_warps: int = 8


def _placeholder(dtype=jnp.float32):
    return jnp.zeros((1,), dtype)


def table_chunks(total: int, num_seqs: int) -> int:
    """Entries of :func:`chunk_table` for ``num_seqs`` sequences packed in ``total`` tokens."""
    return -(-total // CHUNK) + num_seqs


def chunk_table(cu_seqlens, total: int):
    """Varlen chunk table: ``(chunk_start, chunk_len, seq_first)`` int32, over at most ``total / 64 + N``
    chunks (each sequence cut into chunks of 64 from its own start; entries past the last have length 0),
    and the first chunk of every sequence (``[N + 1]``)."""
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    per_seq = (lengths + CHUNK - 1) // CHUNK
    seq_first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_seq).astype(jnp.int32)])
    max_chunks = table_chunks(total, cu.shape[0] - 1)
    ids = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(seq_first[1:], ids, side="right"), 0, cu.shape[0] - 2).astype(jnp.int32)
    start = cu[seq] + (ids - seq_first[seq]) * CHUNK
    length = jnp.where(ids < seq_first[-1], jnp.clip(cu[seq + 1] - start, 0, CHUNK), 0)
    return start.astype(jnp.int32), length.astype(jnp.int32), seq_first


def varlen_segments(tables, per_run: int):
    """The carried forward's segments of a varlen call: every packed sequence's chunks (:func:`chunk_table`) cut
    into runs of at most ``per_run`` (an empty sequence gets one empty run, which writes its final state), over
    a static count S = N + chunks // per_run + 1 (the rest padding). Returns ``seg_first`` [S + 1] int32, the
    runs' chunk bounds (consecutive, read as a varlen SEQ_FIRST table), ``seg_info`` [S, 3] int32 (sequence or
    -1 for padding, the sequence's first run, 1 on its last run) and ``chunk_run`` [chunks] (every chunk-table
    entry's run; unused entries the last, a padding run)."""
    _, ch_len, seq_first = tables
    n = seq_first.shape[0] - 1
    chunks = ch_len.shape[0]
    count = n + chunks // per_run + 1
    runs = jnp.maximum(1, -(-(seq_first[1:] - seq_first[:-1]) // per_run))
    run_first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(runs).astype(jnp.int32)])
    ids = jnp.arange(count, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(run_first[1:], ids, side="right"), 0, n - 1).astype(jnp.int32)
    real = ids < run_first[-1]
    local = ids - run_first[seq]
    lo = jnp.where(real, jnp.minimum(seq_first[seq] + local * per_run, seq_first[seq + 1]), seq_first[-1])
    seg_first = jnp.concatenate([lo, seq_first[-1:]]).astype(jnp.int32)
    seg_info = jnp.stack([jnp.where(real, seq, -1), jnp.where(real, run_first[seq], ids),
                          (real & (local == runs[seq] - 1)).astype(jnp.int32)], axis=1).astype(jnp.int32)
    entries = jnp.arange(chunks, dtype=jnp.int32)
    entry_seq = jnp.clip(jnp.searchsorted(seq_first[1:], entries, side="right"), 0, n - 1)
    chunk_run = jnp.where(entries < seq_first[-1], run_first[entry_seq] + (entries - seq_first[entry_seq]) // per_run,
                          count - 1).astype(jnp.int32)
    return seg_first, seg_info, chunk_run


def _tables(tables):
    return tables if tables is not None else (_placeholder(jnp.int32),) * 3


def _num_chunks(q, tables):
    """(chunks, sequences, chunks per sequence for fixed lengths)."""
    b, t = q.shape[:2]
    if tables is not None:
        return tables[0].shape[0], tables[2].shape[0] - 1, 0
    return b * (t // CHUNK), b, t // CHUNK


def chunk_cumsum(a, k, tables, st: StaticParams):
    """(gc, kd): the log gates [B, T, H, K] cumulated inside each chunk (float32; a Triton kernel: XLA's cumsum
    is slower) and, with ``st.decayed_keys``, the state kernel's decayed keys k * exp(gc_last - gc) in k's
    dtype (else None)."""
    chunks = _num_chunks(a, tables)[0]
    ch_start, ch_len, _ = _tables(tables)
    kd_shape = k.shape if st.decayed_keys else (1,)
    gate_width = a.shape[3]  # K, or 1 for scalar gates
    gc, kd = launch(_cumsum_kernel, (a, k, ch_start, ch_len),
                    (jax.ShapeDtypeStruct(a.shape, jnp.float32), jax.ShapeDtypeStruct(kd_shape, k.dtype)),
                    (chunks, a.shape[2]), num_warps=st.cumsum_num_warps, num_stages=1, interpret=st.interpret,
                    H=a.shape[2], K=gate_width, BT=CHUNK,
                    BK=min(st.cumsum_block_k, max(16, triton.next_power_of_2(gate_width))),
                    IS_VARLEN=st.varlen, WRITE_DECAYED=st.decayed_keys)
    return gc, (kd if st.decayed_keys else None)


def _meta(q, v, st: StaticParams):
    _, _, h, k = q.shape
    return dict(H=h, K=k, V=v.shape[-1], BT=CHUNK, IS_VARLEN=st.varlen, SCALAR_GATE=st.scalar_gate,
                DOT_PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def _state_dtype(q):
    # The dots read the states in the inputs' dtype, so bf16 states lose nothing and halve the traffic; fp16
    # (range 65504) keeps float32 states: sums of many k v^T with weak decay could overflow it.
    return jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32


def _states(k, kd, v, gc, a, h0, tables, st: StaticParams, segments: int = 1, store: bool = True):
    """(h_c entering every chunk [chunks, H, K, V], final state [sequences, H, K, V] float32); ``kd``: the
    decayed keys of :func:`chunk_cumsum` or None (then the kernel decays k itself from the raw gates ``a``).
    ``segments`` > 1 (fixed lengths): each sequence's chunks in that many runs at once, ``h0`` and the second
    result then per (sequence, segment) [B * segments, H, K, V]; ``store=False`` writes only that."""
    h, dk = k.shape[2:]
    dv = v.shape[-1]
    chunks, seqs, per_seq = _num_chunks(k, tables)
    out_shapes = (jax.ShapeDtypeStruct((chunks, h, dk, dv) if store else (1,), _state_dtype(k)),
                  jax.ShapeDtypeStruct((seqs * segments, h, dk, dv), jnp.float32))
    grid = (triton.cdiv(dk, st.state_block_k), triton.cdiv(dv, st.state_block_v), seqs * segments * h)
    keys, raw = (k, a) if kd is None else (kd, _placeholder())
    return launch(_state_kernel, (keys, v, gc, raw, h0 if h0 is not None else _placeholder(), *_tables(tables),
                                  per_seq, int(segments)),
                  out_shapes, grid, num_warps=st.state_num_warps, num_stages=st.state_num_stages, interpret=st.interpret,
                  BK=st.state_block_k, BV=st.state_block_v, HAS_H0=h0 is not None, DECAYED_KEYS=kd is not None,
                  STORE_STATES=store, **_meta(k, v, st))


def segment_totals(gc, segments: int):
    """The summed log gates of each segment [B, segments, H, K or 1] (fixed lengths): the chunks' totals (each
    chunk's last cumulative row) added per run of cdiv(chunks, segments)."""
    b, t, h, width = gc.shape
    chunk_totals = gc[:, CHUNK - 1::CHUNK]  # [B, chunks, H, width]
    per = -(-(t // CHUNK) // segments)
    padded = jnp.pad(chunk_totals, [(0, 0), (0, per * segments - t // CHUNK), (0, 0), (0, 0)])
    return padded.reshape(b, segments, per, h, width).sum(axis=2)


def _intra_matrix(q, k, gc, ch_start, ch_len, attn_shape, chunks, st: StaticParams, dot_precision):
    """A [B, T, H, 64] float32 by `_intra_kernel`: one launch, or (``st.intra_split``) the dots first and the
    sub-chunks' own blocks that their gates' span leaves to the exact pair loop by a second launch into the
    same array (aliased, with the first's flags), so each part runs with its own registers and shared memory."""
    h, dk = q.shape[2:]
    args = (q, k, gc, ch_start, ch_len, np.float32(st.scale))
    common = dict(num_warps=st.intra_num_warps, num_stages=st.num_stages, interpret=st.interpret, H=h, K=dk,
                  BT=CHUNK, BC=SUB_CHUNK, BK=st.block_k, KP=triton.next_power_of_2(dk), IS_VARLEN=st.varlen,
                  DOT_PRECISION=dot_precision)
    grid = (CHUNK // SUB_CHUNK, chunks, h)
    zeroed = (0,) if st.varlen else ()
    unused = (_placeholder(), _placeholder(jnp.int32))
    if not st.intra_split:
        return launch(_intra_kernel, (*args, *unused), (attn_shape, jax.ShapeDtypeStruct((1,), jnp.int32)), grid,
                      zeroed_outputs=zeroed, ACROSS=True, INSIDE=True, **common)[0]
    # (flags of sub-chunks past a short chunk's end are neither written nor read)
    flags = jax.ShapeDtypeStruct((chunks * (CHUNK // SUB_CHUNK), h), jnp.int32)
    across = launch(_intra_kernel, (*args, *unused), (attn_shape, flags), grid, zeroed_outputs=zeroed,
                    ACROSS=True, INSIDE=False, **common)
    return launch(_intra_kernel, (*args, *across), (attn_shape, flags), grid,
                  input_output_aliases={len(args): 0, len(args) + 1: 1}, ACROSS=False, INSIDE=True,
                  **dict(common, num_warps=st.intra_inside_num_warps))[0]


def _run_forward(q, k, v, a, h0, tables, st: StaticParams, residuals: bool = True):
    """(o, final state) and, with ``residuals``, (gc, A, the states entering the segments: [B * segments, H, K,
    V] float32, or an empty [B, 0] without segments); the primal call (no residuals) does not store A."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    chunks = _num_chunks(q, tables)[0]
    gc, kd = chunk_cumsum(a, k, tables, st)
    ch_start, ch_len, _ = _tables(tables)
    attn_shape = jax.ShapeDtypeStruct((b, t, h, CHUNK), jnp.float32)
    store_attn = residuals and not st.intra_kernel
    attn_in = _placeholder()
    if st.intra_kernel:  # A by its own small programs; the output kernel reads it
        attn_in = _intra_matrix(q, k, gc, ch_start, ch_len, attn_shape, chunks, st, _meta(q, v, st)["DOT_PRECISION"])
    out_shapes = (jax.ShapeDtypeStruct((b, t, h, dv), q.dtype),
                  attn_shape if store_attn else jax.ShapeDtypeStruct((1,), jnp.float32))
    if st.segments or st.varlen_run_chunks:
        # each segment's own sum from a zero state (all at once; none needed for one segment)
        sums, totals = _placeholder(), _placeholder()
        segment_tables = (_placeholder(jnp.int32),) * 2
        num_segments, seqs = b * st.segments, b
        if st.varlen_run_chunks:  # runs of chunks inside each packed sequence; the backward's own passes as before
            seg_first, seg_info, chunk_run = varlen_segments(tables, st.varlen_run_chunks)
            segment_tables, num_segments, seqs = (seg_first, seg_info), seg_info.shape[0], tables[2].shape[0] - 1
            sums = _states(k, kd, v, gc, a, None, (ch_start, ch_len, seg_first), st, store=False)[1]
            last_rows = ch_start + jnp.maximum(ch_len, 1) - 1
            chunk_totals = jnp.where((ch_len > 0)[:, None, None], gc[0, last_rows], 0.0)
            totals = jax.ops.segment_sum(chunk_totals, chunk_run, num_segments=num_segments)
        elif st.segments > 1:
            sums = _states(k, kd, v, gc, a, None, None, st, segments=st.segments, store=False)[1]
            totals = segment_totals(gc, st.segments)
        keys, raw = (k, a) if kd is None else (kd, _placeholder())
        store_carry = residuals and not st.varlen
        carry_shape = (num_segments, h, dk, dv) if store_carry else (1,)
        o, attn, carries, final = launch(
            _carried_output_kernel,
            (q, keys, v, gc, raw, attn_in, h0 if h0 is not None else _placeholder(), sums, totals,
             np.float32(st.scale), t // CHUNK, max(1, int(st.segments)), ch_start, ch_len, *segment_tables),
            (*out_shapes, jax.ShapeDtypeStruct(carry_shape, jnp.float32),
             jax.ShapeDtypeStruct((seqs, h, dk, dv), jnp.float32)),
            (triton.cdiv(dv, st.carried_block_v), num_segments, h), num_warps=st.carried_num_warps,
            num_stages=st.carried_num_stages, zeroed_outputs=(0,) if st.varlen else (), interpret=st.interpret,
            KP=max(16, triton.next_power_of_2(dk)), BV=st.carried_block_v, DECAYED_KEYS=kd is not None,
            STORE_A=store_attn, HAS_H0=h0 is not None, STORE_CARRY=store_carry, IS_VARLEN=st.varlen, H=h, K=dk,
            V=dv, BT=CHUNK, SCALAR_GATE=st.scalar_gate, DOT_PRECISION=_meta(q, v, st)["DOT_PRECISION"])
        if not store_carry:
            carries = jnp.zeros((b, 0), jnp.float32)
    else:
        carries = jnp.zeros((b, 0), jnp.float32)  # batch-first like every output (the vmap rule folds them)
        hs, final = _states(k, kd, v, gc, a, h0, tables, st)
        o, attn = launch(_output_kernel, (q, k, v, gc, hs, attn_in, ch_start, ch_len, np.float32(st.scale)),
                         out_shapes, (triton.cdiv(dv, st.output_block_v), chunks, h), num_warps=st.num_warps,
                         num_stages=st.num_stages, zeroed_outputs=(0,) if st.varlen else (), interpret=st.interpret,
                         BC=SUB_CHUNK, BK=st.block_k, BV=st.output_block_v, PRECOMPUTED_A=st.intra_kernel,
                         STORE_A=store_attn, **_meta(q, v, st))
    if not residuals:
        return o, final
    return o, final, gc, (attn_in if st.intra_kernel else attn), carries


def _state_grads(q, gc, do, dht, tables, st: StaticParams, segments: int = 1, store: bool = True, carry_in=None):
    """(dh per chunk, dh_0 per sequence) by the reverse recurrence from ``dht`` (the final state's cotangent;
    None: zeros); ``segments``/``store`` as in :func:`_states` (the second result then per (sequence,
    segment)): each segment from zero, or with ``carry_in`` (each segment's own sum from zero [B * segments,
    H, K, V], its summed log gates) from ``dht`` carried back to it in the kernel."""
    assert segments == 1 or dht is None or carry_in is not None, "segments start from zero or carry dht in"
    h, dk = q.shape[2:]
    dv = do.shape[-1]
    chunks, seqs, per_seq = _num_chunks(q, tables)
    ch_start, ch_len, seq_first = _tables(tables)
    sums, totals = carry_in if carry_in is not None else (_placeholder(), _placeholder())
    return launch(
        _state_grad_kernel, (q, gc, do, dht if dht is not None else _placeholder(), sums, totals, ch_start, ch_len,
                             seq_first, np.float32(st.scale), per_seq, int(segments)),
        (jax.ShapeDtypeStruct((chunks, h, dk, dv) if store else (1,), _state_dtype(q)),
         jax.ShapeDtypeStruct((seqs * segments, h, dk, dv), jnp.float32)),
        (triton.cdiv(dk, st.state_block_k), triton.cdiv(dv, st.state_block_v), seqs * segments * h),
        num_warps=st.state_num_warps, num_stages=st.state_num_stages, interpret=st.interpret, BK=st.state_block_k,
        BV=st.state_block_v, HAS_DHT=dht is not None, STORE_STATES=store, CARRY_IN=carry_in is not None,
        **_meta(q, do, st))


def _run_backward(q, k, v, a, gc, h0, attn, carries, do, dht, tables, st: StaticParams):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    chunks = _num_chunks(q, tables)[0]
    common = dict(num_stages=st.num_stages, interpret=st.interpret, **_meta(q, v, st))
    warps = st.backward_num_warps
    # the states again (recomputed: [chunks, H, K, V] per call would be the largest residual); the decayed
    # keys too (the cumulative gates it writes again equal the saved gc). With segments, every segment at once
    # from the entering states the forward kept, and the state gradients likewise (each segment's sum from zero
    # first, then every segment at once from the final state's cotangent carried back through the later sums).
    kd = chunk_cumsum(a, k, tables, st)[1] if st.decayed_keys else None
    ch_start, ch_len, _ = _tables(tables)
    if st.segments > 1:
        hs, _ = _states(k, kd, v, gc, a, carries, tables, st, segments=st.segments)
        _, sums = _state_grads(q, gc, do, None, tables, st, segments=st.segments, store=False)
        dhs, dh0 = _state_grads(q, gc, do, dht, tables, st, segments=st.segments,
                                carry_in=(sums, segment_totals(gc, st.segments)))
        dh0 = dh0.reshape(b, st.segments, h, dk, dv)[:, 0]
    else:
        hs, _ = _states(k, kd, v, gc, a, h0, tables, st)
        dhs, dh0 = _state_grads(q, gc, do, dht, tables, st)
    d_v, d_attn = launch(
        _dv_kernel, (k, v, gc, attn, do, dhs, ch_start, ch_len),
        (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, t, h, CHUNK), jnp.float32)),
        (chunks, h), num_warps=warps, zeroed_outputs=(0,) if st.varlen else (), BK=st.block_k,
        BV=st.block_v, **common)
    key_tiles = triton.cdiv(dk, st.block_k)
    # scalar gates: each key tile's share of the gate gradient, added here
    dg_shape = (b, t, h, key_tiles) if st.scalar_gate else q.shape
    d_q, d_k, d_a = launch(
        _dqkg_kernel, (q, k, v, gc, hs, do, dhs, d_attn, ch_start, ch_len, np.float32(st.scale)),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(dg_shape, jnp.float32)),
        (key_tiles, chunks, h), num_warps=warps,
        zeroed_outputs=(0, 1, 2) if st.varlen else (), BC=SUB_CHUNK, BK=st.block_k, BV=st.block_v, **common)
    if st.scalar_gate:
        d_a = jnp.sum(d_a, axis=-1, keepdims=True)
    return d_q, d_k, d_v, d_a, dh0


@functools.lru_cache(maxsize=None)
def _batched_calls(st: StaticParams):
    """(primal forward, forward keeping the residuals, backward), each with the fold-into-batch vmap rule."""
    def forward(residuals):
        @jax.custom_batching.custom_vmap
        def fwd(q, k, v, a, h0, tables):
            return tuple(_run_forward(q, k, v, a, h0, tables, st, residuals))

        fwd.def_vmap(fold_batch_rule(fwd, 5, 5 if residuals else 2, varlen_args=1))
        return fwd

    @jax.custom_batching.custom_vmap
    def bwd(q, k, v, a, gc, h0, attn, carries, do, dht, tables):
        return tuple(_run_backward(q, k, v, a, gc, h0, attn, carries, do, dht, tables, st))

    bwd.def_vmap(fold_batch_rule(bwd, 10, 5, varlen_args=1))
    return forward(False), forward(True), bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def linear_attention(q, k, v, a, h0, tables, st: StaticParams):
    """``(o [B, T, H, V] in q's dtype, final state [B or N, H, K, V] float32)`` (see the module docstring)."""
    return _batched_calls(st)[0](q, k, v, a, h0, tables)


def _linear_attention_fwd(q, k, v, a, h0, tables, st: StaticParams):
    o, final, gc, attn, carries = _batched_calls(st)[1](q, k, v, a, h0, tables)
    return (o, final), (q, k, v, a, gc, h0, attn, carries, tables)


def _linear_attention_bwd(st: StaticParams, res, cotangents):
    q, k, v, a, gc, h0, attn, carries, tables = res
    do, dht = cotangents
    bwd = _batched_calls(st)[2]
    dq, dk, dv, da, dh0 = bwd(q, k, v, a, gc, h0, attn, carries, do.astype(q.dtype), dht.astype(jnp.float32),
                              tables)
    return dq, dk, dv, da, None if h0 is None else dh0.astype(h0.dtype), None


linear_attention.defvjp(_linear_attention_fwd, _linear_attention_bwd)
