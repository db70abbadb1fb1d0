"""The registered implementation: a validated FlashAttentionCall padded, described (``_Static``) and run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel.ops.utils import dropout as dropout_hash
from ejkernel.ops.utils.block_sparse import schedule_blocks
from ejkernel.ops.utils.padding import pad_axis, round_up
from ejkernel.ops.utils.varlen import packed_keys, packed_queries

from ejkernel_pallas.call_fields import attention_fields
from ejkernel_pallas import mosaic_attention
from ejkernel_pallas.gpu_flash_attention.kernels import _Static, gpu_schedule
from ejkernel_pallas.gpu_flash_attention.launch import _attention
from ejkernel_pallas.gpu_flash_attention.tuning import GpuFlashTuning, candidate_tunings, heuristic_tuning
from ejkernel_pallas.interpret import gpu_interpret_or_refuse, interpret_mode

MOSAIC_BLOCK = 128  # the Mosaic GPU kernels' blocks when they run dense attention


# ---------------------------------------------------------------------------------------------------
# The implementation: a validated FlashAttentionCall (ejkernel.modules.operations.flash_attention)


def _float32_precision(call: FlashAttentionCall):
    """The precision of a float32 call's dots (see the module docstring); None for 16-bit inputs."""
    if call.query.dtype != jnp.float32:
        return None
    return lax.Precision.DEFAULT if call.precision == lax.Precision.DEFAULT else lax.Precision.HIGHEST


def _flash(call: FlashAttentionCall, tuning: GpuFlashTuning, interpret: bool) -> jax.Array:
    query, key, value = call.query, call.key, call.value
    batch, sq, heads, d = query.shape
    skv, kv_heads, dv = key.shape[1], key.shape[2], value.shape[3]
    mosaic = tuning.mosaic_forward or tuning.mosaic_backward  # run as every block of MOSAIC_BLOCK x MOSAIC_BLOCK
    floor = MOSAIC_BLOCK if mosaic else 16
    sq_pad = round_up(sq, max(tuning.fwd_q, tuning.dkv_q, tuning.dq_q, floor))
    skv_pad = round_up(skv, max(tuning.fwd_kv, tuning.dkv_kv, tuning.dq_kv, floor))
    d_pad, dv_pad = max(16, pl.next_power_of_2(d)), max(16, pl.next_power_of_2(dv))
    arrays = {
        "q": pad_axis(pad_axis(query, 1, sq_pad), 3, d_pad),
        "k": pad_axis(pad_axis(key, 1, skv_pad), 3, d_pad),
        "v": pad_axis(pad_axis(value, 1, skv_pad), 3, dv_pad),
    }
    varlen = call.cum_seqlens_q is not None
    if varlen:
        q_seq, q_pos, q_exists = packed_queries(call.cum_seqlens_q, call.cum_seqlens_k, sq_pad)
        kv_seq, kv_pos, kv_exists = packed_keys(call.cum_seqlens_k, skv_pad)
        # tokens past the packed ends are in no sequence (and distinct ones on the two sides)
        arrays.update(q_pos=q_pos[None], kv_pos=kv_pos[None], q_seg=jnp.where(q_exists, q_seq, -1)[None],
                      kv_seg=jnp.where(kv_exists, kv_seq, -2)[None])
    elif call.q_segment_ids is not None:
        arrays["q_seg"] = pad_axis(call.q_segment_ids, 1, sq_pad)
        arrays["kv_seg"] = pad_axis(call.kv_segment_ids, 1, skv_pad)
    if call.dropout_prob > 0.0:  # int32 in the kernel: the seed's 32 bits, reinterpreted
        arrays["seed"] = lax.bitcast_convert_type(dropout_hash.seed_bits(call.dropout_seed), jnp.int32).reshape(1)
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = max(16, pl.next_power_of_2(sinks.shape[1]))
        arrays["sinks"] = pad_axis(sinks, 1, num_sinks, value=-jnp.inf)
    schedule = {}
    if mosaic:  # the dense block schedules (built with numpy at trace time): the kernels' loops walk them
        rows = [schedule_blocks(None, sq, skv, MOSAIC_BLOCK, MOSAIC_BLOCK, causal=call.causal,
                                sliding_window=call.sliding_window, segments="q_seg" in arrays,
                                by=by, order="partial_first") for by in ("q", "kv")]
        width = pl.next_power_of_2(2 + max(r.indices.shape[3] for r in rows))
        arrays.update(sched_q=gpu_schedule(rows[0], width), sched_kv=gpu_schedule(rows[1], width))
        schedule = dict(schedule_dims=(1, 1), schedule_width=width, mask_blocks=(MOSAIC_BLOCK, MOSAIC_BLOCK),
                        mosaic_stages=tuning.mosaic_stages if tuning.mosaic_forward else 0,
                        mosaic_backward=tuning.mosaic_backward)
    st = _Static(
        **attention_fields(call, sq=sq, skv=skv, groups=heads // kv_heads),
        varlen=varlen,
        has_segments=varlen or call.q_segment_ids is not None,
        num_sinks=num_sinks,
        tuning=tuning,
        interpret=interpret,
        dropout_prob=call.dropout_prob,
        precision=_float32_precision(call),
        **schedule,
    )
    out = _attention(st, arrays)
    return out[:, :sq, :, :dv]


_flash_jit = jax.jit(_flash, static_argnames=("tuning", "interpret"))


def flash_attention(call: FlashAttentionCall, tuning: GpuFlashTuning, *, interpret: bool = False) -> jax.Array:
    """GPU flash attention of a validated call with ``tuning`` (Triton-lowered kernels, or the Mosaic GPU ones
    its ``mosaic_*`` fields ask for); ``interpret=True`` runs Pallas' interpreter (CPU). One compiled program
    per shapes and static fields (an eager call compiles once); under a caller's ``jit`` it is inlined."""
    tuning = mosaic_attention.applied(tuning, call, interpret=interpret)
    if call.dropout_seed is not None:  # an int seed becomes an argument: a new seed does not recompile
        call = dataclasses.replace(call, dropout_seed=dropout_hash.seed_bits(call.dropout_seed))
    return _flash_jit(call, tuning=tuning, interpret=interpret)


class GpuFlashAttention(Implementation[FlashAttentionCall, GpuFlashTuning]):
    """The Triton-lowered Pallas kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = GpuFlashTuning

    def supports(self, call: FlashAttentionCall) -> None:
        gpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead
        head_dims = (call.query.shape[-1], call.value.shape[-1])
        for refused, what in (
            (call.bias is not None, "bias"),
            (call.attention_mask is not None, "attention_mask"),
            (call.cum_seqlens_q is not None and call.q_segment_ids is not None,
             "segment ids together with cum_seqlens"),
            (max(head_dims) > 256, f"head_dim > 256 (query, value: {head_dims})"),
        ):
            if refused:
                raise UnsupportedFeature(
                    f"pallas GPU flash_attention: {what} is not implemented (platform='xla' takes it)"
                )

    def priority_for(self, call: FlashAttentionCall) -> int | None:
        return mosaic_attention.priority_for(call)

    def heuristic_config(self, call: FlashAttentionCall) -> GpuFlashTuning:
        """The H200 tiles fitted to the call; the Mosaic GPU kernels wherever they can take it (Hopper)."""
        tuning = heuristic_tuning(call.query.shape[1], call.key.shape[1])
        return mosaic_attention.with_mosaic(tuning, call, interpret=interpret_mode() is not None)

    def candidate_configs(self, call: FlashAttentionCall) -> list[GpuFlashTuning]:
        tilings = candidate_tunings(call.query.shape[1], call.key.shape[1])
        mosaic = mosaic_attention.with_mosaic(tilings[0], call, interpret=interpret_mode() is not None)
        return [mosaic, *tilings] if mosaic != tilings[0] else tilings

    def __call__(self, call: FlashAttentionCall, config: GpuFlashTuning) -> jax.Array:
        return flash_attention(call, config, interpret=gpu_interpret_or_refuse())


IMPLEMENTATION = GpuFlashAttention()
