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
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_array,
    check_broadcastable,
    check_cum_seqlens,
    check_dim,
    check_probability,
    check_same_dtype,
    describe,
    typechecked,
)
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

DEFAULT_DROPOUT_SEED = 0
"""Seed used when ``dropout_prob > 0`` and no ``dropout_seed`` is given (the same mask on every call)."""


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Block sizes for a backend; ``None`` fields mean "use your heuristic" (see docs/flash_attention.md)."""

    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str = "auto"
    backend: str = "any"


# ---- argument checks shared by the attention operations --------------------------------------------


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def resolve_softmax_scale(value: Any, head_dim: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_real(value) or not math.isfinite(float(value)):
        raise ValueError(f"softmax_scale must be a finite float or None, got {value!r}")
    return float(value)


def normalize_sliding_window(value: Any) -> tuple[int, int] | None:
    """``None``, an int ``w`` (-> ``(w, w)``) or ``(left, right)``; every size a non-negative int."""
    if value is None:
        return None
    pair = (value, value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0 for w in pair)
    ):
        raise ValueError(
            "sliding_window must be None, a non-negative int or a (left, right) pair of non-negative ints, "
            f"got {value!r}"
        )
    return int(pair[0]), int(pair[1])


def normalize_soft_cap(value: Any) -> float | None:
    if value is None:
        return None
    if not _is_real(value) or not float(value) > 0 or not math.isfinite(float(value)):
        raise ValueError(f"logits_soft_cap must be a positive finite float or None, got {value!r}")
    return float(value)


def check_qkv(query, key, value) -> tuple[int, int, int, int, int, int]:
    """Rank, dtype and shape agreement of query/key/value; returns (B, Sq, H, D, Skv, Hkv)."""
    check_array("query", query, rank=4, dtypes=FLOAT_DTYPES, what="[batch, q_len, num_heads, head_dim]")
    check_array("key", key, rank=4, dtypes=FLOAT_DTYPES, what="[batch, kv_len, num_kv_heads, head_dim]")
    check_array("value", value, rank=4, dtypes=FLOAT_DTYPES, what="[batch, kv_len, num_kv_heads, v_head_dim]")
    check_same_dtype("query", query, key=key, value=value)
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    check_dim("key", key, 0, batch, "batch of query")
    check_dim("key", key, 3, head_dim, "head_dim of query")
    check_dim("value", value, 0, batch, "batch of query")
    check_dim("value", value, 1, kv_len, "kv_len of key")
    check_dim("value", value, 2, num_kv_heads, "num_kv_heads of key")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"key has {num_kv_heads} kv heads, which must divide the {num_heads} heads of query (GQA/MQA); "
            f"got key {describe(key)}, query {describe(query)}"
        )
    return batch, q_len, num_heads, head_dim, kv_len, num_kv_heads


def check_bias(bias, batch: int, num_heads: int, q_len: int, kv_len: int) -> None:
    if bias is None:
        return
    check_array("bias", bias, rank=4, dtypes=FLOAT_DTYPES, what="[batch or 1, num_heads or 1, q_len, kv_len]")
    check_broadcastable("bias", bias, (batch, num_heads, q_len, kv_len), "[batch, num_heads, q_len, kv_len]")
    for axis, size, meaning in ((2, q_len, "q_len"), (3, kv_len, "kv_len")):
        check_dim("bias", bias, axis, size, meaning)


def normalize_attention_mask(mask, batch: int, num_heads: int, q_len: int, kv_len: int):
    """bool ``[B or 1, 1 or H, Sq, Skv]`` -> ``[B, 1 or H, Sq, Skv]``."""
    if mask is None:
        return None
    check_array("attention_mask", mask, rank=4, dtypes=(jnp.bool_,), what="[batch, 1 or num_heads, q_len, kv_len]")
    check_broadcastable("attention_mask", mask, (batch, num_heads, q_len, kv_len), "[batch, num_heads, q_len, kv_len]")
    for axis, size, meaning in ((2, q_len, "q_len"), (3, kv_len, "kv_len")):
        check_dim("attention_mask", mask, axis, size, meaning)
    if mask.shape[0] != batch:
        mask = jnp.broadcast_to(mask, (batch, *mask.shape[1:]))
    return mask


def normalize_segment_ids(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int):
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None
    if q_segment_ids is None or kv_segment_ids is None:
        if q_segment_ids is not None:
            given, name = q_segment_ids, "q_segment_ids"
        else:
            given, name = kv_segment_ids, "kv_segment_ids"
        if q_len != kv_len:
            missing = "kv_segment_ids" if name == "q_segment_ids" else "q_segment_ids"
            raise ValueError(
                f"{missing} is required when {name} is given and q_len ({q_len}) != kv_len ({kv_len}); "
                f"got {name} {describe(given)}"
            )
        q_segment_ids = kv_segment_ids = given
    check_array("q_segment_ids", q_segment_ids, rank=2, dtypes=INT_DTYPES, what="[batch, q_len]")
    check_array("kv_segment_ids", kv_segment_ids, rank=2, dtypes=INT_DTYPES, what="[batch, kv_len]")
    check_dim("q_segment_ids", q_segment_ids, 0, batch, "batch of query")
    check_dim("q_segment_ids", q_segment_ids, 1, q_len, "q_len of query")
    check_dim("kv_segment_ids", kv_segment_ids, 0, batch, "batch of key")
    check_dim("kv_segment_ids", kv_segment_ids, 1, kv_len, "kv_len of key")
    return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def normalize_cum_seqlens(cum_seqlens_q, cum_seqlens_k, batch: int, q_len: int, kv_len: int):
    if cum_seqlens_q is None and cum_seqlens_k is None:
        return None, None
    if cum_seqlens_q is None or cum_seqlens_k is None:
        given = "cum_seqlens_q" if cum_seqlens_q is not None else "cum_seqlens_k"
        raise ValueError(f"cum_seqlens_q and cum_seqlens_k must be given together; got only {given}")
    if batch != 1:
        raise ValueError(
            f"with cum_seqlens_q/cum_seqlens_k the sequences are packed along axis 1 and batch must be 1; "
            f"got query batch {batch}"
        )
    check_cum_seqlens("cum_seqlens_q", cum_seqlens_q, q_len, "q_len of the packed query")
    check_cum_seqlens("cum_seqlens_k", cum_seqlens_k, kv_len, "kv_len of the packed key")
    if cum_seqlens_q.shape != cum_seqlens_k.shape:
        raise ValueError(
            f"cum_seqlens_q and cum_seqlens_k must both have num_seqs + 1 entries; got cum_seqlens_q "
            f"{describe(cum_seqlens_q)}, cum_seqlens_k {describe(cum_seqlens_k)}"
        )
    return cum_seqlens_q.astype(jnp.int32), cum_seqlens_k.astype(jnp.int32)


def check_softmax_aux(softmax_aux, num_heads: int):
    if softmax_aux is None:
        return None
    what = "(sink logits [num_heads] or [num_heads, num_sinks])"
    check_array("softmax_aux", softmax_aux, dtypes=FLOAT_DTYPES, what=what)
    if softmax_aux.ndim not in (1, 2) or softmax_aux.shape[0] != num_heads:
        raise ValueError(
            f"softmax_aux must be [num_heads] or [num_heads, num_sinks] with num_heads = {num_heads}, "
            f"got {describe(softmax_aux)}"
        )
    return softmax_aux


def normalize_dropout(dropout_prob: Any, dropout_seed: Any) -> tuple[float, Any]:
    check_probability("dropout_prob", dropout_prob)
    dropout_prob = float(dropout_prob)
    if dropout_prob == 0.0:
        return 0.0, None
    if dropout_seed is None:
        return dropout_prob, DEFAULT_DROPOUT_SEED
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        return dropout_prob, int(dropout_seed)
    if hasattr(dropout_seed, "dtype") and jnp.issubdtype(dropout_seed.dtype, jnp.integer) and dropout_seed.ndim == 0:
        return dropout_prob, dropout_seed  # a traced seed (varies per step under jit)
    raise ValueError(f"dropout_seed must be an int or an integer scalar array, got {describe(dropout_seed)}")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


# ---- the operation ---------------------------------------------------------------------------------


class FlashAttention(RegistryOperation):
    """Exact attention, blockwise (see the module docstring); run it with an executor or call
    :func:`flash_attention`."""

    algorithm = "flash_attention"
    config_type = FlashAttentionConfig

    def validate(
        self,
        query,
        key,
        value,
        bias=None,
        *,
        attention_mask=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        softmax_scale=None,
        causal=False,
        sliding_window=None,
        logits_soft_cap=None,
        dropout_prob=0.0,
        dropout_seed=None,
        cum_seqlens_q=None,
        cum_seqlens_k=None,
        softmax_aux=None,
    ):
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(query, key, value)
        check_bias(bias, batch, num_heads, q_len, kv_len)
        dropout_prob, dropout_seed = normalize_dropout(dropout_prob, dropout_seed)
        q_segment_ids, kv_segment_ids = normalize_segment_ids(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
        cum_seqlens_q, cum_seqlens_k = normalize_cum_seqlens(cum_seqlens_q, cum_seqlens_k, batch, q_len, kv_len)
        kwargs = dict(
            attention_mask=normalize_attention_mask(attention_mask, batch, num_heads, q_len, kv_len),
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            softmax_scale=resolve_softmax_scale(softmax_scale, head_dim),
            causal=check_bool("causal", causal),
            sliding_window=normalize_sliding_window(sliding_window),
            logits_soft_cap=normalize_soft_cap(logits_soft_cap),
            dropout_prob=dropout_prob,
            dropout_seed=dropout_seed,
            cum_seqlens_q=cum_seqlens_q,
            cum_seqlens_k=cum_seqlens_k,
            softmax_aux=check_softmax_aux(softmax_aux, num_heads),
        )
        return (query, key, value, bias), kwargs


@typechecked
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
    platform: str = "auto",
    cfg: FlashAttentionConfig | None = None,
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
        platform: ``"auto"`` or a platform name (``"xla"``, ``"triton"``, ``"pallas"``, ``"cuda"``).
        cfg: a :class:`FlashAttentionConfig`, or None for the backend's heuristic.

    Returns:
        ``[batch, q_len, num_heads, v_head_dim]`` in ``query``'s dtype.
    """
    return execute(
        FlashAttention(),
        query,
        key,
        value,
        bias,
        attention_mask=attention_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        dropout_prob=dropout_prob,
        dropout_seed=dropout_seed,
        cum_seqlens_q=cum_seqlens_q,
        cum_seqlens_k=cum_seqlens_k,
        softmax_aux=softmax_aux,
        platform=platform,
        cfg=cfg,
    )
