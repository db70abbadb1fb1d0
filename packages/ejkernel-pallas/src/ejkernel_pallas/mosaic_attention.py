"""Attention over block schedules on Mosaic GPU (Hopper: TMA copies, wgmma, warp specialization), forward and
backward: the Pallas GPU block-sparse attention (its mask's schedules) and flash attention (the dense
schedules: every block the causal / window rules reach) on Hopper.

The Triton-lowered kernels of :mod:`ejkernel_pallas.blocksparse_attention_gpu` cannot overlap the softmax of
one tile with the tensor-core work of another; their kept-block efficiency stayed near half of dense flash
attention's at 10 % density. These kernels keep the schedules (the same rows: partial visits, full visits,
their blocks) and run each mask block of 128 rows as one CTA of three warpgroups:

- a memory warpgroup (few registers) walks the row's blocks and TMA-copies them into a ring of ``stages``
  shared-memory slots, refilling a slot once both compute warpgroups released it (:func:`_stream`);
- two compute warpgroups, 64 rows each, run the matmuls on wgmma with the softmax in registers. Both read
  the same schedule row, so they visit the same blocks.

Forward (per query block; K/V streamed): ``S = Q K^T``, online softmax, ``O += P V``; the compute warpgroups
take turns on the tensor cores through a shared barrier (one's softmax overlaps the other's matmuls). dQ
(per query block; K/V streamed): ``P`` from the saved LSE, ``dP = dO V^T``, ``dQ += dS K``. dK/dV (per key
block and query head; Q, dO, LSE and delta streamed by query block, each visit taken as two halves of 64
query rows so that the four accumulators fit the registers): ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``,
``dK += dS^T Q``; GQA sums the per-query-head dK/dV of a group afterwards.

Partial visits (a causal or window boundary, or a ragged tail, crosses the block) run the masked body, full
ones the mask-free body: two loops, as in the Triton-lowered kernels. Output and log-sum-exp are those of
the GPU flash forward (natural-log LSE, ``0`` and a zero row where a row sees no key), so either forward
feeds either backward.

Served: bf16/fp16, head_dim 64 or 128 (query and value alike), query mask blocks of 128 rows, key mask
blocks of 64 or 128 (the backward: 128), causal, sliding window, soft cap, segment ids (each CTA's own ids
loaded once, the visited blocks' streamed with them), sinks (they start each row's softmax state), GQA/MQA.
Everything else (float32, other blocks or head dims, a GPU before Hopper) is :func:`refusal`'s /
:func:`backward_refusal`'s reason and runs the Triton-lowered kernels instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ejkernel.plugins.checks import gpu_compute_capability

plgpu = None  # jax.experimental.pallas.mosaic_gpu, imported on first use (~0.9 s: not at plugin import)

LOG2E = math.log2(math.e)
ROWS_PER_WARPGROUP = 64  # wgmma's M per warpgroup
COMPUTE_WARPGROUPS = 2
Q_BLOCK = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS  # the query mask block one CTA serves
SHARED_MEMORY_BYTES = 227 * 1024  # per CTA on sm_90
HEAD_DIMS = (64, 128)
KV_BLOCKS = (64, 128)


def shared_memory_bytes(head_dim: int, kv_block: int, stages: int) -> int:
    """The kernel's shared memory: Q/O tiles of both compute warpgroups, ``stages`` K and V slots (16-bit),
    the LSE rows, and 4 KiB for barriers and alignment (3 slots at head_dim 128 and key blocks of 128 come to
    229,888 bytes by the first three and took 232,568 on an H100, 2026-11-27: over the limit)."""
    return 2 * (Q_BLOCK * head_dim + 2 * stages * kv_block * head_dim) + 4 * Q_BLOCK + 4096


def _mosaic_gpu():
    global plgpu
    if plgpu is None:
        from jax.experimental.pallas import mosaic_gpu

        plgpu = mosaic_gpu
    return plgpu


def hopper_gpu() -> bool:
    """True where this process's GPU has compute capability 9.x (wgmma and TMA as used here)."""
    return (gpu_compute_capability() or "").startswith("9")


def _blocks(call) -> tuple[int, int]:
    """The (query, key) blocks the kernels run: a block-sparse call's mask blocks; 128 x 128 for dense
    attention (a ``FlashAttentionCall``)."""
    return getattr(call, "q_block_size", Q_BLOCK), getattr(call, "kv_block_size", Q_BLOCK)


def packed_self_attention(call) -> bool:
    """A varlen call whose queries and keys share one ``cum_seqlens`` array over equal lengths: causal and
    window rules on packed positions equal the per-sequence ones within a sequence, so the sequences can run
    as segment ids."""
    return (call.cum_seqlens_q is not None and call.cum_seqlens_q is call.cum_seqlens_k
            and call.query.shape[1] == call.key.shape[1])


def refusal(call, *, check_device: bool = True) -> str | None:
    """Why the Mosaic GPU forward cannot take ``call`` (a validated ``BlockSparseAttentionCall``, or a
    ``FlashAttentionCall`` run as every block of 128 x 128), or None."""
    query, value = call.query, call.value
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {query.dtype} (bf16 or fp16)"
    if query.shape[-1] not in HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return f"head dims (query {query.shape[-1]}, value {value.shape[-1]}): equal, one of {HEAD_DIMS}"
    q_block, kv_block = _blocks(call)
    if q_block != Q_BLOCK or kv_block not in KV_BLOCKS:
        return f"mask blocks ({q_block}, {kv_block}): ({Q_BLOCK}, one of {KV_BLOCKS})"
    if getattr(call, "cum_seqlens_q", None) is not None and not packed_self_attention(call):
        return ("varlen with separate cum_seqlens_q / cum_seqlens_k arrays runs in the Triton-lowered kernels (one "
                "array for both, over equal lengths, runs here: its sequences as segments)")
    if getattr(call, "dropout_prob", 0.0):
        return "dropout runs in the Triton-lowered kernels"
    if getattr(call, "bias", None) is not None or getattr(call, "attention_mask", None) is not None:
        return "bias and attention_mask"
    if check_device and not hopper_gpu():
        return "needs a Hopper GPU (sm_90a: wgmma, TMA)"
    try:  # last: the import takes ~0.9 s, needless where the call is refused anyway
        _mosaic_gpu()
    except ImportError as error:  # the Mosaic GPU dialect ships with jaxlib's CUDA support
        return f"jax.experimental.pallas.mosaic_gpu is not importable ({error})"
    return None


class _Static(NamedTuple):
    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    q_offset: int  # key position of query row 0 (queries end-aligned to the keys)
    kv_len: int
    kv_block: int
    head_dim: int
    groups: int  # query heads per kv head
    schedule_dims: tuple[int, int]  # (mask_batch, mask_heads) of the schedule rows
    stages: int
    has_segments: bool = False
    has_sinks: bool = False


def _schedule(sched_ref, st: _Static, batch, head, row):
    """(partial visits, all visits, block of visit ``j``) of this CTA's schedule row."""
    mask_batch, mask_heads = st.schedule_dims
    where = (batch if mask_batch > 1 else 0, head if mask_heads > 1 else 0, row)
    partial = sched_ref[(*where, 0)]
    return partial, partial + sched_ref[(*where, 1)], lambda j: sched_ref[(*where, 2 + j)]


def _base2_logits(s, st: _Static):
    """``(logits * log2(e), tanh of the capped logits or None)`` of raw ``q . k`` products ``s``."""
    if st.soft_cap is None:
        return s * (st.scale * LOG2E), None
    tanh = jnp.tanh(s * (st.scale / st.soft_cap))
    return tanh * (st.soft_cap * LOG2E), tanh


def _masked(s, st: _Static, q_axis: int, q_first, kv_first, segments=None):
    """``s`` with -inf where causal / window / the key length / segment ids hide the pair; ``q_axis`` is the
    query axis of the tile (0 in the forward and dQ, 1 in the transposed dK/dV tiles); ``*_first`` the tile's
    first query / key position; ``segments`` the tile's (query, key) segment-id vectors or None."""
    q_pos = plgpu.broadcasted_iota(jnp.int32, s.shape, q_axis, layout=plgpu.Layout.WGMMA) + q_first
    kv_pos = plgpu.broadcasted_iota(jnp.int32, s.shape, 1 - q_axis, layout=plgpu.Layout.WGMMA) + kv_first
    keep = kv_pos < st.kv_len
    if st.causal:
        keep &= kv_pos <= q_pos
    if st.window is not None:
        left, right = st.window
        keep &= (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)
    if segments is not None:
        q_seg, kv_seg = segments
        keep &= lax.broadcast_in_dim(q_seg, s.shape, [q_axis]) == lax.broadcast_in_dim(kv_seg, s.shape, [1 - q_axis])
    return jnp.where(keep, s, -jnp.inf)


def _stream(streams, block_of, total, stages: int):
    """The memory warpgroup: TMA-copies block ``block_of(j)`` of every stream into slot ``j % stages`` for
    visits ``j < total``, reusing a slot once the compute warpgroups released it. ``streams``: ``(source,
    slots, ready, released)`` with ``source(block)`` the GMEM view to copy."""
    plgpu.set_max_registers(40, action="decrease")

    def fetch(j, slot, wait):
        block = block_of(j)
        for source, slots, ready, released in streams:
            if wait:
                plgpu.barrier_wait(released.at[slot])
            plgpu.copy_gmem_to_smem(source(block), slots.at[slot], ready.at[slot])

    for first in range(stages):
        pl.when(first < total)(functools.partial(fetch, first, first, False))

    @pl.loop(0, jnp.maximum(total - stages, 0))
    def _(j):
        fetch(j + stages, lax.rem(j, jnp.int32(stages)), True)


def _load_rows(ref, row_axis: int):
    """A vector of per-row values (LSE, delta, segment ids) laid out along axis ``row_axis`` of WGMMA tiles."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1 - row_axis))


def _split_refs(refs, st: _Static, inputs: int):
    """``(inputs, (q_seg, kv_seg) or None, sink stats or None, the rest)`` of a kernel's refs: ``inputs``
    fixed inputs, then the segment ids and the sink statistics where the call has them."""
    fixed, rest = refs[:inputs], refs[inputs:]
    segments = None
    if st.has_segments:
        segments, rest = rest[:2], rest[2:]
    sinks = None
    if st.has_sinks:
        sinks, rest = rest[0], rest[1:]
    return fixed, segments, sinks, rest


def _segment_scratch(own_rows: int, streamed_rows: int, stages: int):
    """Shared memory and barriers of the segment ids: the CTA's own rows (per warpgroup), loaded once, and
    the visited blocks' ids, streamed beside the other blocks."""
    wgs = COMPUTE_WARPGROUPS
    return (plgpu.SMEM((wgs, own_rows), jnp.int32), plgpu.SMEM((stages, streamed_rows), jnp.int32),
            plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages))


def _own_segments(segment_scratch, source, wg, row_axis: int):
    """Copy this warpgroup's own segment ids (``source``, a GMEM view) in and load them as a row vector."""
    own, _, own_ready, _, _ = segment_scratch
    plgpu.copy_gmem_to_smem(source, own.at[wg], own_ready.at[wg])
    plgpu.barrier_wait(own_ready.at[wg])
    return _load_rows(own.at[wg], row_axis)


def _segment_stream(segment_scratch, source):
    _, slots, _, ready, released = segment_scratch
    return source, slots, ready, released


# ---------------------------------------------------------------------------------------------------
# Forward: one CTA per (head, query mask block, batch)


def _forward_kernel(*refs, st):
    (q_ref, k_ref, v_ref, sched_ref), segment_refs, sink_ref, rest = _split_refs(refs, st, 4)
    out_ref, lse_ref, tiles, ready, released, turn, segment_scratch = rest
    batch, head, row = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
    wg = lax.axis_index("wg")
    qo_tiles, k_slots, v_slots, lse_tiles = tiles
    k_ready, v_ready, q_ready = ready
    k_released, v_released = released
    bq, bkv, dtype = ROWS_PER_WARPGROUP, st.kv_block, q_ref.dtype
    partial, total, key_block = _schedule(sched_ref, st, batch, head, row)

    def take_turn():  # the two compute warpgroups alternate on the tensor cores
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo = qo_tiles.at[wg]
        q_first = row * Q_BLOCK + wg * bq
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_first, bq), head], qo, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        # sinks: their max (base 2) and summed exponentials start every row's softmax
        m0, l0 = (sink_ref[head, 0], sink_ref[head, 1]) if st.has_sinks else (-jnp.inf, 0.0)
        m = plgpu.layout_cast(jnp.full((bq,), m0, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.full((bq,), l0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((bq, st.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        if st.has_segments:
            q_seg = _own_segments(segment_scratch, segment_refs[0].at[batch, pl.ds(q_first, bq)], wg, 0)

        @pl.when(total > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(take_turn)

        def visit(masked, j, carry):
            acc, m, l = carry
            slot = lax.rem(j, jnp.int32(st.stages))

            def logits(acc_ref):
                plgpu.wgmma(acc_ref, qo, k_slots.at[slot].transpose((1, 0)))
                take_turn()
                return acc_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_released.at[slot])
            s, _ = _base2_logits(s, st)
            segments = (q_seg, _visited_segments(segment_scratch, slot)) if st.has_segments else None
            if masked:
                s = _masked(s, st, 0, q_first + st.q_offset, key_block(j) * bkv, segments)
            m_new = jnp.maximum(m, s.max(axis=1))
            # a row with every logit masked so far keeps m = -inf; 0 in its place gives p = alpha = 0, no NaN
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            # the order of these barriers against the softmax matters for speed (as in JAX's FA3 example)
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours again

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_slots.at[slot])

                @pl.when(j + 1 < total)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, jnp.int32(st.stages))])

            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_released.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, partial, functools.partial(visit, True), (acc, m, l))
        acc, m, l = lax.fori_loop(partial, total, functools.partial(visit, False), carry)
        pl.when(wg == 0)(take_turn)

        has_mass = l > 0.0
        safe_l = jnp.where(has_mass, l, 1.0)
        qo[...] = (acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(dtype)  # zero rows stay zero
        m_finite = jnp.where(m == -jnp.inf, 0.0, m)
        lse = m_finite * math.log(2.0) + jnp.log(safe_l)  # natural log: m is in base 2
        lse_tiles.at[wg][...] = jnp.where(has_mass, lse, 0.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo, out_ref.at[batch, pl.ds(q_first, bq), head])
        plgpu.copy_smem_to_gmem(lse_tiles.at[wg], lse_ref.at[batch, head, pl.ds(q_first, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
        _stream_key_blocks(st, batch, head, key_block, total, ((k_ref, k_slots, k_ready, k_released),
                           (v_ref, v_slots, v_ready, v_released)), segment_refs, segment_scratch)


def _stream_key_blocks(st: _Static, batch, head, key_block, total, kv, segment_refs, segment_scratch):
    """The memory warpgroup of the forward and dQ kernels: K and V (``kv``: ``(ref, slots, ready, released)``
    each), and the keys' segment ids where the call has them, of every visited key block."""
    bkv, kv_head = st.kv_block, lax.div(head, jnp.int32(st.groups))
    streams = [(lambda b, ref=ref: ref.at[batch, pl.ds(b * bkv, bkv), kv_head], slots, ready, released)
               for ref, slots, ready, released in kv]
    if st.has_segments:
        kv_seg_ref = segment_refs[1]
        streams.append(_segment_stream(segment_scratch, lambda b: kv_seg_ref.at[batch, pl.ds(b * bkv, bkv)]))
    _stream(streams, key_block, total, st.stages)


def _visited_segments(segment_scratch, slot, rows=None):
    """The segment ids of the visited block in slot ``slot`` (its ``rows`` if given), laid out along axis 1 of
    the tiles (keys in the forward and dQ, queries in dK/dV). Waits for the slot (for the first ``rows``
    only) and releases it unless ``rows`` is given (the caller releases after its last half)."""
    _, slots, _, ready, released = segment_scratch
    view = slots.at[slot] if rows is None else slots.at[slot, rows]
    if rows is None or rows.start == 0:
        plgpu.barrier_wait(ready.at[slot])
    visited = _load_rows(view, 1)
    if rows is None:
        plgpu.barrier_arrive(released.at[slot])
    return visited


# ---------------------------------------------------------------------------------------------------
# Backward: dQ per (head, query mask block, batch) over the query schedule; dK/dV per (query head, key mask
# block, batch) over the transposed schedule (per query head: GQA sums the group's heads afterwards)


def _dq_kernel(*refs, st):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref), segment_refs, _, rest = _split_refs(refs, st, 7)
    dq_ref, tiles, ready, released, segment_scratch = rest
    batch, head, row = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
    wg = lax.axis_index("wg")
    q_tiles, do_tiles, k_slots, v_slots, stats = tiles
    k_ready, v_ready, own_ready = ready
    k_released, v_released = released
    bq, bkv, dtype = ROWS_PER_WARPGROUP, st.kv_block, q_ref.dtype
    partial, total, key_block = _schedule(sched_ref, st, batch, head, row)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_first = row * Q_BLOCK + wg * bq
        rows = pl.ds(q_first, bq)
        own = ((q_ref.at[batch, rows, head], q_tiles.at[wg]), (do_ref.at[batch, rows, head], do_tiles.at[wg]),
               (lse_ref.at[batch, head, rows], stats.at[wg, 0]), (delta_ref.at[batch, head, rows], stats.at[wg, 1]))
        for i, (source, tile) in enumerate(own):
            plgpu.copy_gmem_to_smem(source, tile, own_ready.at[wg * 4 + i])
        for i in range(4):
            plgpu.barrier_wait(own_ready.at[wg * 4 + i])
        lse = _load_rows(stats.at[wg, 0], 0) * LOG2E
        delta = _load_rows(stats.at[wg, 1], 0)
        dq = plgpu.layout_cast(jnp.zeros((bq, st.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        if st.has_segments:
            q_seg = _own_segments(segment_scratch, segment_refs[0].at[batch, rows], wg, 0)

        def visit(masked, j, dq):
            slot = lax.rem(j, jnp.int32(st.stages))
            plgpu.barrier_wait(k_ready.at[slot])

            def logits(acc_ref):
                plgpu.wgmma(acc_ref, q_tiles.at[wg], k_slots.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s, tanh = _base2_logits(pl.run_scoped(logits, plgpu.ACC((bq, bkv), jnp.float32)), st)
            segments = (q_seg, _visited_segments(segment_scratch, slot)) if st.has_segments else None
            if masked:
                s = _masked(s, st, 0, q_first + st.q_offset, key_block(j) * bkv, segments)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            plgpu.barrier_wait(v_ready.at[slot])

            def probability_grads(acc_ref):
                plgpu.wgmma(acc_ref, do_tiles.at[wg], v_slots.at[slot].transpose((1, 0)))
                return acc_ref[...]

            dp = pl.run_scoped(probability_grads, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(v_released.at[slot])
            ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds16 = ds.astype(dtype)

            def query_grads(acc_ref):
                plgpu.wgmma(acc_ref, ds16, k_slots.at[slot])

            dq = pl.run_state(query_grads)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_released.at[slot])
            return dq

        dq = lax.fori_loop(0, partial, functools.partial(visit, True), dq)
        dq = lax.fori_loop(partial, total, functools.partial(visit, False), dq)
        q_tiles.at[wg][...] = (dq * st.scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tiles.at[wg], dq_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
        _stream_key_blocks(st, batch, head, key_block, total, ((k_ref, k_slots, k_ready, k_released),
                           (v_ref, v_slots, v_ready, v_released)), segment_refs, segment_scratch)


def _dkv_kernel(*refs, st):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref), segment_refs, _, rest = _split_refs(refs, st, 7)
    dk_ref, dv_ref, tiles, ready, released, own_ready, segment_scratch = rest
    batch, head, col = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("cols")
    wg = lax.axis_index("wg")
    k_tiles, v_tiles, q_slots, do_slots, lse_slots, delta_slots = tiles
    bkv, dtype = ROWS_PER_WARPGROUP, q_ref.dtype  # 64 key rows per warpgroup; query halves of 64
    partial, total, query_block = _schedule(sched_ref, st, batch, head, col)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        kv_first = col * st.kv_block + wg * bkv
        rows = pl.ds(kv_first, bkv)
        kv_head = lax.div(head, jnp.int32(st.groups))
        plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_tiles.at[wg], own_ready.at[wg * 2])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_tiles.at[wg], own_ready.at[wg * 2 + 1])
        plgpu.barrier_wait(own_ready.at[wg * 2])
        plgpu.barrier_wait(own_ready.at[wg * 2 + 1])
        zeros = jnp.zeros((bkv, st.head_dim), jnp.float32)
        dk = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
        dv = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
        if st.has_segments:
            kv_seg = _own_segments(segment_scratch, segment_refs[1].at[batch, rows], wg, 0)

        def visit(masked, j, carry):
            dk, dv = carry
            slot = lax.rem(j, jnp.int32(st.stages))
            for barrier in ready:
                plgpu.barrier_wait(barrier.at[slot])
            for half in range(Q_BLOCK // ROWS_PER_WARPGROUP):  # 64 query rows at a time: 64 x 64 logit tiles
                half_rows = pl.ds(half * ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP)
                q_half, do_half = q_slots.at[slot, half_rows], do_slots.at[slot, half_rows]

                def logits(acc_ref, q_half=q_half):
                    plgpu.wgmma(acc_ref, k_tiles.at[wg], q_half.transpose((1, 0)))
                    return acc_ref[...]

                shape = (bkv, ROWS_PER_WARPGROUP)
                s, tanh = _base2_logits(pl.run_scoped(logits, plgpu.ACC(shape, jnp.float32)), st)
                segments = None
                if st.has_segments:
                    segments = (_visited_segments(segment_scratch, slot, half_rows), kv_seg)
                if masked:
                    q_first = query_block(j) * Q_BLOCK + half * ROWS_PER_WARPGROUP + st.q_offset
                    s = _masked(s, st, 1, q_first, kv_first, segments)
                lse = _load_rows(lse_slots.at[slot, half_rows], 1) * LOG2E
                p = jnp.exp2(s - lax.broadcast_in_dim(lse, shape, [1]))
                p16 = p.astype(dtype)

                def value_grads(refs, do_half=do_half, p16=p16):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p16, do_half)
                    plgpu.wgmma(dp_ref, v_tiles.at[wg], do_half.transpose((1, 0)))

                zero_tile = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                dv, dp = pl.run_state(value_grads)((plgpu.ACC.init(dv), plgpu.ACC.init(zero_tile)))
                delta = _load_rows(delta_slots.at[slot, half_rows], 1)
                ds = p * (dp - lax.broadcast_in_dim(delta, shape, [1]))
                if tanh is not None:
                    ds = ds * (1.0 - tanh * tanh)
                ds16 = ds.astype(dtype)

                def key_grads(acc_ref, q_half=q_half, ds16=ds16):
                    plgpu.wgmma(acc_ref, ds16, q_half)

                dk = pl.run_state(key_grads)(plgpu.ACC.init(dk))
            for barrier in released:
                plgpu.barrier_arrive(barrier.at[slot])
            if st.has_segments:
                plgpu.barrier_arrive(segment_scratch[4].at[slot])
            return dk, dv

        carry = lax.fori_loop(0, partial, functools.partial(visit, True), (dk, dv))
        dk, dv = lax.fori_loop(partial, total, functools.partial(visit, False), carry)
        k_tiles.at[wg][...] = (dk * st.scale).astype(dtype)
        v_tiles.at[wg][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tiles.at[wg], dk_ref.at[batch, rows, head])
        plgpu.copy_smem_to_gmem(v_tiles.at[wg], dv_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
        def rows(ref):
            return lambda b: ref.at[batch, pl.ds(b * Q_BLOCK, Q_BLOCK), head]

        def stats(ref):
            return lambda b: ref.at[batch, head, pl.ds(b * Q_BLOCK, Q_BLOCK)]

        sources = (rows(q_ref), rows(do_ref), stats(lse_ref), stats(delta_ref))
        streams = list(zip(sources, tiles[2:], ready, released))
        if st.has_segments:
            q_seg_ref = segment_refs[0]
            streams.append(_segment_stream(segment_scratch, lambda b: q_seg_ref.at[batch, pl.ds(b * Q_BLOCK, Q_BLOCK)]))
        _stream(streams, query_block, total, st.stages)


# ---------------------------------------------------------------------------------------------------
# Launch


def backward_refusal(call, *, check_device: bool = True) -> str | None:
    """Why the Mosaic GPU backward kernels cannot take ``call``, or None: :func:`refusal`'s reasons, and key
    mask blocks of 128 (two warpgroups of 64 key rows per CTA)."""
    problem = refusal(call, check_device=check_device)
    if problem is None and _blocks(call)[1] != Q_BLOCK:
        problem = f"key mask blocks of {_blocks(call)[1]} (the backward takes {Q_BLOCK})"
    return problem


def applied(tuning, call, *, interpret: bool):
    """``tuning`` (a ``GpuFlashTuning``) with its ``mosaic_*`` fields kept where these kernels can take ``call``
    here and turned off elsewhere (the Triton-lowered kernels run there, as for Triton's ``tma_forward``);
    ValueError naming ``mosaic_stages`` where the forward's slots would not fit in shared memory."""
    forward = tuning.mosaic_forward and not interpret and refusal(call) is None
    backward = tuning.mosaic_backward and not interpret and backward_refusal(call) is None
    if forward:
        need = shared_memory_bytes(call.query.shape[-1], _blocks(call)[1], tuning.mosaic_stages)
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(
                f"GpuFlashTuning.mosaic_stages={tuning.mosaic_stages}: {need} bytes of shared memory at head_dim "
                f"{call.query.shape[-1]} and key blocks of {_blocks(call)[1]} (at most {SHARED_MEMORY_BYTES})")
    if (forward, backward) == (tuning.mosaic_forward, tuning.mosaic_backward):
        return tuning
    return dataclasses.replace(tuning, mosaic_forward=forward, mosaic_backward=backward)


# The dispatcher's rank (``Implementation.priority_for``) of the Pallas GPU flash and block-sparse attention for
# the calls these kernels take end to end (forward and backward): above the Triton backend's 15, below
# ejkernel-cuda's native flash kernels' 18 (faster since 2026-11-27: 483-552 against 457-487 TFLOP/s
# forward+backward in one H200 run, `results/nvidia-h200-2026-11-27b-cuda-native.json`) and cuDNN's 20,
# which flash attention tries first. Measured on an H100, 2026-11-27, bf16, D=128, 16k tokens:
# flash attention forward 513-598 TFLOP/s against Triton's 439-559 and forward+backward 464-498 against
# 342-388 (causal 383-552 / 367-465 against 303-467 / 272-384); block-sparse at S=16k, 10 % of 128 x 128
# blocks: 0.520 / 2.022 ms against 0.652 / 2.588. Other calls keep the Pallas backend's 10: there the
# Triton-lowered kernels run, which measured slower than Triton's (flash 415-461 / 330-354 TFLOP/s).
MEASURED_PRIORITY = 17


def priority_for(call) -> int | None:
    """:data:`MEASURED_PRIORITY` where the Mosaic kernels take ``call`` here (forward and backward), else
    None (the registered priority)."""
    return MEASURED_PRIORITY if backward_refusal(call) is None else None


def with_mosaic(tuning, call, *, interpret: bool):
    """``tuning`` with the Mosaic kernels on wherever they can take ``call`` here (a Hopper GPU, not
    interpreted), off elsewhere."""
    return applied(dataclasses.replace(tuning, mosaic_forward=True, mosaic_backward=True), call, interpret=interpret)


def _static(q, k, segments, sink_stats, *, scale, causal, window, soft_cap, q_len, kv_len, kv_block, schedule_dims,
            stages) -> _Static:
    return _Static(scale=float(scale), causal=causal, window=window, soft_cap=soft_cap, q_offset=kv_len - q_len,
                   kv_len=kv_len, kv_block=kv_block, head_dim=q.shape[3], groups=q.shape[2] // k.shape[2],
                   schedule_dims=schedule_dims, stages=stages, has_segments=segments is not None,
                   has_sinks=sink_stats is not None)


def sink_statistics(sinks):
    """float32 ``[H, 2]``: per head the largest sink logit in base 2 and the sum of ``exp2(sink * log2(e) -
    that)`` (``sinks`` ``[H, n]``; padding entries -inf), the forward's starting softmax state."""
    base2 = sinks.astype(jnp.float32) * LOG2E
    top = jnp.max(base2, axis=1)
    return jnp.stack([top, jnp.sum(jnp.exp2(base2 - top[:, None]), axis=1)], axis=1)


def _optional(segments, sink_stats=None) -> tuple:
    return (*(segments or ()), *(() if sink_stats is None else (sink_stats,)))


def _tiles(shape, dtype):
    # 128-byte swizzled tiles: what wgmma reads from shared memory and TMA writes (64 16-bit values a row)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _launch(kernel, st: _Static, out_type, scratch, grid, grid_names):
    return plgpu.kernel(
        functools.partial(kernel, st=st),
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def forward(q, k, v, schedule, segments=None, sink_stats=None, **static):
    """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` of block-sparse attention on padded inputs: ``q``
    ``[B, Sq, H, D]`` with ``Sq`` a multiple of 128, ``k``/``v`` ``[B, Skv, Hkv, D]`` with ``Skv`` a multiple of
    ``kv_block``; ``schedule`` the int32 rows of ``gpu_flash_attention.gpu_schedule`` by query block.
    ``static``: ``scale``, ``causal``, ``window``, ``soft_cap``, ``q_len``/``kv_len`` (the unpadded lengths;
    queries end-aligned to the keys), ``kv_block``, ``schedule_dims`` (mask batch, mask heads), ``stages``.
    ``segments``: int32 ``(q_segment_ids [B, Sq], kv_segment_ids [B, Skv])`` or None; ``sink_stats``:
    :func:`sink_statistics` of the sinks or None."""
    _mosaic_gpu()
    st = _static(q, k, segments, sink_stats, **static)
    batch, sq, heads, head_dim = q.shape
    bq, wgs, stages = ROWS_PER_WARPGROUP, COMPUTE_WARPGROUPS, st.stages
    scratch = (
        (
            _tiles((wgs, bq, head_dim), q.dtype),
            _tiles((stages, st.kv_block, head_dim), k.dtype),
            _tiles((stages, st.kv_block, head_dim), v.dtype),
            plgpu.SMEM((wgs, bq), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=wgs)),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=wgs),
        _segment_scratch(bq, st.kv_block, stages) if segments is not None else (),
    )
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, sq), jnp.float32))
    return _launch(_forward_kernel, st, out_type, scratch, (heads, sq // Q_BLOCK, batch),
                   ("heads", "rows", "batch"))(q, k, v, schedule, *_optional(segments, sink_stats))


def backward(q, k, v, d_out, lse, delta, schedule_q, schedule_kv, segments=None, **static):
    """``(dq, dk, dv)`` of :func:`forward`'s call (same padded inputs and ``static``, which needs
    ``kv_block == 128``): ``lse`` its LSE, ``delta`` ``[B, H, Sq]`` the rows' ``<dO, O>``, ``schedule_q`` /
    ``schedule_kv`` the schedule rows by query block and by key block; ``segments`` as for the forward (sinks
    change no gradient here: theirs comes from the LSE)."""
    _mosaic_gpu()
    st = _static(q, k, segments, None, **static)
    batch, sq, heads, head_dim = q.shape
    skv = k.shape[1]
    bq, wgs, stages = ROWS_PER_WARPGROUP, COMPUTE_WARPGROUPS, st.stages
    own = plgpu.Barrier(num_barriers=wgs * 4)
    dq_scratch = (
        (
            _tiles((wgs, bq, head_dim), q.dtype),
            _tiles((wgs, bq, head_dim), q.dtype),
            _tiles((stages, st.kv_block, head_dim), k.dtype),
            _tiles((stages, st.kv_block, head_dim), v.dtype),
            plgpu.SMEM((wgs, 2, bq), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), own),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
        _segment_scratch(bq, st.kv_block, stages) if segments is not None else (),
    )
    dq = _launch(_dq_kernel, st, jax.ShapeDtypeStruct(q.shape, q.dtype), dq_scratch, (heads, sq // Q_BLOCK, batch),
                 ("heads", "rows", "batch"))(q, k, v, d_out, lse, delta, schedule_q, *_optional(segments))
    dkv_scratch = (
        (
            _tiles((wgs, bq, head_dim), k.dtype),
            _tiles((wgs, bq, head_dim), v.dtype),
            _tiles((stages, Q_BLOCK, head_dim), q.dtype),
            _tiles((stages, Q_BLOCK, head_dim), d_out.dtype),
            plgpu.SMEM((stages, Q_BLOCK), jnp.float32),
            plgpu.SMEM((stages, Q_BLOCK), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=stages),) * 4,
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 4,
        plgpu.Barrier(num_barriers=wgs * 2),
        _segment_scratch(bq, Q_BLOCK, stages) if segments is not None else (),
    )
    per_head = jax.ShapeDtypeStruct((batch, skv, heads, head_dim), k.dtype)
    dk, dv = _launch(_dkv_kernel, st, (per_head, per_head), dkv_scratch, (heads, skv // st.kv_block, batch),
                     ("heads", "cols", "batch"))(q, k, v, d_out, lse, delta, schedule_kv, *_optional(segments))
    if st.groups > 1:  # each query head's share, summed over its kv head's group in float32
        grouped = (batch, skv, k.shape[2], st.groups, head_dim)
        dk = dk.reshape(grouped).astype(jnp.float32).sum(axis=3).astype(k.dtype)
        dv = dv.reshape(grouped).astype(jnp.float32).sum(axis=3).astype(v.dtype)
    return dq, dk, dv
