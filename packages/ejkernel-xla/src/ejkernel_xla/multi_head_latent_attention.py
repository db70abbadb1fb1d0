"""XLA ``multi_head_latent_attention``: the attention of XLA's ``flash_attention`` -- the dense path where its
S² buffers fit the device (``flash_attention``'s rule: GPU/TPU, forward+backward within
``DENSE_MEMORY_SHARE`` of the device's memory), else the blockwise kernel (``_blockwise``, custom VJP, memory
O(S)) -- on one of two equivalent forms, whichever costs fewer FLOPs per (query, key) pair:

- expanded: up-project the latent to per-kv-head keys/values (``key_value @ w_kc``, ``@ w_vc``), append
  the RoPE parts to queries/keys, GQA attention with head width ``head_dim + rope_dim``;
- absorbed (latent space): fold ``w_kc`` into the queries (``q @ w_kc^T``, width ``kv_lora_rank``), attend
  to the latent itself as one shared kv head, then up-project the result with ``w_vc``. No per-head
  keys/values are ever materialized.

Gradients of every input flow through the blockwise kernel's VJP and the surrounding einsums; every
matmul (forward and backward) runs at the call's precision. Every feature is implemented; nothing is
refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.multi_head_latent_attention import MultiHeadLatentAttentionCall
from ejkernel_xla._blockwise import AttentionParams, flash_attention_blockwise, key_tokens, query_tokens
from ejkernel_xla._dense import flash_attention_dense
from ejkernel_xla._jitted import JittedImplementation
from ejkernel_xla.flash_attention import XlaBlockConfig, dense_budget_bytes, dense_peak_bytes_of, logits_counts


@dataclasses.dataclass(frozen=True)
class XlaMlaConfig(XlaBlockConfig):
    """The form, the path and the blockwise loop's block sizes (as in ``XlaBlockConfig``). ``absorb=True``
    attends in the latent space (one shared kv head of width ``kv_lora_rank``), ``False`` on expanded
    per-head keys/values, ``None`` whichever costs fewer FLOPs. ``dense=True`` runs the dense attention (no
    blocks), ``False`` the blockwise loop, ``None`` ``flash_attention``'s rule (dense where its
    forward+backward buffers fit; a block size given selects the blockwise loop). A user's config may leave
    any field at None: :meth:`resolved` decides them for the call where it runs; the heuristic config is a
    resolved one (the form, the path and, on the blockwise path, every block size of the loop that runs)."""

    absorb: bool | None = None
    dense: bool | None = None

    def __post_init__(self):
        self.check_path_fields("absorb", "dense")

    def resolved(self, call: MultiHeadLatentAttentionCall) -> XlaMlaConfig:
        """This config with the form (``absorb``, None: the cheaper one), the path (``dense``, None:
        the rule) and the block sizes (``XlaBlockConfig``'s defaults for the attended width: ``kv_lora_rank``,
        or the head dim, plus the rope dim) decided for ``call``. A resolved config is its own."""
        rank, _, v_head_dim = call.w_vc.shape
        batch, seq_len, num_heads, head_dim = call.query.shape
        absorb = self.absorb if self.absorb is not None else absorb_is_cheaper(rank, head_dim, v_head_dim)
        dense = self.dense
        if dense is None:
            budget = dense_budget_bytes()
            params = AttentionParams(softmax_scale=call.softmax_scale, causal=call.causal, precision=call.precision)
            counts = logits_counts(params, batch, num_heads, seq_len, seq_len, varlen=call.cu_seqlens is not None)
            dense = (not self.has_blocks and budget is not None
                     and dense_peak_bytes_of(*counts, call.query.dtype.itemsize) <= budget)
        if dense:
            return dataclasses.replace(self, absorb=absorb, dense=True)
        width = (rank if absorb else head_dim) + (0 if call.b_q is None else call.b_q.shape[-1])
        return dataclasses.replace(self, absorb=absorb, dense=False).with_blocks(seq_len, seq_len, width)


def absorb_is_cheaper(kv_lora_rank: int, head_dim: int, v_head_dim: int) -> bool:
    """Per (query, key, head): latent space costs ~2 * rank multiply-adds, expanded head_dim + v_head_dim."""
    return 2 * kv_lora_rank <= head_dim + v_head_dim


def _mla(call: MultiHeadLatentAttentionCall, config: XlaMlaConfig) -> jax.Array:
    query, key_value, w_kc, w_vc, b_q, b_k = call.query, call.key_value, call.w_kc, call.w_vc, call.b_q, call.b_k
    batch, seq_len, num_heads, head_dim = query.shape
    rank, num_kv_heads, v_head_dim = w_vc.shape
    group = num_heads // num_kv_heads
    config = config.resolved(call)  # a user's config may leave fields at None; the heuristic's are resolved
    absorb = config.absorb
    f32 = jnp.float32

    if b_q is not None and b_q.ndim == 3:
        b_q = jnp.broadcast_to(b_q[:, :, None], (batch, seq_len, num_heads, b_q.shape[-1]))

    if absorb:
        grouped_q = query.reshape(batch, seq_len, num_kv_heads, group, head_dim)
        q = jnp.einsum("bskgd,rkd->bskgr", grouped_q, w_kc, preferred_element_type=f32)
        q = q.reshape(batch, seq_len, num_heads, rank).astype(query.dtype)
        k = key_value[:, :, None, :]
        v = key_value[:, :, None, :]
        if b_q is not None:
            q = jnp.concatenate([q, b_q], axis=-1)
            k = jnp.concatenate([k, b_k[:, :, None, :]], axis=-1)
    else:
        q = query
        k = jnp.einsum("bsr,rkd->bskd", key_value, w_kc, preferred_element_type=f32).astype(query.dtype)
        v = jnp.einsum("bsr,rkd->bskd", key_value, w_vc, preferred_element_type=f32).astype(query.dtype)
        if b_q is not None:
            q = jnp.concatenate([q, b_q], axis=-1)
            rope_k = jnp.broadcast_to(b_k[:, :, None, :], (batch, seq_len, num_kv_heads, b_k.shape[-1]))
            k = jnp.concatenate([k, rope_k], axis=-1)

    attention = dict(
        params=AttentionParams(softmax_scale=call.softmax_scale, causal=call.causal, precision=call.precision),
        q_tokens=query_tokens(batch, seq_len, seq_len, cum_seqlens_q=call.cu_seqlens, cum_seqlens_k=call.cu_seqlens),
        kv_tokens=key_tokens(batch, seq_len, cum_seqlens_k=call.cu_seqlens),
    )
    if config.dense:
        out = flash_attention_dense(q, k, v, **attention)
    else:
        out = flash_attention_blockwise(q, k, v, blocks=config.blocks(seq_len, seq_len, q.shape[-1]), **attention)
    if absorb:
        grouped_out = out.reshape(batch, seq_len, num_kv_heads, group, rank)
        out = jnp.einsum("bskgr,rkd->bskgd", grouped_out, w_vc, preferred_element_type=f32)
        out = out.reshape(batch, seq_len, num_heads, v_head_dim)
    return out.astype(query.dtype)


class XlaMultiHeadLatentAttention(JittedImplementation[MultiHeadLatentAttentionCall, XlaMlaConfig]):
    """The projections around the blockwise kernel are plain autodiff, at the call's precision (``_jitted``)."""

    config_type = XlaMlaConfig
    compute = staticmethod(_mla)

    def heuristic_config(self, call: MultiHeadLatentAttentionCall) -> XlaMlaConfig:
        """The form and block sizes a config left at None takes, spelled out (the config stored is the one run)."""
        return XlaMlaConfig().resolved(call)


IMPLEMENTATION = XlaMultiHeadLatentAttention()
