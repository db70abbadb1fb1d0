"""XLA ``flash_attention``: blockwise online-softmax attention with a custom VJP (``_blockwise``).

Memory: the forward keeps one [B, H, bq, bk] logits block live at a time and saves only the output and
the per-row log-sum-exp for the backward, which recomputes the probabilities block by block; apart from
a bias or an explicit mask (which are S² by themselves, and whose blocks are read the same way) memory
grows with S. With causal or a sliding window, block pairs that no rule lets meet are skipped
(``lax.cond`` on position bounds). Every feature of ``docs/flash_attention.md`` is implemented; nothing is
refused.

Block sizes come from ``cfg.fwd_params.q_blocksize / kv_blocksize`` and ``cfg.bwd_params`` (None: 512,
or 256 for head_dim > 128, capped at the sequence lengths).
"""

from __future__ import annotations

import functools

import jax

from ejkernel_xla._blockwise import (
    AttentionParams,
    BlockSizes,
    default_block_sizes,
    flash_attention_blockwise,
    key_tokens,
    query_tokens,
)


def _block_sizes(cfg, q_len: int, kv_len: int, head_dim: int):
    fwd = getattr(cfg, "fwd_params", None)
    bwd = getattr(cfg, "bwd_params", None)
    return default_block_sizes(
        q_len,
        kv_len,
        head_dim,
        q_block=getattr(fwd, "q_blocksize", None),
        kv_block=getattr(fwd, "kv_blocksize", None),
        bwd_q=getattr(bwd, "q_blocksize", None),
        bwd_kv=getattr(bwd, "kv_blocksize", None),
    )


def attention_params(softmax_scale, causal, sliding_window, logits_soft_cap, dropout_prob) -> AttentionParams:
    return AttentionParams(
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        sliding_window=None if sliding_window is None else (int(sliding_window[0]), int(sliding_window[1])),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=float(dropout_prob),
    )


# One compiled program per (shapes, static arguments): eager lax.scan would re-trace its body per call.
@functools.partial(jax.jit, static_argnames=("params", "blocks"))
def _flash_jit(
    query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, cum_seqlens_q, cum_seqlens_k,
    softmax_aux, dropout_seed, *, params: AttentionParams, blocks: BlockSizes,
):
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q_tokens = query_tokens(
        batch, q_len, kv_len, segment_ids=q_segment_ids, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k
    )
    kv_tokens = key_tokens(batch, kv_len, segment_ids=kv_segment_ids, cum_seqlens_k=cum_seqlens_k)
    return flash_attention_blockwise(
        query,
        key,
        value,
        params=params,
        blocks=blocks,
        bias=bias,
        softmax_aux=softmax_aux,
        attention_mask=attention_mask,
        q_tokens=q_tokens,
        kv_tokens=kv_tokens,
        dropout_seed=dropout_seed,
    )


def flash_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale: float,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
    softmax_aux=None,
    cfg=None,
):
    """Canonical ``flash_attention`` (arguments already normalized by core); see the module docstring."""
    params = attention_params(softmax_scale, causal, sliding_window, logits_soft_cap, dropout_prob)
    blocks = _block_sizes(cfg, query.shape[1], key.shape[1], query.shape[3])
    return _flash_jit(
        query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, cum_seqlens_q, cum_seqlens_k,
        softmax_aux, None if params.dropout_prob == 0.0 else dropout_seed, params=params, blocks=blocks,
    )
