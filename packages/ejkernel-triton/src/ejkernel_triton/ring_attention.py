"""``ring_attention`` on the GPU through the Triton flash-attention kernels.

The shared ring schedule (``ejkernel.modules.operations._ring_schedule``: the next key/value shard's
``ppermute`` issued before each step's kernel, float32 log-sum-exp merges, the zig-zag layout's balanced
causal steps) runs :class:`TritonRingBlocks`: the flash forward returning output and log-sum-exp and the
flash backward taking the ring's final output and log-sum-exp (``flash_attention.vjp``'s kernel calls, with
their vmap rules), on the local shards as they are: GQA keeps its kv heads through the ring. Non-causal
whole blocks of bf16/fp16 with head dim 128 take the TMA forward on Hopper.

Refused (``UnsupportedFeature``; the XLA ring takes them): sliding windows, attention sinks, causal calls
whose local query and key lengths differ, head dims outside flash attention's range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations import _ring_schedule
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.ring_attention import RingAttentionCall
from ejkernel_triton.flash_attention import tuning
from ejkernel_triton.flash_attention.common import LOG2E, StaticParams
from ejkernel_triton.flash_attention.tuning import MAX_HEAD_DIM, TritonFlashConfig
from ejkernel_triton.flash_attention.vjp import kernel_calls
from ejkernel_triton.interpret import interpreting
from ejkernel_triton.launch import gpu_device_kind


@dataclasses.dataclass(frozen=True)
class TritonRingBlocks:
    """The ring schedule's local blocks (``_ring_schedule.RingBlocks``) on the Triton flash kernels. The
    kernels' log-sum-exp is in log2 units with +inf for a row that sees nothing; the schedule's is natural
    with -inf: converted both ways here."""

    config: TritonFlashConfig
    softmax_scale: float
    softcap: float  # 0.0: none
    interpret: bool

    def _static(self, q, k, v, q_seg, causal: bool) -> StaticParams:
        tma = tuning.tma_forward_takes(q.dtype, q.shape[-1], v.shape[-1], masked=causal or q_seg is not None)
        return StaticParams(softmax_scale=self.softmax_scale, causal=causal, window_left=-1, window_right=-1,
                            softcap=self.softcap, config=self.config, interpret=self.interpret,
                            tma_forward=tma and self.config.fits_tma_forward(q.shape[1], k.shape[1]))

    def forward(self, q, k, v, q_seg, kv_seg, causal):
        fwd, _ = kernel_calls(self._static(q, k, v, q_seg, causal))
        out, lse = fwd(q, k, v, q_seg, kv_seg, None, None, None, None)
        return out, jnp.where(lse == jnp.inf, -jnp.inf, lse / LOG2E)

    def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, causal):
        _, bwd = kernel_calls(self._static(q, k, v, q_seg, causal))
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
        dq, dk, dv, _ = bwd(q, k, v, d_out.astype(q.dtype), lse, out.astype(q.dtype), q_seg, kv_seg, None, None,
                            None)
        return dq, dk, dv


class TritonRingAttention(Implementation[RingAttentionCall, TritonFlashConfig]):
    """Ring attention whose every step is a Triton flash-attention kernel (see the module docstring); its
    config is flash attention's (:class:`TritonFlashConfig`), used for every step."""

    config_type = TritonFlashConfig

    def supports(self, call: RingAttentionCall) -> None:
        if call.sliding_window is not None:
            raise UnsupportedFeature("triton ring_attention: sliding_window (the XLA ring takes it)")
        if call.softmax_aux is not None:
            raise UnsupportedFeature("triton ring_attention: softmax_aux (sinks; the XLA ring takes them)")
        if call.causal and call.query.shape[1] != call.key.shape[1]:
            raise UnsupportedFeature(f"triton ring_attention: causal with local query length {call.query.shape[1]} "
                                     f"!= key length {call.key.shape[1]} (the XLA ring takes it)")
        d, dv = call.query.shape[-1], call.value.shape[-1]
        if not (8 <= d <= MAX_HEAD_DIM and 8 <= dv <= MAX_HEAD_DIM):
            raise UnsupportedFeature(f"triton ring_attention: head dims {d}/{dv} outside [8, {MAX_HEAD_DIM}]")

    def heuristic_config(self, call: RingAttentionCall) -> TritonFlashConfig:
        q, v = call.query, call.value
        tma = tuning.tma_forward_takes(q.dtype, q.shape[-1], v.shape[-1], masked=call.q_segment_ids is not None)
        return tuning.heuristic_config(q.shape[-1], v.shape[-1], q.dtype, device_kind=gpu_device_kind(),
                                       causal=call.causal, tma=tma and not call.causal)

    def candidate_configs(self, call: RingAttentionCall) -> Sequence[TritonFlashConfig]:
        if tuning.shipped_entries(gpu_device_kind()):
            return ()  # tuned for this device kind: the heuristic reads the shipped table
        return tuning.config_space(call.query.shape[-1], call.value.shape[-1], call.query.dtype)

    def __call__(self, call: RingAttentionCall, config: TritonFlashConfig):
        blocks = TritonRingBlocks(config=config, softmax_scale=call.softmax_scale,
                                  softcap=call.logits_soft_cap or 0.0, interpret=interpreting())
        return _ring_schedule.ring_attention(blocks, call)


IMPLEMENTATION = TritonRingAttention()
