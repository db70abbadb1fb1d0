"""``native_sparse_attention``: DeepSeek NSA -- a gated sum of three causal branches: attention over
compressed (mean-pooled) key blocks, over a few selected key blocks per query, and over a sliding window.

Canonical call every backend receives (validated and normalized here)::

    native_sparse_attention(query, key, value, g_cmp, g_slc, g_swa, block_indices, block_counts, *,
                            softmax_scale: float, block_size: int, num_selected_blocks: int,
                            window_size: int, cu_seqlens, cfg)

Shapes: ``query`` ``[batch, seq_len, num_heads, head_dim]``, ``key`` ``[batch, seq_len, num_kv_heads,
head_dim]``, ``value`` ``[batch, seq_len, num_kv_heads, v_head_dim]`` (one dtype; ``g = num_heads //
num_kv_heads`` query heads share a kv head and its selection). Gates ``g_cmp``/``g_slc``/``g_swa`` float
``[batch, seq_len, num_heads]`` or None; ``block_indices`` int32 ``[batch, seq_len, num_kv_heads,
num_selected_blocks]`` or None; ``block_counts`` int32 ``[batch, seq_len, num_kv_heads]`` (core fills it
from an int). ``cu_seqlens`` int32 ``[num_seqs + 1]`` packs sequences along ``seq_len`` (``batch == 1``);
every rule below then applies inside each sequence with local positions, and tokens past
``cu_seqlens[-1]`` output zeros. Let ``bs = block_size`` and ``i``, ``j`` query/key positions; every
branch is causal (``j <= i``) and uses logits ``softmax_scale * <q, k>`` in float32 (default scale
``1/sqrt(head_dim)``); a row with no visible key contributes zeros.

- Compressed branch ``o_cmp``: ``k_cmp[c] = mean(key[c*bs : (c+1)*bs])`` (same for values; a last partial
  block averages its existing tokens); query ``i`` sees compressed block ``c`` iff ``(c + 1) * bs - 1 <= i``.
- Selection (when ``block_indices`` is None; requires ``g_cmp``): for each query ``i`` and kv head, block
  ``c`` scores ``sum over the g query heads of P_cmp[h, c]`` (the compressed branch's probabilities) for
  complete blocks ``c < (i + 1) // bs``; the query's own block ``i // bs`` always ranks first; later blocks
  are excluded. The ``num_selected_blocks`` best (ties: lower index) are taken, fewer if fewer exist.
  Selection carries no gradient.
- Selected branch ``o_slc``: key ``j`` is visible iff ``j <= i`` and ``j // bs`` is among the first
  ``block_counts[b, i, k]`` entries of ``block_indices[b, i, k]`` (entries ``< 0`` or ``> i // bs`` are
  ignored, duplicates count once).
- Window branch ``o_swa`` (``window_size > 0``, requires ``g_swa``): ``i - window_size < j <= i``.

``out = (g_slc or 1) * o_slc + g_cmp * o_cmp (if g_cmp) + g_swa * o_swa (if window_size > 0)``, in
``query``'s dtype, ``[batch, seq_len, num_heads, v_head_dim]``.

Gradients: ``query``, ``key``, ``value`` and every gate given (required of every backend).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_array,
    check_cum_seqlens,
    check_dim,
    check_positive_int,
    check_same_dtype,
    describe,
    is_array,
    typechecked,
)
from ejkernel.modules.operations._validation import check_qkv, resolve_softmax_scale


@dataclasses.dataclass(frozen=True)
class NativeSparseAttentionConfig:
    """Tuning knobs (block_size is semantic and therefore an argument, not part of the config)."""

    query_chunk: int | None = None  # XLA: query rows per step of the selected branch
    num_warps: int | None = None
    num_stages: int | None = None
    platform: str = "auto"
    backend: str = "any"


class NativeSparseAttention(RegistryOperation):
    """DeepSeek native sparse attention (see the module docstring)."""

    algorithm = "native_sparse_attention"
    config_type = NativeSparseAttentionConfig

    def validate(
        self,
        query,
        key,
        value,
        g_cmp=None,
        g_slc=None,
        g_swa=None,
        block_indices=None,
        block_counts=16,
        *,
        softmax_scale=None,
        block_size=64,
        window_size=0,
        cu_seqlens=None,
    ):
        batch, seq_len, num_heads, head_dim, kv_len, num_kv_heads = check_qkv(query, key, value)
        check_dim("key", key, 1, seq_len, "seq_len of query (NSA is causal self-attention)")
        for name, gate in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
            if gate is not None:
                check_array(name, gate, rank=3, dtypes=FLOAT_DTYPES, what="[batch, seq_len, num_heads]")
                for axis, size, meaning in ((0, batch, "batch"), (1, seq_len, "seq_len"), (2, num_heads, "num_heads")):
                    check_dim(name, gate, axis, size, f"{meaning} of query")
        check_same_dtype("query", query, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa)
        check_positive_int("block_size", block_size)
        if isinstance(window_size, bool) or not isinstance(window_size, (int, np.integer)) or window_size < 0:
            raise ValueError(f"window_size must be an int >= 0 (0: no window branch), got {window_size!r}")
        if (window_size > 0) != (g_swa is not None):
            raise ValueError(
                f"the window branch needs both window_size > 0 and its gate g_swa; got window_size={window_size}, g_swa={describe(g_swa)}"
            )
        if block_indices is None:
            if g_cmp is None:
                raise ValueError(
                    "block_indices is None, so the selection must come from the compressed branch: pass g_cmp (or block_indices)"
                )
            if (
                is_array(block_counts)
                or isinstance(block_counts, bool)
                or not isinstance(block_counts, (int, np.integer))
            ):
                raise ValueError(
                    f"without block_indices, block_counts must be an int (the number of blocks to select), got {describe(block_counts)}"
                )
            check_positive_int("block_counts", block_counts)
            num_selected = int(block_counts)
        else:
            what = "[batch, seq_len, num_kv_heads, num_selected_blocks]"
            check_array("block_indices", block_indices, rank=4, dtypes=INT_DTYPES, what=what)
            for axis, size, meaning in (
                (0, batch, "batch"),
                (1, seq_len, "seq_len"),
                (2, num_kv_heads, "num_kv_heads of key"),
            ):
                check_dim("block_indices", block_indices, axis, size, meaning)
            num_selected = block_indices.shape[3]
            block_indices = block_indices.astype(jnp.int32)
        if is_array(block_counts):
            check_array("block_counts", block_counts, rank=3, dtypes=INT_DTYPES, what="[batch, seq_len, num_kv_heads]")
            for axis, size, meaning in (
                (0, batch, "batch"),
                (1, seq_len, "seq_len"),
                (2, num_kv_heads, "num_kv_heads of key"),
            ):
                check_dim("block_counts", block_counts, axis, size, meaning)
            counts = block_counts.astype(jnp.int32)
        else:
            if isinstance(block_counts, bool) or not isinstance(block_counts, (int, np.integer)) or block_counts < 0:
                raise ValueError(
                    f"block_counts must be an int >= 0 or an int array [batch, seq_len, num_kv_heads], got {block_counts!r}"
                )
            counts = jnp.full((batch, seq_len, num_kv_heads), min(int(block_counts), num_selected), jnp.int32)
        if cu_seqlens is not None:
            check_cum_seqlens("cu_seqlens", cu_seqlens, seq_len, "seq_len of query")
            if batch != 1:
                raise ValueError(
                    f"with cu_seqlens the sequences are packed along seq_len, so batch must be 1; got query {describe(query)}"
                )
            cu_seqlens = cu_seqlens.astype(jnp.int32)
        args = (query, key, value, g_cmp, g_slc, g_swa, block_indices, counts)
        kwargs = dict(
            softmax_scale=resolve_softmax_scale(softmax_scale, head_dim),
            block_size=int(block_size),
            num_selected_blocks=num_selected,
            window_size=int(window_size),
            cu_seqlens=cu_seqlens,
        )
        return args, kwargs


@typechecked
def native_sparse_attention(
    query: Float[jax.Array, "batch seq_len num_heads head_dim"],
    key: Float[jax.Array, "batch seq_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch seq_len num_kv_heads v_head_dim"],
    g_cmp: Float[jax.Array, "batch seq_len num_heads"] | None = None,
    g_slc: Float[jax.Array, "batch seq_len num_heads"] | None = None,
    block_indices: Int[jax.Array, "batch seq_len num_kv_heads num_selected_blocks"] | None = None,
    block_counts: Int[jax.Array, "batch seq_len num_kv_heads"] | int = 16,
    softmax_scale: float | None = None,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    platform: str = "auto",
    *,
    g_swa: Float[jax.Array, "batch seq_len num_heads"] | None = None,
    window_size: int = 0,
    block_size: int = 64,
    cfg: NativeSparseAttentionConfig | None = None,
) -> Float[jax.Array, "batch seq_len num_heads v_head_dim"]:
    """DeepSeek native sparse attention (see the module docstring for the exact semantics).

    Args:
        query, key, value: ``[batch, seq_len, heads, head_dim]`` (GQA allowed; causal self-attention).
        g_cmp, g_slc, g_swa: gates ``[batch, seq_len, num_heads]`` of the compressed, selected and
            window branches (``g_slc=None`` means weight 1; ``g_cmp=None``/``g_swa=None`` drop the branch).
        block_indices: selected key blocks ``[batch, seq_len, num_kv_heads, n]``; None: chosen from the
            compressed branch (needs ``g_cmp``).
        block_counts: how many of the indices count (int or ``[batch, seq_len, num_kv_heads]``); without
            ``block_indices`` the number of blocks to select.
        softmax_scale: logit scale (default ``1/sqrt(head_dim)``).
        cu_seqlens: int ``[num_seqs + 1]`` packed sequences (``batch == 1``).
        g_swa, window_size: the sliding-window branch (each query sees ``window_size`` keys).
        block_size: key block size of compression and selection.
        platform: ``"auto"`` or a platform name.
        cfg: a :class:`NativeSparseAttentionConfig`, or None.
    """
    return execute(
        NativeSparseAttention(),
        query,
        key,
        value,
        g_cmp,
        g_slc,
        g_swa,
        block_indices,
        block_counts,
        softmax_scale=softmax_scale,
        block_size=block_size,
        window_size=window_size,
        cu_seqlens=cu_seqlens,
        platform=platform,
        cfg=cfg,
    )
