"""``flash_attention`` on the GPU through cuDNN's fused flash attention (:mod:`ejkernel_cuda.cudnn_attention`).

NVIDIA's own kernel, faster than our Triton one on Hopper (README's benchmark tables), for the calls it
computes exactly as ejkernel defines them: bfloat16/float16,
equal head dims, no mask or a causal one (or a causal window) over equal lengths, GQA. Everything else is
refused with ``UnsupportedFeature`` before anything compiles, and the dispatcher takes Triton or XLA.
"""

from __future__ import annotations

import jax

from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel_cuda import cudnn_attention


class CudnnFlashAttention(Implementation[FlashAttentionCall, NoConfig]):
    """cuDNN's flash attention (nothing to tune: cuDNN picks its own kernel per shape)."""

    def supports(self, call: FlashAttentionCall) -> None:
        cudnn_attention.check_supported(
            "flash_attention", call.query, call.key, call.value, causal=call.causal,
            sliding_window=call.sliding_window,
            unsupported=dict(bias=call.bias, attention_mask=call.attention_mask, segment_ids=call.q_segment_ids,
                             cum_seqlens=call.cum_seqlens_q, logits_soft_cap=call.logits_soft_cap,
                             softmax_aux=call.softmax_aux, dropout_prob=call.dropout_prob))

    def __call__(self, call: FlashAttentionCall, config: NoConfig) -> jax.Array:
        return cudnn_attention.attention(call.query, call.key, call.value, call.softmax_scale, bool(call.causal),
                                         cudnn_attention.window_length(call.sliding_window))


IMPLEMENTATION = CudnnFlashAttention()
