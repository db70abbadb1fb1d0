"""Block-sparse attention for NVIDIA GPUs in Pallas (Triton lowering), forward and backward.

The kernels are those of :mod:`ejkernel_pallas.gpu_flash_attention` (one program per query block for the
forward and dQ, per key block and query head for dK/dV; the same logits, masks, online softmax, sinks,
soft cap, GQA), with their block loop driven by the shared schedules
(``ejkernel.ops.utils.block_sparse.block_schedule``) instead of the causal/window ranges: each program reads
its row of the schedule (``gpu_flash_attention.gpu_schedule``: partial visits first, then full ones) and loops
over exactly the blocks the mask leaves non-empty, in two plain loops: the masked body over the partial blocks,
the mask-free body over the others. Time is therefore
proportional to the kept blocks.

Mask blocks must be powers of two >= 16 (Triton blocks; others are refused with ``UnsupportedFeature``, the
XLA or Triton backends take them). The config is the GPU flash kernels' ``GpuFlashTuning``: its blocks
(capped at, and dividing, the mask blocks) are the kernel tiles, so a 128 x 128 mask block runs as the
forward's 128 x 64 and the backward's 64 x 64 tiles of the flash sweep, each visit walking the kernel
blocks of its mask block. Float32 precision as in the GPU flash kernels (IEEE dots unless the
call asks for ``"default"``).

On a Hopper GPU the forward and the backward run the Mosaic GPU kernels of
:mod:`ejkernel_pallas.mosaic_attention` instead (TMA, wgmma, warp specialization;
``GpuFlashTuning.mosaic_forward`` / ``mosaic_backward``, which the heuristic sets wherever they can take the
call); either kind of forward feeds either kind of backward.

Dispatcher ranking on the GPU: where the Mosaic kernels take a call forward and backward, ``priority_for``
ranks this implementation above the Triton backend's (16 against 15; measured faster on an H100); elsewhere
the Triton backend's kernel comes first (Pallas' 10), since the Triton-lowered kernels here measured slower
(``scripts/device/blocksparse_pallas.sh``, packages/ejkernel-pallas/NOTES.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttentionCall
from ejkernel.ops.utils.block_sparse import block_schedule
from ejkernel.ops.utils.padding import pad_axis

from ejkernel_pallas.call_fields import attention_fields
from ejkernel_pallas import mosaic_attention as mosaic
from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning, gpu_schedule
from ejkernel_pallas.gpu_flash_attention.implementation import _float32_precision
from ejkernel_pallas.gpu_flash_attention.kernels import _Static
from ejkernel_pallas.gpu_flash_attention.launch import _attention
from ejkernel_pallas.gpu_flash_attention.tuning import _SWEEP
from ejkernel_pallas.interpret import gpu_interpret_or_refuse, interpret_mode


def kernel_blocks(tuning: GpuFlashTuning, call: BlockSparseAttentionCall) -> GpuFlashTuning:
    """``tuning`` with every block capped at the call's mask block (both powers of two, so the kernel block
    then divides the mask block)."""
    bq, bkv = call.q_block_size, call.kv_block_size
    return dataclasses.replace(
        tuning, fwd_q=min(tuning.fwd_q, bq), fwd_kv=min(tuning.fwd_kv, bkv), dkv_q=min(tuning.dkv_q, bq),
        dkv_kv=min(tuning.dkv_kv, bkv), dq_q=min(tuning.dq_q, bq), dq_kv=min(tuning.dq_kv, bkv),
    )


def check_tuning(tuning: GpuFlashTuning, call: BlockSparseAttentionCall) -> None:
    """Kernel blocks must divide the mask blocks (a ValueError names the config field)."""
    for field, mask_block in (("fwd_q", call.q_block_size), ("fwd_kv", call.kv_block_size),
                              ("dkv_q", call.q_block_size), ("dkv_kv", call.kv_block_size),
                              ("dq_q", call.q_block_size), ("dq_kv", call.kv_block_size)):
        value = getattr(tuning, field)
        if mask_block % value:
            raise ValueError(
                f"GpuFlashTuning.{field}={value}: block-sparse kernel blocks must divide the mask block "
                f"({mask_block}); each mask block is walked in kernel blocks"
            )


WIDE_FORWARD = GpuFlashTuning(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3)
"""Forward 128 x 128 tiles (8 warps, 3 stages) for mask blocks of >= 128 on both sides: one tile per 128-block
visit, half the loop iterations of 128 x 64. H200, S=16k, 10 %, 128-blocks (batch 2, 2026-11-23): 0.773 ms
against 0.811 ms for the flash defaults (128 x 64, 4 warps, 2 stages)."""


def heuristic_tuning(call: BlockSparseAttentionCall, *, interpret: bool = False) -> GpuFlashTuning:
    """The GPU flash kernels' H200 defaults (forward 128 x 64, backward 64 x 64), capped at the mask blocks;
    forward :data:`WIDE_FORWARD` where both mask blocks hold 128; the Mosaic GPU forward wherever it can take
    the call (a Hopper GPU, not interpreted)."""
    wide = call.q_block_size >= 128 and call.kv_block_size >= 128
    tuning = kernel_blocks(WIDE_FORWARD if wide else GpuFlashTuning(), call)
    return mosaic.with_mosaic(tuning, call, interpret=interpret)


def candidate_tunings(call: BlockSparseAttentionCall, *, interpret: bool = False) -> list[GpuFlashTuning]:
    """The GPU flash sweep's near-best tilings, capped at the mask blocks, each also with the Mosaic kernels
    where they can take the call."""
    tilings = [kernel_blocks(t, call) for t in _SWEEP]
    return list(dict.fromkeys(tilings + [mosaic.with_mosaic(t, call, interpret=interpret) for t in tilings]))


def refusal(call: BlockSparseAttentionCall) -> str | None:
    """Why these kernels cannot take the call, or None."""
    for name, size in (("q_block_size", call.q_block_size), ("kv_block_size", call.kv_block_size)):
        if size < 16 or size & (size - 1):
            return f"{name}={size}: Triton blocks are powers of two >= 16 (the kernel blocks are the mask's)"
    head_dims = (call.query.shape[-1], call.value.shape[-1])
    if max(head_dims) > 256:
        return f"head_dim > 256 (query, value: {head_dims})"
    return None


def _run(call: BlockSparseAttentionCall, schedules: tuple, tuning: GpuFlashTuning, interpret: bool):
    query, key, value = call.query, call.key, call.value
    batch, sq, heads, d = query.shape
    skv, kv_heads, dv = key.shape[1], key.shape[2], value.shape[3]
    mask_batch, mask_heads, q_blocks, kv_blocks = call.block_mask.shape
    bq, bkv = call.q_block_size, call.kv_block_size
    sq_pad, skv_pad = q_blocks * bq, kv_blocks * bkv
    d_pad, dv_pad = max(16, pl.next_power_of_2(d)), max(16, pl.next_power_of_2(dv))
    width = pl.next_power_of_2(2 + max(s.indices.shape[3] for s in schedules))
    arrays = {
        "q": pad_axis(pad_axis(query, 1, sq_pad), 3, d_pad),
        "k": pad_axis(pad_axis(key, 1, skv_pad), 3, d_pad),
        "v": pad_axis(pad_axis(value, 1, skv_pad), 3, dv_pad),
        "sched_q": gpu_schedule(schedules[0], width),
        "sched_kv": gpu_schedule(schedules[1], width),
    }
    if call.q_segment_ids is not None:
        arrays["q_seg"] = pad_axis(call.q_segment_ids, 1, sq_pad)
        arrays["kv_seg"] = pad_axis(call.kv_segment_ids, 1, skv_pad)
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = max(16, pl.next_power_of_2(sinks.shape[1]))
        arrays["sinks"] = pad_axis(sinks, 1, num_sinks, value=-jnp.inf)
    st = _Static(
        **attention_fields(call, sq=sq, skv=skv, groups=heads // kv_heads), varlen=False,
        has_segments=call.q_segment_ids is not None, num_sinks=num_sinks, tuning=tuning, interpret=interpret,
        precision=_float32_precision(call),
        schedule_dims=(mask_batch, mask_heads), schedule_width=width, mask_blocks=(bq, bkv),
        mosaic_stages=tuning.mosaic_stages if tuning.mosaic_forward else 0,
        mosaic_backward=tuning.mosaic_backward,
    )
    out = _attention(st, arrays)
    return out[:, :sq, :, :dv]


_run_jit = jax.jit(_run, static_argnames=("tuning", "interpret"))


def blocksparse_attention(call: BlockSparseAttentionCall, tuning: GpuFlashTuning, *, interpret: bool = False):
    """GPU block-sparse attention of a validated call with ``tuning`` (kernel blocks dividing the mask
    blocks; ``interpret=True``: Pallas' interpreter on CPU). The schedules are built before the jitted
    program (numpy for a concrete mask)."""
    check_tuning(tuning, call)
    tuning = mosaic.applied(tuning, call, interpret=interpret)
    schedules = tuple(block_schedule(call, by=by, order="partial_first") for by in ("q", "kv"))
    return _run_jit(call, schedules, tuning=tuning, interpret=interpret)


class GpuBlockSparseAttention(Implementation[BlockSparseAttentionCall, GpuFlashTuning]):
    """The Triton-lowered Pallas kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = GpuFlashTuning

    def supports(self, call: BlockSparseAttentionCall) -> None:
        gpu_interpret_or_refuse()
        problem = refusal(call)
        if problem is not None:
            raise UnsupportedFeature(f"pallas GPU blocksparse_attention: {problem}")

    def priority_for(self, call: BlockSparseAttentionCall) -> int | None:
        return mosaic.priority_for(call)

    def heuristic_config(self, call: BlockSparseAttentionCall) -> GpuFlashTuning:
        return heuristic_tuning(call, interpret=interpret_mode() is not None)

    def candidate_configs(self, call: BlockSparseAttentionCall) -> list[GpuFlashTuning]:
        return candidate_tunings(call, interpret=interpret_mode() is not None)

    def __call__(self, call: BlockSparseAttentionCall, config: GpuFlashTuning) -> jax.Array:
        return blocksparse_attention(call, config, interpret=gpu_interpret_or_refuse())


IMPLEMENTATION = GpuBlockSparseAttention()
