"""``page_attention``: decode attention over a paged KV cache (one query token per sequence).

Core validates the public call into one frozen :class:`PageAttentionCall`, all a backend sees:

- ``query`` ``[num_seqs, num_heads, head_dim]``; ``key_cache``/``value_cache``
  ``[num_blocks, num_kv_heads, block_size, head_dim]`` (query's dtype, or both one quantized dtype:
  float8_e4m3fn, float8_e5m2, int8); ``context_lens`` int32 ``[num_seqs]``;
  ``block_tables`` int32 ``[num_seqs, max_blocks]``. ``num_heads % num_kv_heads == 0``: query head ``h``
  reads kv head ``h // (num_heads // num_kv_heads)``.
- Sequence ``s`` has ``L = min(context_lens[s], max_context_len)`` tokens; token ``j`` lives in page
  ``block_tables[s, j // block_size]`` at row ``j % block_size``. Every ``j < L`` is visible.
- Quantized caches (beyond the original library): the key of token ``j`` in page ``p``, kv head ``h`` is
  ``key_cache[p, h, j % block_size] * key_scale[p, h]`` (values likewise with ``value_scale``); the call holds
  each scale as float32 ``[num_kv_heads]`` (given as a scalar or per kv head), ``[num_blocks, num_kv_heads]``
  (given per page and kv head) or None (1). Scales work on any cache dtype.
- Logits ``attn_scale * <q, k>`` in float32, then ``c * tanh(x / c)`` with a soft cap ``c``; softmax over
  the visible tokens; ``L == 0`` gives zeros. Block-table entries past ``ceil(L / block_size)`` are never
  read semantically (any value allowed). Output in ``query``'s dtype.
- Page ids that are read are checked when ``block_tables`` and ``context_lens`` are concrete (a ValueError
  naming ``block_tables`` and the offending entry); traced tables are the caller's contract: the kernels clamp
  an out-of-range id into ``[0, num_blocks)`` (some other page is read: wrong but finite, never a fault).

Gradients: an inference operation. The XLA backend is differentiable w.r.t. ``query``, ``key_cache`` and
``value_cache`` (autodiff through its blockwise loop); other backends may be forward-only.

The full specification is ``docs/ops/page_attention.md``. The original library's ``num_splits``,
``pages_per_compute_block``, ``megacore_mode`` and ``inline_seq_dim`` (tuning hints) and ``mask_value``
are accepted for compatibility and change nothing: tuning goes through an implementation's ``cfg``
(e.g. ``ejkernel_xla.page_attention.XlaPageAttentionConfig``); masked keys are always excluded exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jaxtyping import Float, Int, Shaped

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    INT_DTYPES,
    check_array,
    check_decode_inputs,
    check_dim,
    check_page_indices,
    check_positive_int,
    cache_scale,
    check_values_in,
    concrete,
    normalize_soft_cap,
    resolve_softmax_scale,
)

DEFAULT_MASK_VALUE = -2.381976426469702e38


@canonical_call
class PageAttentionCall:
    """A validated ``page_attention`` call: what every backend receives (defaults resolved, see above)."""

    query: Float[jax.Array, "num_seqs num_heads head_dim"] = array_field()
    key_cache: Shaped[jax.Array, "num_blocks num_kv_heads block_size head_dim"] = array_field()
    value_cache: Shaped[jax.Array, "num_blocks num_kv_heads block_size head_dim"] = array_field()
    context_lens: Int[jax.Array, "num_seqs"] = array_field()
    """int32, values >= 0 (checked when concrete)."""
    block_tables: Int[jax.Array, "num_seqs max_blocks"] = array_field()
    """int32; the entries that are read are page indices (checked when concrete)."""
    key_scale: Float[jax.Array, "*num_blocks num_kv_heads"] | None = array_field(default=None)
    """float32 dequantization scale of ``key_cache``: per kv head ``[num_kv_heads]`` or per page and kv head
    ``[num_blocks, num_kv_heads]``; None: 1."""
    value_scale: Float[jax.Array, "*num_blocks num_kv_heads"] | None = array_field(default=None)
    """As ``key_scale``, for ``value_cache``."""
    attn_scale: float = 1.0
    max_context_len: int = 1
    """Caps every context length; at most ``max_blocks * block_size``."""
    attn_logits_soft_cap: float | None = None
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


# ---- the operation ---------------------------------------------------------------------------------


class PageAttention(RegistryOperation):
    """Decode attention over a paged KV cache (see the module docstring)."""

    algorithm = "page_attention"

    def canonicalize(self, args: Arguments) -> PageAttentionCall:
        query, key_cache, value_cache = args.query, args.key_cache, args.value_cache
        context_lens, block_tables, max_context_len = args.context_lens, args.block_tables, args.max_context_len
        check_decode_inputs(
            query, "key_cache", key_cache, "value_cache", value_cache, "[num_seqs, num_heads, head_dim]",
            ("num_blocks", "num_kv_heads", "block_size", "head_dim"), kv_heads_axis=1, quantized_cache=True,
        )
        num_seqs, _, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        check_array("context_lens", context_lens, rank=1, dtypes=INT_DTYPES, what="[num_seqs]")
        check_dim("context_lens", context_lens, 0, num_seqs, "num_seqs of query")
        check_array("block_tables", block_tables, rank=2, dtypes=INT_DTYPES, what="[num_seqs, max_blocks]")
        check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs of query")
        max_blocks = block_tables.shape[1]
        if max_context_len is None:
            max_context_len = max_blocks * block_size
        check_positive_int("max_context_len", max_context_len)
        max_context_len = min(int(max_context_len), max_blocks * block_size)
        check_values_in("context_lens", context_lens, 0)
        lengths = concrete(context_lens)
        if lengths is not None:
            check_page_indices(
                "block_tables", block_tables, np.minimum(lengths, max_context_len), block_size, num_blocks
            )
        return args.build(
            PageAttentionCall,
            context_lens=context_lens.astype("int32"),
            block_tables=block_tables.astype("int32"),
            key_scale=cache_scale("key_scale", args.key_scale, num_kv_heads, num_blocks),
            value_scale=cache_scale("value_scale", args.value_scale, num_kv_heads, num_blocks),
            attn_scale=resolve_softmax_scale(args.attn_scale, head_dim, name="attn_scale"),
            max_context_len=max_context_len,
            attn_logits_soft_cap=normalize_soft_cap(args.attn_logits_soft_cap, name="attn_logits_soft_cap"),
            precision=resolve_precision(args.precision, query.dtype),
        )


@public_function(PageAttention)
def page_attention(
    query: Float[jax.Array, "num_seqs num_heads head_dim"],
    key_cache: Shaped[jax.Array, "num_blocks num_kv_heads block_size head_dim"],
    value_cache: Shaped[jax.Array, "num_blocks num_kv_heads block_size head_dim"],
    context_lens: Int[jax.Array, "num_seqs"],
    block_tables: Int[jax.Array, "num_seqs max_blocks"],
    attn_scale: float | None = None,
    max_context_len: int | None = None,
    num_splits: int = 0,
    mask_value: float = DEFAULT_MASK_VALUE,
    attn_logits_soft_cap: float | None = None,
    pages_per_compute_block: int | None = None,
    megacore_mode: str | None = None,
    inline_seq_dim: bool = True,
    platform: str = "auto",
    *,
    precision: str | jax.lax.Precision | None = None,
    key_scale: Float[jax.Array, "..."] | float | None = None,
    value_scale: Float[jax.Array, "..."] | float | None = None,
    cfg: Any = None,
) -> Float[jax.Array, "num_seqs num_heads head_dim"]:
    """Attention of each sequence's one new query token over its paged KV cache.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, in ``query``'s dtype or
            both quantized (float8_e4m3fn, float8_e5m2 or int8; dequantized by ``key_scale``/``value_scale``).
        context_lens: int ``[num_seqs]``, tokens cached for each sequence (0: output zeros).
        block_tables: int ``[num_seqs, max_blocks]``, physical page of each logical page.
        attn_scale: logit scale (default ``1/sqrt(head_dim)``).
        max_context_len: caps every context length (default: ``max_blocks * block_size``).
        attn_logits_soft_cap: ``c * tanh(x / c)`` on the logits when given.
        num_splits, pages_per_compute_block, megacore_mode, inline_seq_dim, mask_value: accepted for
            compatibility with the original library; no effect (tune with ``cfg``).
        platform: ``"auto"`` or a platform name (``"xla"``, ``"pallas"``, ...).
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs. Keyword-only: the original
            positional order ends at ``platform``.
        key_scale, value_scale: dequantization scales of the caches (keyword-only, beyond the original
            library): a scalar, ``[num_kv_heads]`` or ``[num_blocks, num_kv_heads]``; the cache's entries are
            multiplied by them (None: 1). A backend that cannot apply them refuses the call.
        cfg: one implementation's config (e.g. ``ejkernel_xla.page_attention.XlaPageAttentionConfig``); it
            selects that implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query``'s dtype.
    """
    del num_splits, mask_value, pages_per_compute_block, megacore_mode, inline_seq_dim  # see the module docstring
    return execute(PageAttention(), **locals())
