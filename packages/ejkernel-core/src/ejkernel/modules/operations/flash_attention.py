"""``flash_attention``: memory-efficient exact attention; the semantics every backend implements.

The full specification is ``docs/flash_attention.md``; in short::

    flash_attention(query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], bias=None, *,
                    attention_mask, q_segment_ids, kv_segment_ids, softmax_scale, causal, sliding_window,
                    logits_soft_cap, dropout_prob, dropout_seed, cum_seqlens_q, cum_seqlens_k,
                    softmax_aux, platform="auto", cfg=None) -> out [B, Sq, H, Dv]

- Logits in float32: ``softmax_scale * <q_i, k_j>``, then ``c * tanh(s / c)`` for a soft cap ``c``, then
  ``+ bias``. Query head ``h`` reads kv head ``h // (H // Hkv)`` (GQA/MQA).
- Queries are aligned to the *end* of the keys (query ``i`` sits at ``i + Skv - Sq``; per sequence with
  varlen). Key ``j`` is visible when the causal rule, the ``(left, right)`` window, the boolean mask,
  equal segment ids and (varlen) the same sequence all allow it.
- Softmax over visible keys plus the sink logits ``softmax_aux`` (denominator only). Dropout multiplies
  the probabilities by ``keep / (1 - p)``, ``keep`` the index hash of ``ejkernel.ops.utils.dropout``, so
  the same seed gives the same mask in every backend and in forward and backward.
- A row that sees no key outputs zeros and gets zero gradients. Gradients: ``query``, ``key``,
  ``value``, ``bias`` and ``softmax_aux``.

What core normalizes before any backend sees the call (:meth:`FlashAttention.validate`):
``softmax_scale=None`` -> ``1/sqrt(D)``; ``sliding_window=w`` -> ``(w, w)``; a missing segment-id side
(self-attention) -> the other one; an ``attention_mask`` with batch 1 -> broadcast to ``B``;
``dropout_prob > 0`` without a seed -> ``DEFAULT_DROPOUT_SEED`` (0: deterministic, the same mask on
every call -- pass your own seed per step for training); ``cum_seqlens`` -> int32. Every check raises a
``ValueError`` naming the argument, its shape/dtype and what was expected, before anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import Implementation, array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    check_bias,
    check_bool,
    check_qkv,
    check_softmax_aux,
    describe,
    normalize_attention_mask,
    normalize_cum_seqlens,
    normalize_dropout,
    normalize_segment_ids,
    normalize_sliding_window,
    normalize_soft_cap,
    resolve_softmax_scale,
)

@canonical_call
class FlashAttentionCall:
    """A validated ``flash_attention`` call: what every backend receives (defaults resolved, see above)."""

    query: Float[jax.Array, "batch q_len num_heads head_dim"] = array_field()
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"] = array_field()
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"] = array_field()
    bias: Float[jax.Array, "#batch #num_heads q_len kv_len"] | None = array_field()
    attention_mask: Bool[jax.Array, "batch #num_heads q_len kv_len"] | None = array_field()
    q_segment_ids: Int[jax.Array, "batch q_len"] | None = array_field()
    """int32; given together with ``kv_segment_ids`` or not at all."""
    kv_segment_ids: Int[jax.Array, "batch kv_len"] | None = array_field()
    cum_seqlens_q: Int[jax.Array, "num_seqs_plus_1"] | None = array_field()
    """int32; given together with ``cum_seqlens_k`` (then batch is 1) or not at all."""
    cum_seqlens_k: Int[jax.Array, "num_seqs_plus_1"] | None = array_field()
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = array_field()
    dropout_seed: int | Int[jax.Array, ""] | None = array_field()
    """None exactly when ``dropout_prob == 0``; a Python int or a traced integer scalar otherwise."""
    softmax_scale: float = 1.0
    causal: bool = False
    sliding_window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    dropout_prob: float = 0.0
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""

    @property
    def masked(self) -> bool:
        """Whether any rule besides the sequence bounds hides keys (causal, window, segments, mask, varlen)."""
        return (
            self.causal
            or self.sliding_window is not None
            or self.q_segment_ids is not None
            or self.attention_mask is not None
            or self.cum_seqlens_q is not None
        )


CallT = TypeVar("CallT")
_FLASH_FIELDS = {f.name: f for f in dataclasses.fields(FlashAttentionCall)}


def flash_attention_subset(*names: str) -> Callable[[type], type]:
    """Class decorator: the canonical call of an operation whose features are a subset of flash_attention's.

    Its fields are FlashAttentionCall's ``names`` (same annotation, default and array/static kind, declared
    once, above) followed by the fields the class declares itself; FlashAttentionCall's other fields read as
    class constants holding their defaults (the feature off), so code shared with flash_attention reads
    any of them. Build one with :func:`restricted_call`.
    """
    unknown = [name for name in names if name not in _FLASH_FIELDS]
    if unknown:
        raise TypeError(f"FlashAttentionCall has no field(s) {', '.join(unknown)}")

    def make(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        for name in names:
            flash_field = _FLASH_FIELDS[name]
            setattr(cls, name, dataclasses.field(default=flash_field.default, metadata=flash_field.metadata))
        cls.__annotations__ = {**{name: _FLASH_FIELDS[name].type for name in names}, **own}
        for name, field in _FLASH_FIELDS.items():
            if name not in cls.__annotations__:
                setattr(cls, name, field.default)
        return canonical_call(cls)

    return make


def restricted_call(algorithm: str, call_type: type[CallT], flash_call: FlashAttentionCall, **extra: Any) -> CallT:
    """The call of an operation whose features are a subset of flash_attention's, from a validated
    ``flash_attention`` call: the fields ``call_type`` has, plus ``extra``. A flash_attention feature the
    operation lacks must be unused (ValueError naming it)."""
    fields = {f.name for f in dataclasses.fields(call_type)}
    # static fields first: a dropout_prob names the feature better than the seed it implies
    for f in sorted(dataclasses.fields(FlashAttentionCall), key=lambda f: f.metadata.get("array", False)):
        value = getattr(flash_call, f.name)
        if f.name not in fields and (value is not None if f.default is None else value != f.default):
            raise ValueError(f"{algorithm} has no {f.name} (flash_attention has), got {describe(value)}")
    return call_type(**{name: getattr(flash_call, name) for name in fields - extra.keys()}, **extra)


def widened_call(call: Any) -> FlashAttentionCall:
    """The ``FlashAttentionCall`` of a restricted operation's call (``flash_attention_subset``): its fields,
    and flash_attention's other features off. The inverse of :func:`restricted_call`."""
    return FlashAttentionCall(**{f.name: getattr(call, f.name) for f in dataclasses.fields(FlashAttentionCall)})


class ThroughFlashAttention(Implementation):
    """An implementation of an operation whose call restricts ``flash_attention``'s (e.g.
    ``scaled_dot_product_attention``) by a backend's ``flash_attention`` implementation: the call widened
    (:func:`widened_call`), refusals, ranking, configs and the run all that implementation's."""

    def __init__(self, flash: Implementation):
        self.flash = flash
        self.config_type = flash.config_type

    # The call and config stay unannotated: the call is the narrower operation's (whichever it is) and the
    # config the flash implementation's ``config_type`` (the registry's contract check compares annotations).
    def supports(self, call) -> None:
        self.flash.supports(widened_call(call))

    def priority_for(self, call) -> int | None:
        return self.flash.priority_for(widened_call(call))

    def heuristic_config(self, call):
        return self.flash.heuristic_config(widened_call(call))

    def candidate_configs(self, call) -> Sequence[Any]:
        return self.flash.candidate_configs(widened_call(call))

    def __call__(self, call, config):
        return self.flash(widened_call(call), config)

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} of {self.flash!r}>"


# ---- the operation ---------------------------------------------------------------------------------


class FlashAttention(RegistryOperation):
    """Exact attention, blockwise (see the module docstring); run it with an executor or call
    :func:`flash_attention`."""

    algorithm = "flash_attention"

    def canonicalize(self, args: Arguments) -> FlashAttentionCall:
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(args.query, args.key, args.value)
        check_bias(args.bias, batch, num_heads, q_len, kv_len)
        dropout_prob, dropout_seed = normalize_dropout(args.dropout_prob, args.dropout_seed)
        q_segment_ids, kv_segment_ids = normalize_segment_ids(
            args.q_segment_ids, args.kv_segment_ids, batch, q_len, kv_len
        )
        cum_seqlens_q, cum_seqlens_k = normalize_cum_seqlens(args.cum_seqlens_q, args.cum_seqlens_k, batch, q_len, kv_len)
        return args.build(
            FlashAttentionCall,
            attention_mask=normalize_attention_mask(args.attention_mask, batch, num_heads, q_len, kv_len),
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            cum_seqlens_q=cum_seqlens_q,
            cum_seqlens_k=cum_seqlens_k,
            softmax_aux=check_softmax_aux(args.softmax_aux, num_heads),
            dropout_seed=dropout_seed,
            softmax_scale=resolve_softmax_scale(args.softmax_scale, head_dim),
            causal=check_bool("causal", args.causal),
            sliding_window=normalize_sliding_window(args.sliding_window),
            logits_soft_cap=normalize_soft_cap(args.logits_soft_cap),
            dropout_prob=dropout_prob,
            precision=resolve_precision(args.precision, args.query.dtype),
        )


@public_function(FlashAttention)
def flash_attention(
    query: Float[jax.Array, "batch q_len num_heads head_dim"],
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"],
    bias: Float[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    *,
    attention_mask: Bool[jax.Array, "#batch #num_heads q_len kv_len"] | None = None,
    q_segment_ids: Int[jax.Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[jax.Array, "batch kv_len"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[jax.Array, ""] | None = None,
    cum_seqlens_q: Int[jax.Array, "num_seqs_plus_1"] | None = None,
    cum_seqlens_k: Int[jax.Array, "num_seqs_plus_1"] | None = None,
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = None,
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Exact softmax attention computed blockwise (memory O(S)); see the module docstring.

    Args:
        query: ``[batch, q_len, num_heads, head_dim]`` (float32, bfloat16 or float16).
        key: ``[batch, kv_len, num_kv_heads, head_dim]``; ``num_kv_heads`` divides ``num_heads``.
        value: ``[batch, kv_len, num_kv_heads, v_head_dim]``.
        bias: added to the logits, ``[batch or 1, num_heads or 1, q_len, kv_len]``; differentiable.
        attention_mask: bool ``[batch or 1, 1 or num_heads, q_len, kv_len]``, True = may attend.
        q_segment_ids, kv_segment_ids: int ``[batch, len]``; attend only within equal ids.
        softmax_scale: logit scale (default ``1/sqrt(head_dim)``).
        causal: key ``j`` visible to query ``i`` only if ``j <= i + kv_len - q_len``.
        sliding_window: ``w`` or ``(left, right)``: keys within ``[p - left, p + right]``.
        logits_soft_cap: ``c * tanh(s / c)`` on the scaled logits.
        dropout_prob, dropout_seed: attention dropout; the mask depends only on the seed and indices.
        cum_seqlens_q, cum_seqlens_k: int32 ``[num_seqs + 1]`` for packed varlen batches (batch 1).
        softmax_aux: attention-sink logits ``[num_heads]`` or ``[num_heads, num_sinks]``; differentiable.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        platform: ``"auto"`` or a platform name (``"xla"``, ``"triton"``, ``"pallas"``, ``"cuda"``).
        cfg: one implementation's config (e.g. ``ejkernel_triton.flash_attention.TritonFlashConfig``); it
            selects that implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[batch, q_len, num_heads, v_head_dim]`` in ``query``'s dtype.
    """
    return execute(FlashAttention(), **locals())
