"""``page_attention`` on the GPU: the split-K decode kernels (``kernels``) over a paged KV cache.

Every page size works (pages that hold whole key steps read one block-table entry per step, others look the
page up per key row), as do ``max_context_len``, the soft cap and the scale; zero-length contexts give zeros.
Block-table entries that are read are clamped into ``[0, num_blocks)`` (see ``kernels``). Quantized caches
(float8_e4m3fn, float8_e5m2 on sm_89 and later; int8) are read as they are stored (half the bytes of bf16) and
multiply in the query's dtype (float16 for bfloat16 queries), dequantized per kv head or per (page, kv head) by
``key_scale``/``value_scale`` (``quantized``). Precision: float32 inputs run IEEE float32 dots (never TF32) and
16-bit operands multiply exactly into float32 accumulators, so every ``call.precision`` is met and none is
refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.page_attention import PageAttentionCall
from ejkernel_triton.decode import config as tuning
from ejkernel_triton.decode.config import MAX_HEAD_DIM, TritonDecodeConfig
from ejkernel_triton.decode.quantized import check_quantized_cache

__all__ = ["IMPLEMENTATION", "TritonDecodeConfig", "TritonPageAttention"]

def _work_and_tokens(call: PageAttentionCall) -> tuple[int, int]:
    """Programs per split (sequences x kv heads x head blocks) and the longest possible context."""
    num_seqs, num_heads, _ = call.query.shape
    kv_heads, page_size = call.key_cache.shape[1], call.key_cache.shape[2]
    group = num_heads // kv_heads
    work = num_seqs * kv_heads * math.ceil(group / tuning.block_heads(group))
    return work, min(call.max_context_len, call.block_tables.shape[1] * page_size)


class TritonPageAttention(Implementation[PageAttentionCall, TritonDecodeConfig]):
    config_type = TritonDecodeConfig

    def supports(self, call: PageAttentionCall) -> None:
        head_dim = call.query.shape[-1]
        if not 8 <= head_dim <= MAX_HEAD_DIM:
            raise UnsupportedFeature(f"triton page_attention: head_dim {head_dim} outside [8, {MAX_HEAD_DIM}]")
        check_quantized_cache("page_attention", call.key_cache.dtype)

    def heuristic_config(self, call: PageAttentionCall) -> TritonDecodeConfig:
        return tuning.heuristic_config(*_work_and_tokens(call), call.query.shape[-1], call.key_cache.dtype)

    def candidate_configs(self, call: PageAttentionCall) -> Sequence[TritonDecodeConfig]:
        return tuning.candidate_configs(*_work_and_tokens(call), call.query.shape[-1], call.key_cache.dtype)

    def __call__(self, call: PageAttentionCall, config: TritonDecodeConfig) -> jax.Array:
        from ejkernel_triton.decode.kernels import DecodeStatic, decode_attention
        from ejkernel_triton.interpret import interpreting

        st = DecodeStatic(scale=call.attn_scale, softcap=call.attn_logits_soft_cap or 0.0,
                          page_size=call.key_cache.shape[2], max_len=call.max_context_len, window_left=-1,
                          config=config, interpret=interpreting(), operation="page_attention")
        return decode_attention(call.query, call.key_cache, call.value_cache, None, call.context_lens,
                                call.block_tables, None, st, key_scale=call.key_scale, value_scale=call.value_scale)


IMPLEMENTATION = TritonPageAttention()
