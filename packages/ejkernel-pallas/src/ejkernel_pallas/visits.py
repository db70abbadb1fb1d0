"""The visit list of a kernel whose grid walks row tiles cut across ragged segments (the groups of
``grouped_matmul``, the packed sequences of ``ragged_page_attention``): (segment, row tile) pairs ordered by
segment, so tiles come in non-decreasing order. Built outside the kernel (plain XLA on int32: traced segment
bounds work) and handed to it through scalar prefetch."""

from __future__ import annotations

import jax.numpy as jnp


def segment_tile_visits(start, end, nonempty, block_rows: int, num_tiles: int):
    """``(segment, tile, valid)``, int32 ``[num_tiles + num_segments - 1]`` (the static bound on the visits), of
    the segments covering rows ``[start, end)`` in tiles of ``block_rows`` (a segment whose ``nonempty`` is
    False is visited nowhere). Trailing unused visits repeat the last real one with ``valid`` 0."""
    num_segments = start.shape[0]
    first = start // block_rows
    last = jnp.maximum(end - 1, 0) // block_rows
    count = jnp.where(nonempty, last - first + 1, 0)
    cum = jnp.cumsum(count)
    total = cum[-1]
    max_visits = num_tiles + num_segments - 1
    v = jnp.minimum(jnp.arange(max_visits, dtype=jnp.int32), jnp.maximum(total - 1, 0))
    segment = jnp.minimum(jnp.searchsorted(cum, v, side="right").astype(jnp.int32), num_segments - 1)
    tile = jnp.clip(first[segment] + v - (cum[segment] - count[segment]), 0, num_tiles - 1)
    valid = (jnp.arange(max_visits) < total).astype(jnp.int32)
    return segment, tile, valid
