"""``native_sparse_attention``: DeepSeek NSA -- a gated sum of three causal branches: attention over
compressed (mean-pooled) key blocks, over a few selected key blocks per query, and over a sliding window.

Core validates the public call into one frozen :class:`NativeSparseAttentionCall`, all a backend sees
(``softmax_scale=None`` -> ``1/sqrt(head_dim)``, an int ``block_counts`` -> an int32 array,
``num_selected_blocks`` from ``block_indices`` or the int ``block_counts``, ``precision``).

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_array,
    check_dim,
    check_positive_int,
    check_qkv,
    check_same_dtype,
    describe,
    is_array,
    normalize_packed_seqlens,
    resolve_softmax_scale,
)


@canonical_call
class NativeSparseAttentionCall:
    """A validated ``native_sparse_attention`` call: what every backend receives (see above)."""

    query: Float[jax.Array, "batch seq_len num_heads head_dim"] = array_field()
    key: Float[jax.Array, "batch seq_len num_kv_heads head_dim"] = array_field()
    value: Float[jax.Array, "batch seq_len num_kv_heads v_head_dim"] = array_field()
    g_cmp: Float[jax.Array, "batch seq_len num_heads"] | None = array_field()
    g_slc: Float[jax.Array, "batch seq_len num_heads"] | None = array_field()
    g_swa: Float[jax.Array, "batch seq_len num_heads"] | None = array_field()
    """Given exactly when ``window_size > 0``."""
    block_indices: Int[jax.Array, "batch seq_len num_kv_heads num_selected_blocks"] | None = array_field()
    """int32; None: selected from the compressed branch (then ``g_cmp`` is given)."""
    block_counts: Int[jax.Array, "batch seq_len num_kv_heads"] = array_field()
    """int32."""
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = array_field()
    """int32; then batch is 1."""
    softmax_scale: float = 1.0
    block_size: int = 64
    num_selected_blocks: int = 16
    window_size: int = 0
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


def _check_per_token(name: str, x: Any, *, rank: int, dtypes: Any, what: str, leading: tuple) -> None:
    """``x`` is an array ``what`` of ``rank`` and ``dtypes`` whose leading dims are ``leading``'s sizes."""
    check_array(name, x, rank=rank, dtypes=dtypes, what=what)
    for axis, (size, meaning) in enumerate(leading):
        check_dim(name, x, axis, size, meaning)


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


class NativeSparseAttention(RegistryOperation):
    """DeepSeek native sparse attention (see the module docstring)."""

    algorithm = "native_sparse_attention"

    def canonicalize(self, args: Arguments) -> NativeSparseAttentionCall:
        query, key, value, g_cmp, g_slc, g_swa = args.query, args.key, args.value, args.g_cmp, args.g_slc, args.g_swa
        block_indices, block_counts, block_size, window_size = (
            args.block_indices, args.block_counts, args.block_size, args.window_size
        )
        batch, seq_len, num_heads, head_dim, _, num_kv_heads = check_qkv(query, key, value)
        check_dim("key", key, 1, seq_len, "seq_len of query (NSA is causal self-attention)")
        tokens = ((batch, "batch of query"), (seq_len, "seq_len of query"))
        for name, gate in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
            if gate is not None:
                _check_per_token(
                    name, gate, rank=3, dtypes=FLOAT_DTYPES, what="[batch, seq_len, num_heads]",
                    leading=(*tokens, (num_heads, "num_heads of query")),
                )
        check_same_dtype("query", query, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa)
        check_positive_int("block_size", block_size)
        if not _is_int(window_size) or window_size < 0:
            raise ValueError(f"window_size must be an int >= 0 (0: no window branch), got {window_size!r}")
        if (window_size > 0) != (g_swa is not None):
            raise ValueError(
                f"the window branch needs both window_size > 0 and its gate g_swa; got window_size={window_size}, g_swa={describe(g_swa)}"
            )
        per_kv_head = (*tokens, (num_kv_heads, "num_kv_heads of key"))
        if block_indices is None:
            if g_cmp is None:
                raise ValueError(
                    "block_indices is None, so the selection must come from the compressed branch: pass g_cmp (or block_indices)"
                )
            if not _is_int(block_counts):
                raise ValueError(
                    f"without block_indices, block_counts must be an int (the number of blocks to select), got {describe(block_counts)}"
                )
            check_positive_int("block_counts", block_counts)
            num_selected = int(block_counts)
        else:
            _check_per_token(
                "block_indices", block_indices, rank=4, dtypes=INT_DTYPES,
                what="[batch, seq_len, num_kv_heads, num_selected_blocks]", leading=per_kv_head,
            )
            num_selected = block_indices.shape[3]
            block_indices = block_indices.astype(jnp.int32)
        if is_array(block_counts):
            _check_per_token(
                "block_counts", block_counts, rank=3, dtypes=INT_DTYPES, what="[batch, seq_len, num_kv_heads]",
                leading=per_kv_head,
            )
            block_counts = block_counts.astype(jnp.int32)
        elif _is_int(block_counts) and block_counts >= 0:
            block_counts = jnp.full((batch, seq_len, num_kv_heads), min(int(block_counts), num_selected), jnp.int32)
        else:
            raise ValueError(
                f"block_counts must be an int >= 0 or an int array [batch, seq_len, num_kv_heads], got {block_counts!r}"
            )
        return args.build(
            NativeSparseAttentionCall,
            block_indices=block_indices,
            block_counts=block_counts,
            cu_seqlens=normalize_packed_seqlens(args.cu_seqlens, query),
            softmax_scale=resolve_softmax_scale(args.softmax_scale, head_dim),
            block_size=int(block_size),
            num_selected_blocks=num_selected,
            window_size=int(window_size),
            precision=resolve_precision(args.precision, query.dtype),
        )


@public_function(NativeSparseAttention)
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
    precision: str | jax.lax.Precision | None = None,
    cfg: Any = None,
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
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        cfg: one implementation's config (e.g. ``ejkernel_xla.native_sparse_attention.XlaNsaConfig``); it
            selects that implementation. None: the chosen implementation's heuristic.
    """
    return execute(NativeSparseAttention(), **locals())
