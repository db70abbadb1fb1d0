"""``ragged_page_attention`` on the GPU: the mixed prefill + decode batch of continuous-batching servers
over a paged cache with K/V interleaved on the head axis.

Decode rows (``q_len == 1``) run the split-K decode kernels of ``ejkernel_triton.decode``; prefill chunks run
a flash-style kernel over pages (query tiles x page-walked keys, the kv group's query heads packed into the
tile's rows); see ``kernels``. Causal within each sequence, sliding window, soft cap, sinks, any page size,
GQA/MQA, head_dim 8-256, quantized pages (float8 from sm_89, int8) with per-kv-head or per-page scales as in
the decode kernels. Precision: float32 inputs run IEEE dots, 16-bit inputs multiply exactly into
float32 accumulators: every ``call.precision`` is met. Forward-only (a gradient raises
``UnsupportedFeature``). Modules: ``config`` (:class:`TritonRaggedPageConfig`), ``kernels``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttentionCall
from ejkernel_triton.decode.config import MAX_HEAD_DIM
from ejkernel_triton.decode.quantized import check_quantized_cache
from ejkernel_triton.ragged_page_attention import config as tuning
from ejkernel_triton.ragged_page_attention.config import MAX_GROUP, TritonRaggedPageConfig

__all__ = ["IMPLEMENTATION", "TritonRaggedPageAttention", "TritonRaggedPageConfig"]


def _shape(call: RaggedPageAttentionCall) -> tuple[int, int, int, int, int, object, int]:
    """(max_num_seqs, kv heads, group, longest visible key range, head_dim, dtype, page size) for the
    heuristics."""
    _, num_heads, head_dim = call.queries.shape
    _, page_size, combined, _ = call.kv_pages.shape
    kv_heads = combined // 2
    max_num_seqs, max_pages = call.block_tables.shape
    tokens = max_pages * page_size
    if call.sliding_window is not None:
        tokens = min(tokens, call.sliding_window)
    return max_num_seqs, kv_heads, num_heads // kv_heads, tokens, head_dim, call.queries.dtype, page_size


class TritonRaggedPageAttention(Implementation[RaggedPageAttentionCall, TritonRaggedPageConfig]):
    config_type = TritonRaggedPageConfig

    def supports(self, call: RaggedPageAttentionCall) -> None:
        _, kv_heads, group, _, head_dim, _, _ = _shape(call)
        if not 8 <= head_dim <= MAX_HEAD_DIM:
            raise UnsupportedFeature(f"triton ragged_page_attention: head_dim {head_dim} outside [8, {MAX_HEAD_DIM}]")
        if group > MAX_GROUP:
            raise UnsupportedFeature(f"triton ragged_page_attention: {group} query heads per kv head (at most "
                                     f"{MAX_GROUP})")
        check_quantized_cache("ragged_page_attention", call.kv_pages.dtype)

    def heuristic_config(self, call: RaggedPageAttentionCall) -> TritonRaggedPageConfig:
        return tuning.heuristic_config(*_shape(call))

    def candidate_configs(self, call: RaggedPageAttentionCall) -> Sequence[TritonRaggedPageConfig]:
        return tuning.candidate_configs(*_shape(call))

    def __call__(self, call: RaggedPageAttentionCall, config: TritonRaggedPageConfig) -> jax.Array:
        from ejkernel_triton.interpret import interpreting
        from ejkernel_triton.ragged_page_attention.kernels import RaggedPageStatic, ragged_page_attention

        num_heads = call.queries.shape[1]
        aux = None
        if call.softmax_aux is not None:  # the kernels read [H, num_sinks] float32
            aux = call.softmax_aux.astype(jnp.float32).reshape(num_heads, -1)
        st = RaggedPageStatic(scale=call.softmax_scale, softcap=call.logits_soft_cap or 0.0,
                              window=call.sliding_window, config=config, interpret=interpreting())
        return ragged_page_attention(call.queries, call.kv_pages, call.context_lens, call.block_tables,
                                     call.query_start_loc, call.num_seqs, aux, st, call.key_scale, call.value_scale)


IMPLEMENTATION = TritonRaggedPageAttention()
