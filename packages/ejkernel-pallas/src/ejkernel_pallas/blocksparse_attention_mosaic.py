"""Block-sparse attention forward on Mosaic GPU (Hopper: TMA copies, wgmma, warp specialization).

The Triton-lowered forward of :mod:`ejkernel_pallas.blocksparse_attention_gpu` cannot overlap the softmax of
one tile with the tensor-core work of another, and its kept-block efficiency stays near half of dense flash
attention's at 10 % density. This kernel keeps the schedule (the same rows: partial visits, full visits,
their key blocks) and runs each query mask block of 128 rows as one CTA of three warpgroups:

- a memory warpgroup (few registers) walks the row's key blocks and TMA-copies K and V into a ring of
  ``stages`` shared-memory slots, refilling a slot once both consumers released it;
- two compute warpgroups, 64 query rows each, run ``S = Q K^T`` and ``O += P V`` on wgmma with the online
  softmax in registers, taking turns on the tensor cores (one warpgroup's softmax overlaps the other's
  matmuls) through a shared barrier. Both read the same schedule row, so they visit the same blocks.

Partial visits (a causal or window boundary, or a ragged tail, crosses the block) run the masked body, full
ones the mask-free body: two loops, as in the Triton forward. Output and log-sum-exp are those of the GPU
flash forward (natural-log LSE, ``0`` and a zero row where a row sees no key), so the Triton-lowered
backward kernels take them unchanged.

Served: bf16/fp16, head_dim 64 or 128 (query and value alike), query mask blocks of 128 rows, key mask
blocks of 64 or 128, causal, sliding window, soft cap, GQA/MQA. Everything else (segment ids, sinks, float32,
other blocks or head dims, a GPU before Hopper) is :func:`refusal`'s reason and runs the Triton-lowered
forward instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

plgpu = None  # jax.experimental.pallas.mosaic_gpu, imported on first use (~0.9 s: not at plugin import)

LOG2E = math.log2(math.e)
ROWS_PER_WARPGROUP = 64  # wgmma's M per warpgroup
COMPUTE_WARPGROUPS = 2
Q_BLOCK = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS  # the query mask block one CTA serves
SHARED_MEMORY_BYTES = 227 * 1024  # per CTA on sm_90


def shared_memory_bytes(head_dim: int, kv_block: int, stages: int) -> int:
    """The kernel's shared memory: Q/O tiles of both compute warpgroups, ``stages`` K and V slots (16-bit),
    the LSE rows, and 4 KiB for barriers and alignment (3 slots at head_dim 128 and key blocks of 128 come to
    229,888 bytes by the first three and took 232,568 on an H100, 2026-11-27: over the limit)."""
    return 2 * (Q_BLOCK * head_dim + 2 * stages * kv_block * head_dim) + 4 * Q_BLOCK + 4096
HEAD_DIMS = (64, 128)
KV_BLOCKS = (64, 128)


def _mosaic_gpu():
    global plgpu
    if plgpu is None:
        from jax.experimental.pallas import mosaic_gpu

        plgpu = mosaic_gpu
    return plgpu


def hopper_gpu() -> bool:
    """True where the default backend is a GPU of compute capability 9.x (wgmma and TMA as used here)."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return False
    capability = getattr(devices[0], "compute_capability", "") if devices else ""
    return str(capability).startswith("9")


def refusal(call, *, check_device: bool = True) -> str | None:
    """Why the Mosaic GPU forward cannot take ``call`` (a ``BlockSparseAttentionCall``), or None."""
    try:
        _mosaic_gpu()
    except ImportError as error:  # the Mosaic GPU dialect ships with jaxlib's CUDA support
        return f"jax.experimental.pallas.mosaic_gpu is not importable ({error})"
    query, value = call.query, call.value
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {query.dtype} (bf16 or fp16)"
    if query.shape[-1] not in HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return f"head dims (query {query.shape[-1]}, value {value.shape[-1]}): equal, one of {HEAD_DIMS}"
    if call.q_block_size != Q_BLOCK or call.kv_block_size not in KV_BLOCKS:
        return f"mask blocks ({call.q_block_size}, {call.kv_block_size}): ({Q_BLOCK}, one of {KV_BLOCKS})"
    if call.q_segment_ids is not None or call.softmax_aux is not None:
        return "segment ids and sinks run in the Triton-lowered forward"
    if check_device and not hopper_gpu():
        return "needs a Hopper GPU (sm_90a: wgmma, TMA)"
    return None


def _forward_kernel(q_ref, k_ref, v_ref, sched_ref, out_ref, lse_ref, tiles, ready, released, turn, *, st):
    batch, head, row = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
    wg = lax.axis_index("wg")
    qo_tiles, k_slots, v_slots, lse_tiles = tiles
    k_ready, v_ready, q_ready = ready
    k_released, v_released = released
    bq, bkv, dtype = ROWS_PER_WARPGROUP, st["kv_block"], q_ref.dtype
    mask_batch, mask_heads = st["schedule_dims"]
    schedule_row = (batch if mask_batch > 1 else 0, head if mask_heads > 1 else 0, row)
    partial = sched_ref[(*schedule_row, 0)]
    total = partial + sched_ref[(*schedule_row, 1)]

    def key_block(visit):
        return sched_ref[(*schedule_row, 2 + visit)]

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
        m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((bq, st["head_dim"]), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(total > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(take_turn)

        def visit(masked, j, carry):
            acc, m, l = carry
            slot = lax.rem(j, jnp.int32(st["stages"]))

            def logits(acc_ref):
                plgpu.wgmma(acc_ref, qo, k_slots.at[slot].transpose((1, 0)))
                take_turn()
                return acc_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_released.at[slot])
            if st["soft_cap"] is not None:  # logits in base 2 after the cap
                cap = st["soft_cap"]
                s = jnp.tanh(s * (st["scale"] / cap)) * (cap * LOG2E)
            else:
                s = s * (st["scale"] * LOG2E)
            if masked:
                shape = (bq, bkv)
                q_pos = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + (
                    q_first + st["q_offset"])
                kv_pos = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + key_block(j) * bkv
                keep = kv_pos < st["kv_len"]
                if st["causal"]:
                    keep &= kv_pos <= q_pos
                if st["window"] is not None:
                    left, right = st["window"]
                    keep &= (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)
                s = jnp.where(keep, s, -jnp.inf)
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
                    plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, jnp.int32(st["stages"]))])

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
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(st["groups"]))

        def fetch(j, slot):
            cols = pl.ds(key_block(j) * bkv, bkv)
            plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], k_slots.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], v_slots.at[slot], v_ready.at[slot])

        stages = st["stages"]
        for first in range(stages):
            pl.when(first < total)(functools.partial(fetch, first, first))

        @pl.loop(0, jnp.maximum(total - stages, 0))
        def _(j):
            slot = lax.rem(j, jnp.int32(st["stages"]))
            cols = pl.ds(key_block(j + stages) * bkv, bkv)
            plgpu.barrier_wait(k_released.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[batch, cols, kv_head], k_slots.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_released.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, cols, kv_head], v_slots.at[slot], v_ready.at[slot])


def forward(q, k, v, schedule, *, scale: float, causal: bool, window, soft_cap, q_len: int, kv_len: int,
            kv_block: int, schedule_dims: tuple[int, int], stages: int = 2):
    """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` of block-sparse attention on padded inputs: ``q``
    ``[B, Sq, H, D]`` with ``Sq`` a multiple of 128, ``k``/``v`` ``[B, Skv, Hkv, D]`` with ``Skv`` a multiple of
    ``kv_block``; ``schedule`` the int32 rows of ``blocksparse_attention_gpu.gpu_schedule`` by query block;
    ``q_len``/``kv_len`` the unpadded lengths (queries end-aligned to the keys)."""
    plgpu = _mosaic_gpu()
    batch, sq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    st = dict(scale=float(scale), causal=causal, window=window, soft_cap=soft_cap, q_offset=kv_len - q_len,
              kv_len=kv_len, kv_block=kv_block, head_dim=head_dim, groups=heads // kv_heads,
              schedule_dims=schedule_dims, stages=stages)
    # 128-byte swizzled tiles: what wgmma reads from shared memory and TMA writes (64 bf16 per swizzled row)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        (
            plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, kv_block, head_dim), k.dtype, transforms=transforms),
            plgpu.SMEM((stages, kv_block, head_dim), v.dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WARPGROUPS, ROWS_PER_WARPGROUP), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),
        ),
        (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
    )
    kernel = plgpu.kernel(
        functools.partial(_forward_kernel, st=st),
        out_type=(
            jax.ShapeDtypeStruct((batch, sq, heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(heads, sq // Q_BLOCK, batch),
        grid_names=("heads", "rows", "batch"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return kernel(q, k, v, schedule)
