"""``attention``: dense multi-head attention that also returns the attention weights.

Core validates the public call into one frozen :class:`AttentionCall`, all a backend sees. The
arguments it shares with ``flash_attention`` are checked and normalized by ``FlashAttention.validate``
(one set of rules: ``softmax_scale=None`` -> ``1/sqrt(D)``, ``sliding_window=w`` -> ``(w, w)``, a mask
with batch 1 broadcast to ``B``, ``dropout_prob > 0`` without a seed -> seed 0, ``precision``).

The semantics of ``out`` are those of ``flash_attention`` (``docs/flash_attention.md``) for these
features: scale, soft cap, bias, GQA, bottom-right alignment, causal, ``(left, right)`` window, boolean
mask, attention sinks ``softmax_aux`` ([H] or [H, K]; denominator only), dropout with the shared index
hash. ``weights`` are the softmax probabilities *before* dropout (sinks excluded, so a row sums to 1
minus the sinks' share; a row that sees no key is all zeros). Gradients: query, key, value, bias,
softmax_aux (through ``out`` and ``weights``).

The original library's ``deterministic=True`` switches dropout off; ``dropout_rng`` is not used (the
dropout mask is the index hash of ``dropout_seed``, so every backend draws the same one). Memory is
O(S²): use ``flash_attention`` for long sequences. Full page: ``docs/ops/attention.md``.
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._validation import check_bool
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention_subset, restricted_call

@flash_attention_subset(
    "query", "key", "value", "bias", "softmax_aux", "attention_mask", "dropout_seed",
    "softmax_scale", "causal", "sliding_window", "logits_soft_cap", "dropout_prob", "precision",
)
class AttentionCall:
    """A validated ``attention`` call: what every backend receives (defaults resolved, see above); its fields
    are ``FlashAttentionCall``'s of those names (no segment ids, no varlen)."""


class Attention(RegistryOperation):
    """Dense attention returning ``(out, weights)`` (see the module docstring)."""

    algorithm = "attention"

    def canonicalize(self, args: Arguments) -> AttentionCall:
        """Every argument but ``deterministic`` is checked and normalized by ``FlashAttention.validate``."""
        keywords = args.without("deterministic")
        if check_bool("deterministic", args.deterministic):
            keywords["dropout_prob"] = 0.0
        return restricted_call(self.algorithm, AttentionCall, FlashAttention().validate(**keywords))


@public_function(Attention)
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
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
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
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config (XLA: ``ejkernel.NoConfig()``, nothing to tune); it selects that
            implementation. None: the chosen implementation's heuristic.

    Returns:
        ``out [B, Sq, H, Dv]`` and ``weights [B, H, Sq, Skv]`` (pre-dropout), both in ``query``'s dtype.
    """
    return execute(Attention(), **locals())
