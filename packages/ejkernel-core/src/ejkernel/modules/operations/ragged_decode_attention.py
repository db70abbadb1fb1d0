"""``ragged_decode_attention``: one decode query per sequence over a dense KV buffer, each sequence
reading only its own slice ``[sequence_start, sequence_end)``.

Core validates the public call into one frozen :class:`RaggedDecodeAttentionCall`, all a backend sees:

- ``query`` ``[batch, num_heads, head_dim]``; ``key``/``value`` ``[batch, seq_len, num_kv_heads, head_dim]``
  (query's dtype, or both one quantized dtype: float8_e4m3fn, float8_e5m2, int8, dequantized by ``key_scale``
  / ``value_scale``: float32 ``[num_kv_heads]`` in the call, given as a scalar or per kv head, None: 1;
  ``num_heads % num_kv_heads == 0``, query head ``h`` reads kv head ``h // (num_heads //
  num_kv_heads)``); ``sequence_start``/``sequence_end`` int32 ``[batch]``; ``softmax_aux`` (sinks) float
  ``[num_heads]`` or ``[num_heads, num_sinks]`` or None.
- The query is the token at ``p = sequence_end - 1``. Key ``j`` is visible when
  ``sequence_start <= j < sequence_end`` and, with ``sliding_window = (left, right)``,
  ``p - left <= j <= p + right``. An empty range gives zeros.
- Logits ``softmax_scale * <q, k>`` in float32 (default scale ``1/sqrt(head_dim)``), soft cap
  ``c * tanh(x / c)``; sinks join the softmax denominator only. Output in ``query``'s dtype.

Gradients: an inference operation; the XLA backend is differentiable w.r.t. ``query``, ``key``, ``value``
and ``softmax_aux`` (autodiff through its blockwise loop); other backends may be forward-only.
The full specification is ``docs/ops/ragged_decode_attention.md``. ``block_size`` (a tuning hint of the
original library) is accepted for compatibility and changes nothing: tune with an implementation's ``cfg``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Float, Int, Shaped

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    INT_DTYPES,
    cache_scale,
    check_array,
    check_decode_inputs,
    check_dim,
    check_softmax_aux,
    check_values_in,
    normalize_sliding_window,
    normalize_soft_cap,
    resolve_softmax_scale,
)


@canonical_call
class RaggedDecodeAttentionCall:
    """A validated ``ragged_decode_attention`` call: what every backend receives (see above)."""

    query: Float[jax.Array, "batch num_heads head_dim"] = array_field()
    key: Shaped[jax.Array, "batch seq_len num_kv_heads head_dim"] = array_field()
    value: Shaped[jax.Array, "batch seq_len num_kv_heads head_dim"] = array_field()
    sequence_start: Int[jax.Array, "batch"] = array_field()
    """int32 in ``[0, seq_len]`` (checked when concrete)."""
    sequence_end: Int[jax.Array, "batch"] = array_field()
    """int32 in ``[0, seq_len]``, exclusive (checked when concrete)."""
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = array_field()
    key_scale: Float[jax.Array, "num_kv_heads"] | None = array_field(default=None)
    """float32 dequantization scale of ``key`` per kv head; None: 1."""
    value_scale: Float[jax.Array, "num_kv_heads"] | None = array_field(default=None)
    """As ``key_scale``, for ``value``."""
    softmax_scale: float = 1.0
    sliding_window: tuple[int, int] | None = None
    """``(left, right)`` around the query's position."""
    logit_soft_cap: float | None = None
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


class RaggedDecodeAttention(RegistryOperation):
    """Decode attention over per-sequence slices of a dense KV buffer (see the module docstring)."""

    algorithm = "ragged_decode_attention"

    def canonicalize(self, args: Arguments) -> RaggedDecodeAttentionCall:
        query, key, value, sequence_start, sequence_end = (
            args.query, args.key, args.value, args.sequence_start, args.sequence_end
        )
        check_decode_inputs(
            query, "key", key, "value", value, "[batch, num_heads, head_dim]",
            ("batch", "seq_len", "num_kv_heads", "head_dim"), kv_heads_axis=2, quantized_cache=True,
        )
        batch, num_heads, head_dim = query.shape
        check_dim("key", key, 0, batch, "batch of query")
        for name, bound in (("sequence_start", sequence_start), ("sequence_end", sequence_end)):
            check_array(name, bound, rank=1, dtypes=INT_DTYPES, what="[batch]")
            check_dim(name, bound, 0, batch, "batch of query")
        for name, bound in (("sequence_start", sequence_start), ("sequence_end", sequence_end)):
            check_values_in(name, bound, 0, key.shape[1], "seq_len of key")
        return args.build(
            RaggedDecodeAttentionCall,
            sequence_start=sequence_start.astype(jnp.int32),
            sequence_end=sequence_end.astype(jnp.int32),
            softmax_aux=check_softmax_aux(args.softmax_aux, num_heads),
            key_scale=cache_scale("key_scale", args.key_scale, key.shape[2]),
            value_scale=cache_scale("value_scale", args.value_scale, key.shape[2]),
            softmax_scale=resolve_softmax_scale(args.softmax_scale, head_dim),
            sliding_window=normalize_sliding_window(args.sliding_window),
            logit_soft_cap=normalize_soft_cap(args.logit_soft_cap, name="logit_soft_cap"),
            precision=resolve_precision(args.precision, query.dtype),
        )


@public_function(RaggedDecodeAttention)
def ragged_decode_attention(
    query: Float[jax.Array, "batch num_heads head_dim"],
    key: Shaped[jax.Array, "batch seq_len num_kv_heads head_dim"],
    value: Shaped[jax.Array, "batch seq_len num_kv_heads head_dim"],
    sequence_start: Int[jax.Array, "batch"],
    sequence_end: Int[jax.Array, "batch"],
    softmax_scale: float | None = None,
    block_size: int | None = None,
    sliding_window: tuple[int, int] | int | None = None,
    logit_soft_cap: float | None = None,
    softmax_aux: Float[jax.Array, "num_heads"] | Float[jax.Array, "num_heads num_sinks"] | None = None,
    platform: str = "auto",
    *,
    precision: str | jax.lax.Precision | None = None,
    key_scale: Float[jax.Array, "..."] | float | None = None,
    value_scale: Float[jax.Array, "..."] | float | None = None,
    cfg: Any = None,
) -> Float[jax.Array, "batch num_heads head_dim"]:
    """Decode attention of each sequence's query over ``key/value[b, sequence_start[b]:sequence_end[b]]``.

    Args:
        query: ``[batch, num_heads, head_dim]``, the newest token (at ``sequence_end - 1``).
        key, value: ``[batch, seq_len, num_kv_heads, head_dim]``, in ``query``'s dtype or both quantized
            (float8_e4m3fn, float8_e5m2 or int8; dequantized by ``key_scale``/``value_scale``).
        sequence_start, sequence_end: int ``[batch]``, the valid key range (end exclusive).
        softmax_scale: logit scale (default ``1/sqrt(head_dim)``).
        block_size: accepted for compatibility with the original library; no effect (tune with ``cfg``).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``, around the query's position.
        logit_soft_cap: ``c * tanh(x / c)`` on the logits when given.
        softmax_aux: attention sinks ``[num_heads]`` or ``[num_heads, num_sinks]``.
        platform: ``"auto"`` or a platform name.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs. Keyword-only: the original
            positional order ends at ``platform``.
        key_scale, value_scale: dequantization scales of ``key``/``value`` (keyword-only, beyond the original
            library): a scalar or ``[num_kv_heads]``; the entries are multiplied by them (None: 1). A backend
            that cannot apply them refuses the call.
        cfg: one implementation's config (e.g.
            ``ejkernel_xla.ragged_decode_attention.XlaRaggedDecodeAttentionConfig``); it selects that
            implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[batch, num_heads, head_dim]`` in ``query``'s dtype.
    """
    del block_size  # see the module docstring
    return execute(RaggedDecodeAttention(), **locals())
