"""``ring_attention`` on GPUs through cuDNN's flash attention (:mod:`ejkernel_cuda.cudnn_attention`).

The shared ring schedule (``ejkernel.modules.operations._ring_schedule``: the next key/value shard's
``ppermute`` issued before each step's kernel, float32 log-sum-exp merges, the zig-zag layout's balanced
causal steps) runs :class:`CudnnRingBlocks`, whose forward returns cuDNN's output and log-sum-exp and whose
backward is cuDNN's, given the ring's final output and log-sum-exp. GQA keeps its kv heads through the ring.

Refused (``UnsupportedFeature``; the Triton or XLA ring takes them): what cuDNN's flash attention refuses
(:func:`cudnn_attention.check_supported`), and sliding windows, segment ids, sinks and soft caps, which the
ring's cuDNN blocks do not carry.
"""

from __future__ import annotations

import dataclasses

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations import _ring_schedule
from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.ring_attention import RingAttentionCall
from ejkernel_cuda import cudnn_attention


@dataclasses.dataclass(frozen=True)
class CudnnRingBlocks:
    """The ring schedule's local blocks (``_ring_schedule.RingBlocks``) on cuDNN. cuDNN's log-sum-exp is the
    schedule's (natural log); no row of an accepted call sees no key, so neither side has an infinity."""

    softmax_scale: float

    def forward(self, q, k, v, q_seg, kv_seg, causal):
        if q_seg is not None:
            raise UnsupportedFeature("cuda ring_attention: segment ids")  # refused at dispatch; never here
        return cudnn_attention.forward(q, k, v, scale=self.softmax_scale, causal=causal)

    def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, causal):
        return cudnn_attention.backward(q, k, v, out, lse, d_out, scale=self.softmax_scale, causal=causal)


class CudnnRingAttention(Implementation[RingAttentionCall, NoConfig]):
    """Ring attention whose every step is a cuDNN flash-attention call (see the module docstring)."""

    def supports(self, call: RingAttentionCall) -> None:
        cudnn_attention.check_supported(
            "ring_attention", call.query, call.key, call.value, causal=call.causal,
            unsupported=dict(sliding_window=call.sliding_window, segment_ids=call.q_segment_ids,
                             softmax_aux=call.softmax_aux, logits_soft_cap=call.logits_soft_cap))

    def __call__(self, call: RingAttentionCall, config: NoConfig):
        return _ring_schedule.ring_attention(CudnnRingBlocks(call.softmax_scale), call)


IMPLEMENTATION = CudnnRingAttention()
