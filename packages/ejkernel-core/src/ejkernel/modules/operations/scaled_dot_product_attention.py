"""``scaled_dot_product_attention``: plain softmax attention, computed densely.

Core validates the public call into one frozen :class:`ScaledDotProductAttentionCall`, all a backend
sees; the arguments are checked and normalized by ``FlashAttention.validate`` (the same rules as
``flash_attention``).

The semantics are exactly those of ``flash_attention`` (``docs/flash_attention.md``: float32 logits
``softmax_scale * <q, k> + bias``, GQA head mapping, bottom-right alignment when ``Sq != Skv``, causal,
``(left, right)`` window, boolean mask, varlen packing with ``cum_seqlens``, zeros for rows that see no
key) restricted to those features: no dropout, soft cap, sinks or segment ids (use ``flash_attention`` or
``attention`` for them). The difference is the implementation contract: a backend may materialize the
[B, H, Sq, Skv] logits (XLA does, in one fused computation, differentiated by autodiff), so memory is
O(S²); use it for short sequences. Gradients: query, key, value, bias. Full page: ``docs/ops/sdpa.md``.
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention_subset, restricted_call


@flash_attention_subset(
    "query", "key", "value", "bias", "attention_mask", "cum_seqlens_q", "cum_seqlens_k",
    "softmax_scale", "causal", "sliding_window", "precision",
)
class ScaledDotProductAttentionCall:
    """A validated ``scaled_dot_product_attention`` call: what every backend receives (see above); its
    fields are ``FlashAttentionCall``'s of those names (no dropout, soft cap, sinks or segment ids)."""


class ScaledDotProductAttention(RegistryOperation):
    """Dense softmax attention (see the module docstring)."""

    algorithm = "scaled_dot_product_attention"

    def canonicalize(self, args: Arguments) -> ScaledDotProductAttentionCall:
        """The arguments are checked and normalized by ``FlashAttention.validate``."""
        return restricted_call(self.algorithm, ScaledDotProductAttentionCall, FlashAttention().validate(**args))


@public_function(ScaledDotProductAttention)
def scaled_dot_product_attention(
    query: Float[jax.Array, "batch q_len num_heads head_dim"],
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"],
    bias: Float[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    cum_seqlens_q: Int[jax.Array, "num_seqs_plus_1"] | None = None,
    cum_seqlens_k: Int[jax.Array, "num_seqs_plus_1"] | None = None,
    *,
    attention_mask: Bool[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Softmax attention over the full logits matrix (see the module docstring).

    Args:
        query, key, value: ``[B, Sq, H, D]``, ``[B, Skv, Hkv, D]``, ``[B, Skv, Hkv, Dv]``, one dtype.
        bias: ``[B or 1, H or 1, Sq, Skv]`` added to the logits.
        cum_seqlens_q, cum_seqlens_k: int ``[num_seqs + 1]`` for packed varlen batches (batch 1).
        attention_mask: bool ``[B or 1, 1 or H, Sq, Skv]``, True = may attend.
        softmax_scale: default ``1/sqrt(D)``.
        causal, sliding_window: as in ``flash_attention`` (bottom-right aligned).
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config (XLA: ``ejkernel.NoConfig()``, nothing to tune); it selects that
            implementation. None: the chosen implementation's heuristic.

    Returns:
        ``[B, Sq, H, Dv]`` in ``query``'s dtype.
    """
    return execute(ScaledDotProductAttention(), **locals())
