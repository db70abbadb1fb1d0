"""``attention``: dense multi-head attention that also returns the attention weights.

Canonical call every backend receives (validated and normalized here)::

    attention(query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], bias=None,
              softmax_aux=None, *, attention_mask=None, softmax_scale: float, logits_soft_cap: float | None,
              dropout_prob: float, dropout_seed: int | None, causal: bool,
              sliding_window: tuple[int, int] | None, cfg)
        -> (out [B, Sq, H, Dv] in query's dtype, weights [B, H, Sq, Skv] in query's dtype)

The semantics of ``out`` are those of ``flash_attention`` (``docs/flash_attention.md``) for these
features: scale, soft cap, bias, GQA, bottom-right alignment, causal, ``(left, right)`` window, boolean
mask, attention sinks ``softmax_aux`` ([H] or [H, K]; denominator only), dropout with the shared index
hash (``dropout_prob > 0`` without a seed uses seed 0). ``weights`` are the softmax probabilities
*before* dropout (sinks excluded, so a row sums to 1 minus the sinks' share; a row that sees no key is
all zeros). Gradients: query, key, value, bias, softmax_aux (through ``out`` and ``weights``).

The original library's ``deterministic=True`` switches dropout off; ``dropout_rng`` is not used (the
dropout mask is the index hash of ``dropout_seed``, so every backend draws the same one). Memory is
O(S²): use ``flash_attention`` for long sequences. Full page: ``docs/ops/attention.md``.
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
    check_softmax_aux,
    normalize_attention_mask,
    normalize_dropout,
    normalize_sliding_window,
    normalize_soft_cap,
    resolve_softmax_scale,
)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Nothing to tune in the dense XLA form; backends with blocks read their own fields."""

    platform: str = "auto"
    backend: str = "any"


class Attention(RegistryOperation):
    """Dense attention returning ``(out, weights)`` (see the module docstring)."""

    algorithm = "attention"
    config_type = AttentionConfig

    def validate(
        self,
        query,
        key,
        value,
        bias=None,
        softmax_aux=None,
        *,
        attention_mask=None,
        softmax_scale=None,
        logits_soft_cap=None,
        dropout_prob=0.0,
        dropout_seed=None,
        causal=False,
        sliding_window=None,
    ):
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(query, key, value)
        check_bias(bias, batch, num_heads, q_len, kv_len)
        dropout_prob, dropout_seed = normalize_dropout(dropout_prob, dropout_seed)
        kwargs = dict(
            attention_mask=normalize_attention_mask(attention_mask, batch, num_heads, q_len, kv_len),
            softmax_scale=resolve_softmax_scale(softmax_scale, head_dim),
            logits_soft_cap=normalize_soft_cap(logits_soft_cap),
            dropout_prob=dropout_prob,
            dropout_seed=dropout_seed,
            causal=check_bool("causal", causal),
            sliding_window=normalize_sliding_window(sliding_window),
        )
        return (query, key, value, bias, check_softmax_aux(softmax_aux, num_heads)), kwargs


@typechecked
def attention(
    query: Float[jax.Array, "batch q_len num_heads head_dim"],
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"],
    bias: Float[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = None,
    *,
    attention_mask: Bool[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    deterministic: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[jax.Array, ""] | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    platform: str = "auto",
    cfg: AttentionConfig | None = None,
) -> tuple[Float[jax.Array, "batch q_len num_heads v_head_dim"], Float[jax.Array, "batch num_heads q_len kv_len"]]:
    """Dense attention; returns ``(out, weights)`` (see the module docstring).

    Args:
        query, key, value: ``[B, Sq, H, D]``, ``[B, Skv, Hkv, D]``, ``[B, Skv, Hkv, Dv]``, one dtype.
        bias: ``[B or 1, H or 1, Sq, Skv]`` added to the logits.
        softmax_aux: attention-sink logits ``[H]`` or ``[H, K]``.
        attention_mask: bool ``[B or 1, 1 or H, Sq, Skv]``, True = may attend.
        deterministic: True switches dropout off (the original library's flag).
        softmax_scale: default ``1/sqrt(D)``.
        logits_soft_cap: ``c * tanh(s / c)`` on the scaled logits.
        dropout_prob, dropout_seed: attention dropout (index hash of the seed; default seed 0).
        causal, sliding_window: as in ``flash_attention`` (bottom-right aligned).
        platform, cfg: backend choice and its config.

    Returns:
        ``out [B, Sq, H, Dv]`` and ``weights [B, H, Sq, Skv]`` (pre-dropout), both in ``query``'s dtype.
    """
    return execute(
        Attention(),
        query,
        key,
        value,
        bias,
        softmax_aux,
        attention_mask=attention_mask,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        dropout_prob=0.0 if deterministic else dropout_prob,
        dropout_seed=dropout_seed,
        causal=causal,
        sliding_window=sliding_window,
        platform=platform,
        cfg=cfg,
    )
