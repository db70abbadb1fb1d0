"""``scaled_dot_product_attention``: plain softmax attention, computed densely.

Canonical call every backend receives (validated and normalized here)::

    scaled_dot_product_attention(query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv],
                                 bias=None, cum_seqlens_q=None, cum_seqlens_k=None, *,
                                 attention_mask=None, softmax_scale: float, causal: bool,
                                 sliding_window: tuple[int, int] | None, cfg) -> out [B, Sq, H, Dv]

The semantics are exactly those of ``flash_attention`` (``docs/flash_attention.md``: float32 logits
``softmax_scale * <q, k> + bias``, GQA head mapping, bottom-right alignment when ``Sq != Skv``, causal,
``(left, right)`` window, boolean mask, varlen packing with ``cum_seqlens``, zeros for rows that see no
key) restricted to those features: no dropout, soft cap, sinks or segment ids (use ``flash_attention`` or
``attention`` for them). The difference is the implementation contract: a backend may materialize the
[B, H, Sq, Skv] logits (XLA does, in one fused computation, differentiated by autodiff), so memory is
O(S²); use it for short sequences. Gradients: query, key, value, bias. Full page: ``docs/ops/sdpa.md``.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import typechecked
from ejkernel.modules.operations._validation import (
    check_bias,
    check_bool,
    check_qkv,
    normalize_attention_mask,
    normalize_cum_seqlens,
    normalize_sliding_window,
    resolve_softmax_scale,
)


@dataclasses.dataclass(frozen=True)
class ScaledDotProductAttentionConfig:
    """Nothing to tune in the dense XLA form; backends with blocks read their own fields."""

    platform: str = "auto"
    backend: str = "any"


class ScaledDotProductAttention(RegistryOperation):
    """Dense softmax attention (see the module docstring)."""

    algorithm = "scaled_dot_product_attention"
    config_type = ScaledDotProductAttentionConfig

    def validate(
        self,
        query,
        key,
        value,
        bias=None,
        cum_seqlens_q=None,
        cum_seqlens_k=None,
        *,
        attention_mask=None,
        softmax_scale=None,
        causal=False,
        sliding_window=None,
    ):
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(query, key, value)
        check_bias(bias, batch, num_heads, q_len, kv_len)
        cum_seqlens_q, cum_seqlens_k = normalize_cum_seqlens(cum_seqlens_q, cum_seqlens_k, batch, q_len, kv_len)
        kwargs = dict(
            attention_mask=normalize_attention_mask(attention_mask, batch, num_heads, q_len, kv_len),
            softmax_scale=resolve_softmax_scale(softmax_scale, head_dim),
            causal=check_bool("causal", causal),
            sliding_window=normalize_sliding_window(sliding_window),
        )
        return (query, key, value, bias, cum_seqlens_q, cum_seqlens_k), kwargs


@typechecked
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
    platform: str = "auto",
    cfg: ScaledDotProductAttentionConfig | None = None,
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Softmax attention over the full logits matrix (see the module docstring).

    Args:
        query, key, value: ``[B, Sq, H, D]``, ``[B, Skv, Hkv, D]``, ``[B, Skv, Hkv, Dv]``, one dtype.
        bias: ``[B or 1, H or 1, Sq, Skv]`` added to the logits.
        cum_seqlens_q, cum_seqlens_k: int ``[num_seqs + 1]`` for packed varlen batches (batch 1).
        attention_mask: bool ``[B or 1, 1 or H, Sq, Skv]``, True = may attend.
        softmax_scale: default ``1/sqrt(D)``.
        causal, sliding_window: as in ``flash_attention`` (bottom-right aligned).
        platform, cfg: backend choice and its config.

    Returns:
        ``[B, Sq, H, Dv]`` in ``query``'s dtype.
    """
    return execute(
        ScaledDotProductAttention(),
        query,
        key,
        value,
        bias,
        cum_seqlens_q,
        cum_seqlens_k,
        attention_mask=attention_mask,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        platform=platform,
        cfg=cfg,
    )
