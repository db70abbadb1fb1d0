"""``page_attention``: decode attention over a paged KV cache (one query token per sequence).

Canonical call every backend receives (validated and normalized here)::

    page_attention(query, key_cache, value_cache, context_lens, block_tables, *,
                   attn_scale: float, max_context_len: int, attn_logits_soft_cap: float | None, cfg)

- ``query`` ``[num_seqs, num_heads, head_dim]``; ``key_cache``/``value_cache``
  ``[num_blocks, num_kv_heads, block_size, head_dim]`` (same dtype); ``context_lens`` int32 ``[num_seqs]``;
  ``block_tables`` int32 ``[num_seqs, max_blocks]``. ``num_heads % num_kv_heads == 0``: query head ``h``
  reads kv head ``h // (num_heads // num_kv_heads)``.
- Sequence ``s`` has ``L = min(context_lens[s], max_context_len)`` tokens; token ``j`` lives in page
  ``block_tables[s, j // block_size]`` at row ``j % block_size``. Every ``j < L`` is visible.
- Logits ``attn_scale * <q, k>`` in float32, then ``c * tanh(x / c)`` with a soft cap ``c``; softmax over
  the visible tokens; ``L == 0`` gives zeros. Block-table entries past ``ceil(L / block_size)`` are never
  read semantically (any value allowed). Output in ``query``'s dtype.

Gradients: an inference operation. The XLA backend is differentiable w.r.t. ``query``, ``key_cache`` and
``value_cache`` (autodiff through its blockwise loop); other backends may be forward-only.

The full specification is ``docs/ops/page_attention.md``. The original library's ``num_splits``,
``pages_per_compute_block``, ``megacore_mode`` and ``inline_seq_dim`` are tuning hints folded into the
config; ``mask_value`` is accepted for compatibility (masked keys are always excluded exactly).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_array,
    check_dim,
    check_positive_int,
    check_same_dtype,
    describe,
    typechecked,
)

DEFAULT_MASK_VALUE = -2.381976426469702e38


@dataclasses.dataclass(frozen=True)
class PageAttentionConfig:
    """Tuning knobs; none of them changes the result (see ``docs/ops/page_attention.md``)."""

    pages_per_compute_block: int | None = None
    num_splits: int | None = None
    megacore_mode: str | None = None
    inline_seq_dim: bool = True
    num_warps: int | None = None
    num_stages: int | None = None
    platform: str = "auto"
    backend: str = "any"


# ---- checks shared by the paged operations ---------------------------------------------------------


def check_gqa(query_heads_name: str, num_heads: int, kv_name: str, num_kv_heads: int, kv_array: Any) -> None:
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{kv_name} has {num_kv_heads} kv heads, which must divide the {num_heads} heads of "
            f"{query_heads_name} (GQA/MQA); got {describe(kv_array)}"
        )


def resolve_scale(name: str, value: Any, head_dim: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float or None, got {value!r}")
    return float(value)


def check_soft_cap(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not value > 0:
        raise ValueError(f"{name} must be a positive float or None, got {value!r}")
    return float(value)


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as numpy when its values are known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except Exception:  # a tracer: values are checked where they are known
        return None


def check_page_indices(name: str, block_tables: Any, lengths: Any, page_size: int, num_pages: int) -> None:
    """The block-table entries that are read (pages below ``ceil(length / page_size)``) are valid pages."""
    tables, lens = concrete(block_tables), concrete(lengths)
    if tables is None or lens is None:
        return
    used = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // page_size)
    bad = used & ((tables < 0) | (tables >= num_pages))
    if bad.any():
        s, p = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}[{s}, {p}] = {int(tables[s, p])} is read (the sequence has {int(lens[s])} tokens) but is not a "
            f"page index in [0, {num_pages})"
        )


def check_lengths(name: str, lengths: Any) -> None:
    values = concrete(lengths)
    if values is not None and (values < 0).any():
        raise ValueError(f"{name} must be >= 0, got {values.tolist()}")


# ---- the operation ---------------------------------------------------------------------------------


class PageAttention(RegistryOperation):
    """Decode attention over a paged KV cache (see the module docstring)."""

    algorithm = "page_attention"
    config_type = PageAttentionConfig

    def validate(
        self,
        query,
        key_cache,
        value_cache,
        context_lens,
        block_tables,
        *,
        attn_scale=None,
        max_context_len=None,
        attn_logits_soft_cap=None,
    ):
        check_array("query", query, rank=3, dtypes=FLOAT_DTYPES, what="[num_seqs, num_heads, head_dim]")
        layout = "[num_blocks, num_kv_heads, block_size, head_dim]"
        check_array("key_cache", key_cache, rank=4, dtypes=FLOAT_DTYPES, what=layout)
        check_array("value_cache", value_cache, rank=4, dtypes=FLOAT_DTYPES, what=layout)
        check_same_dtype("query", query, key_cache=key_cache, value_cache=value_cache)
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        check_dim("key_cache", key_cache, 3, head_dim, "head_dim of query")
        for axis, size, meaning in (
            (0, num_blocks, "num_blocks"),
            (1, num_kv_heads, "num_kv_heads"),
            (2, block_size, "block_size"),
            (3, head_dim, "head_dim"),
        ):
            check_dim("value_cache", value_cache, axis, size, f"{meaning} of key_cache")
        check_gqa("query", num_heads, "key_cache", num_kv_heads, key_cache)
        check_array("context_lens", context_lens, rank=1, dtypes=INT_DTYPES, what="[num_seqs]")
        check_dim("context_lens", context_lens, 0, num_seqs, "num_seqs of query")
        check_array("block_tables", block_tables, rank=2, dtypes=INT_DTYPES, what="[num_seqs, max_blocks]")
        check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs of query")
        max_blocks = block_tables.shape[1]
        if max_context_len is None:
            max_context_len = max_blocks * block_size
        check_positive_int("max_context_len", max_context_len)
        max_context_len = min(int(max_context_len), max_blocks * block_size)
        check_lengths("context_lens", context_lens)
        lengths = concrete(context_lens)
        if lengths is not None:
            check_page_indices(
                "block_tables", block_tables, np.minimum(lengths, max_context_len), block_size, num_blocks
            )
        args = (query, key_cache, value_cache, context_lens.astype("int32"), block_tables.astype("int32"))
        kwargs = dict(
            attn_scale=resolve_scale("attn_scale", attn_scale, head_dim),
            max_context_len=max_context_len,
            attn_logits_soft_cap=check_soft_cap("attn_logits_soft_cap", attn_logits_soft_cap),
        )
        return args, kwargs


@typechecked
def page_attention(
    query: Float[jax.Array, "num_seqs num_heads head_dim"],
    key_cache: Float[jax.Array, "num_blocks num_kv_heads block_size head_dim"],
    value_cache: Float[jax.Array, "num_blocks num_kv_heads block_size head_dim"],
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
    cfg: PageAttentionConfig | None = None,
) -> Float[jax.Array, "num_seqs num_heads head_dim"]:
    """Attention of each sequence's one new query token over its paged KV cache.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        context_lens: int ``[num_seqs]``, tokens cached for each sequence (0: output zeros).
        block_tables: int ``[num_seqs, max_blocks]``, physical page of each logical page.
        attn_scale: logit scale (default ``1/sqrt(head_dim)``).
        max_context_len: caps every context length (default: ``max_blocks * block_size``).
        attn_logits_soft_cap: ``c * tanh(x / c)`` on the logits when given.
        num_splits, pages_per_compute_block, megacore_mode, inline_seq_dim: tuning hints (go into ``cfg``).
        mask_value: accepted for compatibility; masked keys are always excluded exactly.
        platform: ``"auto"`` or a platform name (``"xla"``, ``"pallas"``, ...).
        cfg: a :class:`PageAttentionConfig`, or None for the backend's heuristic.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query``'s dtype.
    """
    del mask_value  # masked keys are excluded exactly; see the module docstring
    if cfg is None and (
        num_splits or pages_per_compute_block is not None or megacore_mode is not None or not inline_seq_dim
    ):
        cfg = PageAttentionConfig(
            pages_per_compute_block=pages_per_compute_block,
            num_splits=num_splits or None,
            megacore_mode=megacore_mode,
            inline_seq_dim=inline_seq_dim,
        )
    return execute(
        PageAttention(),
        query,
        key_cache,
        value_cache,
        context_lens,
        block_tables,
        attn_scale=attn_scale,
        max_context_len=max_context_len,
        attn_logits_soft_cap=attn_logits_soft_cap,
        platform=platform,
        cfg=cfg,
    )
