"""``mean_pooling``: the mean over the sequence axis, per sequence (fixed length or packed varlen).

Core validates the public call into one frozen :class:`MeanPoolingCall`; that object is all a backend
sees:

- Fixed length (``cu_seqlens is None``): ``x`` ``[batch, seq, *features]`` -> ``[batch, *features]``,
  ``out[b] = mean_t x[b, t]``.
- Varlen: ``x`` ``[total_tokens, *features]`` (sequences packed one after another) and ``cu_seqlens``
  int32 ``[N + 1]`` (0, non-decreasing, last entry <= total_tokens) -> ``[N, *features]``,
  ``out[n] = mean of x[cu_seqlens[n] : cu_seqlens[n + 1]]``. An empty sequence gives zeros; tokens past
  ``cu_seqlens[-1]`` are ignored.
- Sums in float32; output in ``x``'s dtype. No matmul, so no ``precision``.

The public ``chunk_size`` (the original library's tiling hint) is checked (a positive int) and not passed
on: it never changes the result, and tiling is each backend's config.

Gradient: ``x`` (``dx[t] = dout[seq(t)] / len(seq(t))``, zero for ignored tokens). Full specification:
``docs/ops/mean_pooling.md``.
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    check_array,
    check_cum_seqlens,
    check_positive_int,
    describe,
)


@canonical_call
class MeanPoolingCall:
    """A validated ``mean_pooling`` call (see the module docstring)."""

    x: Float[jax.Array, "batch seq *features"] | Float[jax.Array, "total_tokens *features"] = array_field()
    """``[batch, seq, *features]``, or ``[total_tokens, *features]`` with ``cu_seqlens``."""
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = array_field()
    """int32 sequence boundaries of packed ``x``, or None (fixed length)."""


class MeanPooling(RegistryOperation):
    """Sequence mean pooling (see the module docstring)."""

    algorithm = "mean_pooling"

    def canonicalize(self, args: Arguments) -> MeanPoolingCall:
        x, cu_seqlens = args.x, args.cu_seqlens
        check_positive_int("chunk_size", args.chunk_size)
        if cu_seqlens is None:
            check_array("x", x, dtypes=FLOAT_DTYPES, what="[batch, seq, *features]")
            if x.ndim < 2:
                raise ValueError(f"x must have rank >= 2 ([batch, seq, *features]), got {describe(x)}")
        else:
            check_array("x", x, dtypes=FLOAT_DTYPES, what="[total_tokens, *features] (packed, with cu_seqlens)")
            if x.ndim < 1:
                raise ValueError(f"x must have rank >= 1 ([total_tokens, *features]) with cu_seqlens, got {describe(x)}")
            check_cum_seqlens("cu_seqlens", cu_seqlens, x.shape[0], "total_tokens of x")
            cu_seqlens = cu_seqlens.astype("int32")
        return MeanPoolingCall(x=x, cu_seqlens=cu_seqlens)


@public_function(MeanPooling)
def mean_pooling(
    x: Float[jax.Array, "..."],
    chunk_size: int = 32,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    *,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "..."]:
    """Mean of each sequence over its tokens.

    Args:
        x: ``[batch, seq, *features]``, or ``[total_tokens, *features]`` with ``cu_seqlens``.
        chunk_size: tiling hint of the original library (a positive int); does not change the result.
        cu_seqlens: int ``[num_seqs + 1]`` boundaries of the packed sequences.
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config; it selects that implementation (the XLA one has nothing to
            tune: ``ejkernel.NoConfig``).

    Returns:
        ``[batch, *features]`` (or ``[num_seqs, *features]``) in ``x``'s dtype; empty sequences give zeros.
    """
    return execute(MeanPooling(), **locals())
