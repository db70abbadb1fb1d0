"""Padding arrays to whole blocks: the one helper every backend's wrappers use before tiling an axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pad_axis", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def pad_axis(x: jax.Array | None, axis: int, length: int, value=0) -> jax.Array | None:
    """``x`` extended with ``value`` at the end of ``axis`` to ``length`` entries; ``x`` itself when it
    already has them, and None for None (an optional input stays absent)."""
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)
