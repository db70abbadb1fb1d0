"""XLA ``scaled_dot_product_attention``: the whole [B, H, Sq, Skv] logits in one fused computation
(``_blockwise.dense_attention``), differentiated by autodiff. Memory O(S²) by design: the dense
operation is for short sequences; ``flash_attention`` is the O(S) one. Nothing to tune (``NoConfig``);
every feature is implemented, nothing is refused."""

from __future__ import annotations

import functools

import jax

from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.scaled_dot_product_attention import ScaledDotProductAttentionCall
from ejkernel_xla._blockwise import AttentionParams, dense_attention, key_tokens, query_tokens


@functools.partial(jax.jit, static_argnames=("params", "return_weights"))
def dense_jit(
    query, key, value, bias, attention_mask, cum_seqlens_q, cum_seqlens_k, softmax_aux, dropout_seed, *,
    params: AttentionParams, return_weights: bool,
):
    """Shared by the dense operations: tokens from the (varlen) layout, then ``dense_attention`` (whose
    matmuls run at ``params.precision``)."""
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q_tokens = query_tokens(batch, q_len, kv_len, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k)
    kv_tokens = key_tokens(batch, kv_len, cum_seqlens_k=cum_seqlens_k)
    out, weights = dense_attention(
        query, key, value, params=params, bias=bias, softmax_aux=softmax_aux, attention_mask=attention_mask,
        q_tokens=q_tokens, kv_tokens=kv_tokens, dropout_seed=dropout_seed,
    )
    return (out, weights.astype(query.dtype)) if return_weights else out


class XlaScaledDotProductAttention(Implementation[ScaledDotProductAttentionCall, NoConfig]):
    config_type = NoConfig

    def __call__(self, call: ScaledDotProductAttentionCall, config: NoConfig) -> jax.Array:
        return dense_jit(
            call.query, call.key, call.value, call.bias, call.attention_mask, call.cum_seqlens_q,
            call.cum_seqlens_k, None, None, params=AttentionParams.of(call), return_weights=False,
        )


IMPLEMENTATION = XlaScaledDotProductAttention()
