"""XLA ``scaled_dot_product_attention``: the whole [B, H, Sq, Skv] logits in one fused computation
(``_blockwise.dense_attention``), differentiated by autodiff. Memory O(S²) by design: the dense
operation is for short sequences; ``flash_attention`` is the O(S) one."""

from __future__ import annotations

import functools

import jax

from ejkernel_xla._blockwise import AttentionParams, dense_attention, key_tokens, query_tokens


@functools.partial(jax.jit, static_argnames=("params", "return_weights"))
def dense_jit(
    query, key, value, bias, attention_mask, cum_seqlens_q, cum_seqlens_k, softmax_aux, dropout_seed, *,
    params: AttentionParams, return_weights: bool,
):
    """Shared by the dense operations: tokens from the (varlen) layout, then ``dense_attention``."""
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q_tokens = query_tokens(batch, q_len, kv_len, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k)
    kv_tokens = key_tokens(batch, kv_len, cum_seqlens_k=cum_seqlens_k)
    out, weights = dense_attention(
        query, key, value, params=params, bias=bias, softmax_aux=softmax_aux, attention_mask=attention_mask,
        q_tokens=q_tokens, kv_tokens=kv_tokens, dropout_seed=dropout_seed,
    )
    return (out, weights.astype(query.dtype)) if return_weights else out


def scaled_dot_product_attention(
    query,
    key,
    value,
    bias=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
    *,
    attention_mask=None,
    softmax_scale: float,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    cfg=None,
):
    """Canonical ``scaled_dot_product_attention`` (arguments normalized by core)."""
    del cfg  # nothing to tune
    params = AttentionParams(
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        sliding_window=None if sliding_window is None else (int(sliding_window[0]), int(sliding_window[1])),
    )
    return dense_jit(
        query, key, value, bias, attention_mask, cum_seqlens_q, cum_seqlens_k, None, None,
        params=params, return_weights=False,
    )
