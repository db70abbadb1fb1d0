"""``ragged_decode_attention`` on the GPU: the split-K decode kernels (``kernels``) over each sequence's
slice ``[sequence_start, sequence_end)`` of a dense KV buffer, with the sliding window (only its left side
can hide keys: the query is the slice's last token), soft cap and attention sinks (added once, where the
splits merge). Empty ranges give zeros. Quantized buffers and their per-kv-head scales as for ``page_attention``
(``quantized``). Precision as for ``page_attention``: float32 inputs run IEEE dots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.ragged_decode_attention import RaggedDecodeAttentionCall
from ejkernel_triton.decode import config as tuning
from ejkernel_triton.decode.config import MAX_HEAD_DIM, TritonDecodeConfig
from ejkernel_triton.decode.quantized import check_quantized_cache

__all__ = ["IMPLEMENTATION", "TritonDecodeConfig", "TritonRaggedDecodeAttention"]


def _work_and_tokens(call: RaggedDecodeAttentionCall) -> tuple[int, int]:
    batch, num_heads, _ = call.query.shape
    seq_len, kv_heads = call.key.shape[1], call.key.shape[2]
    group = num_heads // kv_heads
    tokens = seq_len
    if call.sliding_window is not None:
        tokens = min(tokens, call.sliding_window[0] + 1)
    return batch * kv_heads * math.ceil(group / tuning.block_heads(group)), tokens


class TritonRaggedDecodeAttention(Implementation[RaggedDecodeAttentionCall, TritonDecodeConfig]):
    config_type = TritonDecodeConfig

    def supports(self, call: RaggedDecodeAttentionCall) -> None:
        head_dim = call.query.shape[-1]
        if not 8 <= head_dim <= MAX_HEAD_DIM:
            raise UnsupportedFeature(
                f"triton ragged_decode_attention: head_dim {head_dim} outside [8, {MAX_HEAD_DIM}]")
        check_quantized_cache("ragged_decode_attention", call.key.dtype)

    def heuristic_config(self, call: RaggedDecodeAttentionCall) -> TritonDecodeConfig:
        return tuning.heuristic_config(*_work_and_tokens(call), call.query.shape[-1], call.key.dtype, paged=False)

    def candidate_configs(self, call: RaggedDecodeAttentionCall) -> Sequence[TritonDecodeConfig]:
        return tuning.candidate_configs(*_work_and_tokens(call), call.query.shape[-1], call.key.dtype, paged=False)

    def __call__(self, call: RaggedDecodeAttentionCall, config: TritonDecodeConfig) -> jax.Array:
        from ejkernel_triton.decode.kernels import DecodeStatic, decode_attention
        from ejkernel_triton.interpret import interpreting

        num_heads = call.query.shape[1]
        aux = None
        if call.softmax_aux is not None:  # the kernels read [H, num_sinks] float32
            aux = call.softmax_aux.astype(jnp.float32).reshape(num_heads, -1)
        st = DecodeStatic(scale=call.softmax_scale, softcap=call.logit_soft_cap or 0.0, page_size=0, max_len=-1,
                          window_left=-1 if call.sliding_window is None else call.sliding_window[0],
                          config=config, interpret=interpreting(), operation="ragged_decode_attention")
        return decode_attention(call.query, call.key, call.value, call.sequence_start, call.sequence_end, None, aux,
                                st, key_scale=call.key_scale, value_scale=call.value_scale)


IMPLEMENTATION = TritonRaggedDecodeAttention()
