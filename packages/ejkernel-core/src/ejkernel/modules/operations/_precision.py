"""The matmul precision policy, the same for every operation and backend.

Every public operation takes ``precision`` in the style of ``jax.lax.dot_general``: ``None`` (the
default), ``"default"`` / ``"high"`` / ``"highest"`` or a :class:`jax.lax.Precision`. Core resolves it
once into the canonical call:

- ``None`` with float32 inputs -> ``HIGHEST``: float32 means float32, also on NVIDIA GPUs, where XLA's
  own default is TF32 (relative error ~3e-4 instead of ~1e-6).
- ``None`` with bfloat16/float16 inputs -> ``DEFAULT``: the operands are already 16-bit, products are
  exact and every backend accumulates in float32, so nothing is gained by asking for more.
- an explicit value is kept: ``"default"`` lets float32 matmuls run at the hardware's fast rate (TF32 on
  NVIDIA GPUs, bf16 passes on TPUs), ``"high"`` asks for bf16x3-class accuracy.

The value is a floor on accuracy: a backend may compute more precisely than asked (the Triton kernels'
float32 dots are always IEEE), and one that cannot reach the requested accuracy refuses the call with
``UnsupportedFeature`` so the dispatcher falls back. XLA code honours it by running its matmuls under
:func:`matmul_precision`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["PRECISION_NAMES", "matmul_precision", "resolve_precision"]

PRECISION_NAMES = ("default", "high", "highest")


def resolve_precision(value: Any, dtype: Any, *, argument: str = "precision") -> Any:
    """``value`` as a :class:`jax.lax.Precision`, with ``None`` resolved from the inputs' ``dtype``."""
    import jax
    import jax.numpy as jnp

    if value is None:
        return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
    if isinstance(value, jax.lax.Precision):
        return value
    if isinstance(value, str) and value.lower() in PRECISION_NAMES:
        return jax.lax.Precision[value.upper()]
    raise ValueError(
        f"{argument} must be None, one of {', '.join(map(repr, PRECISION_NAMES))} or a jax.lax.Precision, "
        f"got {value!r}"
    )


@contextlib.contextmanager
def matmul_precision(precision: Any) -> Iterator[None]:
    """Run the JAX matmuls traced inside at ``precision`` (a resolved :class:`jax.lax.Precision`).

    For XLA code: wrap the forward, and the backward of a custom VJP too (it is traced later, outside
    the forward's scope).
    """
    import jax

    name = {"DEFAULT": "default", "HIGH": "high", "HIGHEST": "highest"}[jax.lax.Precision(precision).name]
    with jax.default_matmul_precision(name):
        yield
