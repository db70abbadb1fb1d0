"""Flash attention (forward and backward) as Triton kernels, the semantics of docs/flash_attention.md.

Supported in forward and backward: causal, sliding window, logits soft cap, GQA/MQA, segment ids,
varlen (``cum_seqlens``), attention sinks (``softmax_aux``), dropout (the index hash of
``ejkernel.ops.utils.dropout``, recomputed bit for bit in every kernel), any sequence length, head_dim
8-256, bf16/fp16/fp32. Refused with :class:`ejkernel.UnsupportedFeature` (the dispatcher then falls back
to XLA): ``bias``, ``attention_mask``, head dims outside 8-256.

Modules: ``tuning`` (:class:`TritonFlashConfig`, shipped per-device tables, heuristic, autotuning space,
which forward kernel a call takes), ``common`` (static parameters and Triton helpers both passes share),
``tiles`` (the per-tile forward, dK/dV and dQ steps and the online softmax, shared with the block-sparse
kernels), ``forward`` (the pointer kernel and Hopper's TMA + warp-specialized kernel), ``backward`` (dK/dV,
dQ, delta), ``vjp`` (custom VJP and vmap rules, the sinks' gradient). Kernels are launched by ``ejkernel_triton.launch`` (jax-triton,
its own custom call for TMA, or ``ejkernel_triton.interpret`` on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel_triton.flash_attention import tuning
from ejkernel_triton.flash_attention.common import StaticParams
from ejkernel_triton.flash_attention.tuning import MAX_HEAD_DIM, TritonFlashConfig
from ejkernel_triton.flash_attention.vjp import attention
from ejkernel_triton.interpret import interpreting
from ejkernel_triton.launch import gpu_device_kind

__all__ = ["IMPLEMENTATION", "TritonFlashAttention", "TritonFlashConfig"]


class TritonFlashAttention(Implementation[FlashAttentionCall, TritonFlashConfig]):
    """Triton kernels through jax-triton (see the module docstring).

    Precision: every ``call.precision`` is honoured. Float32 inputs run IEEE float32 dots (on CUDA cores;
    exact, never TF32), and bf16/fp16 products are exact with float32 accumulation, so each call is at least
    as precise as ``"highest"`` asks; nothing is refused for its precision.
    """

    config_type = TritonFlashConfig

    def supports(self, call: FlashAttentionCall) -> None:
        if call.bias is not None:
            raise UnsupportedFeature("triton flash_attention: bias is not implemented (use the XLA backend)")
        if call.attention_mask is not None:
            raise UnsupportedFeature("triton flash_attention: attention_mask is not implemented "
                                     "(use segment ids, causal or sliding_window, or the XLA backend)")
        d, dv = call.query.shape[-1], call.value.shape[-1]
        if not (8 <= d <= MAX_HEAD_DIM and 8 <= dv <= MAX_HEAD_DIM):
            raise UnsupportedFeature(f"triton flash_attention: head dims {d}/{dv} outside [8, {MAX_HEAD_DIM}]")

    def heuristic_config(self, call: FlashAttentionCall) -> TritonFlashConfig:
        return tuning.heuristic_config(call.query.shape[-1], call.value.shape[-1], call.query.dtype,
                                       device_kind=gpu_device_kind(), causal=call.causal,
                                       tma=tuning.tma_blocks_fit(call))

    def candidate_configs(self, call: FlashAttentionCall) -> Sequence[TritonFlashConfig]:
        if tuning.shipped_entries(gpu_device_kind()):
            return ()  # tuned for this device kind: the heuristic reads the shipped table
        return tuning.config_space(call.query.shape[-1], call.value.shape[-1], call.query.dtype,
                                   tma=tuning.tma_blocks_fit(call))

    def __call__(self, call: FlashAttentionCall, config: TritonFlashConfig) -> jax.Array:
        q_len, num_heads, kv_len = call.query.shape[1], call.query.shape[2], call.key.shape[1]
        seed = None
        drop_threshold, drop_scale = 0, 1.0
        if call.dropout_prob:
            from ejkernel.ops.utils.dropout import threshold

            drop_threshold, drop_scale = threshold(call.dropout_prob), 1.0 / (1.0 - call.dropout_prob)
            # The hash takes the seed's low 32 bits, as the shared mask does (wrapping conversion).
            seed = call.dropout_seed
            seed = jnp.uint32(seed & 0xFFFFFFFF) if isinstance(seed, int) else jnp.asarray(seed).astype(jnp.uint32)
            seed = seed.reshape(1)
        aux = None
        if call.softmax_aux is not None:  # the kernels read [H, num_sinks] float32
            aux = call.softmax_aux.astype(jnp.float32).reshape(num_heads, -1)
        left, right = call.sliding_window if call.sliding_window is not None else (-1, -1)
        st = StaticParams(
            softmax_scale=call.softmax_scale, causal=call.causal, window_left=left, window_right=right,
            softcap=call.logits_soft_cap or 0.0, config=config, interpret=interpreting(),
            dropout_threshold=drop_threshold, dropout_scale=drop_scale,
            tma_forward=tuning.tma_forward_applies(call) and config.fits_tma_forward(q_len, kv_len))
        return attention(call.query, call.key, call.value, call.q_segment_ids, call.kv_segment_ids,
                         call.cum_seqlens_q, call.cum_seqlens_k, aux, seed, st)


IMPLEMENTATION = TritonFlashAttention()
