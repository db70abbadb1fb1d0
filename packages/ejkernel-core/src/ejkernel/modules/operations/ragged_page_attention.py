"""``ragged_page_attention``: packed (ragged) query tokens of many sequences over a paged KV cache.

Core validates the public call into one frozen :class:`RaggedPageAttentionCall`, all a backend sees:

- ``queries`` ``[total_tokens, num_q_heads, head_dim]``; ``kv_pages``
  ``[num_pages, page_size, 2 * num_kv_heads, head_dim]`` with K and V interleaved on the head axis
  (``2k``: key of kv head ``k``, ``2k + 1``: its value), in ``queries``' dtype or quantized (float8_e4m3fn,
  float8_e5m2, int8); ``context_lens`` int32 ``[max_num_seqs]``;
  ``block_tables`` int32 ``[max_num_seqs, pages_per_seq]``; ``query_start_loc`` int32
  ``[max_num_seqs + 1]``; ``num_seqs`` int32 ``[1]`` (active sequences); ``softmax_aux`` (sinks) float
  ``[num_q_heads]`` or ``[num_q_heads, num_sinks]`` or None.
- Sequence ``s < num_seqs`` owns rows ``[query_start_loc[s], query_start_loc[s+1])``; its ``q_len`` queries
  are its last ``q_len`` tokens: local query ``i`` sits at ``p = context_lens[s] - q_len + i``. Key ``j``
  is visible when ``j < context_lens[s]``, ``j <= p`` and (window ``w``) ``p - j < w``.
- Quantized caches (beyond the original library, as ``page_attention``'s): the key of kv head ``h`` in page ``p``
  is ``kv_pages[p, :, 2h] * key_scale[p, h]``, its value ``kv_pages[p, :, 2h + 1] * value_scale[p, h]``; the
  call holds each scale as float32 ``[num_kv_heads]`` (given as a scalar or per kv head),
  ``[num_pages, num_kv_heads]`` (per page and kv head) or None (1). Scales work on any cache dtype.
- Logits ``softmax_scale * <q, k>`` in float32, soft cap ``c * tanh(x / c)``; sinks join the softmax
  denominator only. Rows past ``query_start_loc[num_seqs]`` give zeros. Output in ``queries``' dtype.
- Page ids that active sequences read are checked when ``block_tables``, ``context_lens``,
  ``query_start_loc`` and ``num_seqs`` are concrete (a ValueError naming ``block_tables`` and the offending
  entry); traced tables are the caller's contract: the kernels clamp an out-of-range id into
  ``[0, num_pages)`` (some other page is read: wrong but finite, never a fault).

Gradients: an inference operation. The XLA backend is differentiable w.r.t. ``queries``, ``kv_pages`` and
``softmax_aux``; other backends may be forward-only.

The full specification is ``docs/ops/ragged_page_attention.md``. ``compute_dtype``, ``optimized``,
``mask_value`` and ``vmem_limit_bytes`` are accepted for compatibility with the original library and
change nothing (tuning goes through an implementation's ``cfg``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int, Shaped

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    QUANTIZED_CACHE_DTYPES,
    cache_scale,
    check_array,
    check_cum_seqlens,
    check_dim,
    check_gqa,
    check_page_indices,
    check_positive_int,
    check_same_dtype,
    check_softmax_aux,
    check_values_in,
    concrete,
    describe,
    is_array,
    is_quantized_cache,
    normalize_soft_cap,
    resolve_softmax_scale,
)


@canonical_call
class RaggedPageAttentionCall:
    """A validated ``ragged_page_attention`` call: what every backend receives (see above)."""

    queries: Float[jax.Array, "total_tokens num_q_heads head_dim"] = array_field()
    kv_pages: Shaped[jax.Array, "num_pages page_size num_combined_kv_heads head_dim"] = array_field()
    context_lens: Int[jax.Array, "max_num_seqs"] = array_field()
    """int32, values >= 0 and >= each sequence's query count (checked when concrete)."""
    block_tables: Int[jax.Array, "max_num_seqs pages_per_seq"] = array_field()
    """int32; the entries of active sequences that are read are page indices (checked when concrete)."""
    query_start_loc: Int[jax.Array, "max_num_seqs_plus_one"] = array_field()
    """int32, starting at 0, non-decreasing, at most ``total_tokens``."""
    num_seqs: Int[jax.Array, "1"] = array_field()
    """int32 ``[1]``: the active sequences, in ``[0, max_num_seqs]``."""
    softmax_aux: Float[jax.Array, "num_q_heads"] | Float[jax.Array, "num_q_heads num_sinks"] | None = array_field()
    key_scale: Float[jax.Array, "*num_pages num_kv_heads"] | None = array_field(default=None)
    """float32 dequantization scale of the keys: per kv head ``[num_kv_heads]`` or per page and kv head
    ``[num_pages, num_kv_heads]``; None: 1."""
    value_scale: Float[jax.Array, "*num_pages num_kv_heads"] | None = array_field(default=None)
    """As ``key_scale``, for the values."""
    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    sliding_window: int | None = None
    """A query sees at most this many keys, itself included."""
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


def normalize_num_seqs(value: Any, max_num_seqs: int) -> jax.Array:
    """``num_seqs`` as int32 ``[1]``: a Python int, or an int array with one element."""
    if is_array(value):
        check_array("num_seqs", value, dtypes=INT_DTYPES, what="(number of active sequences: an int or int array [1])")
        if value.size != 1:
            raise ValueError(f"num_seqs must hold one value (an int or int array [1]), got {describe(value)}")
        count = concrete(value)
        array = jnp.reshape(value, (1,)).astype(jnp.int32)
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        count = np.asarray(value)
        array = jnp.full((1,), value, jnp.int32)
    else:
        raise ValueError(f"num_seqs must be an int or an int array [1], got {value!r}")
    if count is not None and not 0 <= int(count.reshape(-1)[0]) <= max_num_seqs:
        raise ValueError(
            f"num_seqs must be in [0, {max_num_seqs}] (max_num_seqs = len(context_lens)), got {int(count.reshape(-1)[0])}"
        )
    return array


def check_window(name: str, value: Any) -> int | None:
    if value is None:
        return None
    check_positive_int(name, value)
    return int(value)


class RaggedPageAttention(RegistryOperation):
    """Packed queries over a paged KV cache (see the module docstring)."""

    algorithm = "ragged_page_attention"

    def canonicalize(self, args: Arguments) -> RaggedPageAttentionCall:
        queries, kv_pages, context_lens = args.queries, args.kv_pages, args.context_lens
        block_tables, query_start_loc = args.block_tables, args.query_start_loc
        check_array("queries", queries, rank=3, dtypes=FLOAT_DTYPES, what="[total_tokens, num_q_heads, head_dim]")
        check_array(
            "kv_pages", kv_pages, rank=4, dtypes=FLOAT_DTYPES + QUANTIZED_CACHE_DTYPES,
            what="[num_pages, page_size, 2 * num_kv_heads, head_dim]",
        )
        if not is_quantized_cache(kv_pages):
            check_same_dtype("queries", queries, kv_pages=kv_pages)
        total_tokens, num_heads, head_dim = queries.shape
        num_pages, page_size, combined_heads, _ = kv_pages.shape
        check_dim("kv_pages", kv_pages, 3, head_dim, "head_dim of queries")
        if combined_heads % 2:
            raise ValueError(
                f"kv_pages must interleave keys and values on axis 2 (2 * num_kv_heads entries), got an odd "
                f"{combined_heads}: {describe(kv_pages)}"
            )
        check_gqa("queries", num_heads, "kv_pages", combined_heads // 2, kv_pages)
        check_array("context_lens", context_lens, rank=1, dtypes=INT_DTYPES, what="[max_num_seqs]")
        max_num_seqs = context_lens.shape[0]
        check_array("block_tables", block_tables, rank=2, dtypes=INT_DTYPES, what="[max_num_seqs, pages_per_seq]")
        check_dim("block_tables", block_tables, 0, max_num_seqs, "max_num_seqs = len(context_lens)")
        check_cum_seqlens("query_start_loc", query_start_loc, total_tokens, "total_tokens of queries")
        check_dim("query_start_loc", query_start_loc, 0, max_num_seqs + 1, "max_num_seqs + 1")
        num_seqs = normalize_num_seqs(args.num_seqs, max_num_seqs)
        softmax_aux = check_softmax_aux(args.softmax_aux, num_heads)
        check_values_in("context_lens", context_lens, 0)
        starts, lengths, active = concrete(query_start_loc), concrete(context_lens), concrete(num_seqs)
        if starts is not None and lengths is not None and active is not None:
            count = int(active[0])
            q_lens = np.diff(starts)[:count]
            if (q_lens > lengths[:count]).any():
                s = int(np.argmax(q_lens > lengths[:count]))
                raise ValueError(
                    f"query_start_loc gives sequence {s} {int(q_lens[s])} query tokens but context_lens[{s}] = "
                    f"{int(lengths[s])}: the new tokens must already be in the cache (q_len <= context_len)"
                )
            live = np.where(np.arange(max_num_seqs) < count, lengths, 0)
            check_page_indices("block_tables", block_tables, live, page_size, num_pages)
        return args.build(
            RaggedPageAttentionCall,
            context_lens=context_lens.astype(jnp.int32),
            block_tables=block_tables.astype(jnp.int32),
            query_start_loc=query_start_loc.astype(jnp.int32),
            num_seqs=num_seqs,
            softmax_aux=softmax_aux,
            key_scale=cache_scale("key_scale", args.key_scale, combined_heads // 2, num_pages, "num_pages"),
            value_scale=cache_scale("value_scale", args.value_scale, combined_heads // 2, num_pages, "num_pages"),
            softmax_scale=resolve_softmax_scale(args.softmax_scale, head_dim),
            logits_soft_cap=normalize_soft_cap(args.logits_soft_cap),
            sliding_window=check_window("sliding_window", args.sliding_window),
            precision=resolve_precision(args.precision, queries.dtype),
        )


@public_function(RaggedPageAttention)
def ragged_page_attention(
    queries: Float[jax.Array, "total_tokens num_q_heads head_dim"],
    kv_pages: Shaped[jax.Array, "num_pages page_size num_combined_kv_heads head_dim"],
    context_lens: Int[jax.Array, "max_num_seqs"],
    block_tables: Int[jax.Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[jax.Array, "max_num_seqs_plus_one"],
    num_seqs: Int[jax.Array, "*one"] | int,
    softmax_aux: Float[jax.Array, "num_q_heads"] | Float[jax.Array, "num_q_heads num_sinks"] | None = None,
    /,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    compute_dtype: Any = jnp.bfloat16,
    optimized: bool = False,
    sliding_window: int | None = None,
    mask_value: float | None = None,
    vmem_limit_bytes: int | None = None,
    precision: str | jax.lax.Precision | None = None,
    key_scale: Float[jax.Array, "..."] | float | None = None,
    value_scale: Float[jax.Array, "..."] | float | None = None,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "total_tokens num_q_heads head_dim"]:
    """Attention of packed query tokens over their sequences' paged KV cache (mixed prefill/decode).

    Args:
        queries: ``[total_tokens, num_q_heads, head_dim]``, sequences packed back to back.
        kv_pages: ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``, K/V interleaved on axis 2, in
            ``queries``' dtype or quantized (float8_e4m3fn, float8_e5m2 or int8; dequantized by
            ``key_scale``/``value_scale``).
        context_lens: int ``[max_num_seqs]``, kv length of each sequence (its new tokens included).
        block_tables: int ``[max_num_seqs, pages_per_seq]``, physical page of each logical page.
        query_start_loc: int ``[max_num_seqs + 1]``, row offsets of each sequence's queries.
        num_seqs: active sequences (int or int array ``[1]``).
        softmax_aux: attention sinks ``[num_q_heads]`` or ``[num_q_heads, num_sinks]``.
        softmax_scale: logit scale (default ``1/sqrt(head_dim)``).
        logits_soft_cap: ``c * tanh(x / c)`` on the logits when given.
        sliding_window: each query sees at most this many keys (itself included).
        compute_dtype, optimized, mask_value, vmem_limit_bytes: accepted for compatibility with the
            original library; no effect (tune with ``cfg``).
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        key_scale, value_scale: dequantization scales of the keys and values (beyond the original library): a
            scalar, ``[num_kv_heads]`` or ``[num_pages, num_kv_heads]``; the cache's entries are multiplied by
            them (None: 1). A backend that cannot apply them refuses the call.
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config (e.g.
            ``ejkernel_xla.ragged_page_attention.XlaRaggedPageAttentionConfig``); it selects that
            implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[total_tokens, num_q_heads, head_dim]`` in ``queries``' dtype.
    """
    del compute_dtype, optimized, mask_value, vmem_limit_bytes  # see the module docstring
    return execute(RaggedPageAttention(), **locals())
