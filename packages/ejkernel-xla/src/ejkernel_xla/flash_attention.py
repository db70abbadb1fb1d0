"""XLA ``flash_attention``: blockwise online-softmax attention with a custom VJP (``_blockwise``).

Memory: the forward keeps one [B, H, bq, bk] logits block live at a time and saves only the output and
the per-row log-sum-exp for the backward, which recomputes the probabilities block by block; apart from
a bias or an explicit mask (which are S² by themselves, and whose blocks are read the same way) memory
grows with S. With causal or a sliding window, block pairs that no rule lets meet are skipped
(``lax.cond`` on position bounds). Every feature of ``docs/flash_attention.md`` is implemented; nothing is
refused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel_xla._blockwise import (
    AttentionParams,
    BlockSizes,
    default_block_sizes,
    flash_attention_blockwise,
    key_tokens,
    query_tokens,
)


@dataclasses.dataclass(frozen=True)
class XlaFlashConfig:
    """Block sizes of the blockwise loops (None: 512, or 256 for head_dim > 128; capped at the lengths)."""

    block_q: int | None = None
    block_kv: int | None = None
    bwd_block_q: int | None = None
    bwd_block_kv: int | None = None

    def blocks(self, q_len: int, kv_len: int, head_dim: int) -> BlockSizes:
        return default_block_sizes(
            q_len, kv_len, head_dim, q_block=self.block_q, kv_block=self.block_kv, bwd_q=self.bwd_block_q,
            bwd_kv=self.bwd_block_kv,
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


class XlaFlashAttention(Implementation[FlashAttentionCall, XlaFlashConfig]):
    config_type = XlaFlashConfig

    def __call__(self, call: FlashAttentionCall, config: XlaFlashConfig) -> jax.Array:
        q_len, kv_len, head_dim = call.query.shape[1], call.key.shape[1], call.query.shape[3]
        return _flash_jit(
            call.query, call.key, call.value, call.bias, call.attention_mask, call.q_segment_ids,
            call.kv_segment_ids, call.cum_seqlens_q, call.cum_seqlens_k, call.softmax_aux, call.dropout_seed,
            params=AttentionParams.of(call), blocks=config.blocks(q_len, kv_len, head_dim),
        )


IMPLEMENTATION = XlaFlashAttention()
