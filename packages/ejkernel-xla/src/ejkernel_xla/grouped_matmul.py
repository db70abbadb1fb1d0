"""XLA grouped matmul: ``jax.lax.ragged_dot`` (native on GPU/TPU, a masked dense product on CPU).

``ragged_dot`` always starts the groups at row 0 and takes every group it is given, so a slice of the
groups (``group_offset``) is expressed by adding two zero "groups": one covering the rows before the
slice and one covering the rows after it. Autodiff of ``ragged_dot`` gives the lhs/rhs gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(
    lhs,
    rhs,
    group_sizes,
    group_offset=None,
    existing_out=None,
    *,
    preferred_element_type,
    transpose_rhs: bool,
    precision=None,
    cfg=None,
):
    del cfg  # no tiles to choose: ragged_dot is lowered by XLA
    weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    num_groups = weights.shape[0]
    m = lhs.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    if group_offset is None:
        computed_rows = jnp.sum(sizes)
        first_row = jnp.int32(0)
        out = jax.lax.ragged_dot(lhs, weights, sizes, precision=precision, preferred_element_type=jnp.float32)
    else:
        offset = group_offset[0]
        local = jax.lax.dynamic_slice_in_dim(sizes, offset, num_groups)
        first_row = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
        computed_rows = jnp.sum(local)
        padded_sizes = jnp.concatenate([first_row[None], local, (m - first_row - computed_rows)[None]])
        zero = jnp.zeros((1, *weights.shape[1:]), weights.dtype)
        padded_weights = jnp.concatenate([zero, weights, zero])
        out = jax.lax.ragged_dot(
            lhs, padded_weights, padded_sizes, precision=precision, preferred_element_type=jnp.float32
        )
    out = out.astype(preferred_element_type)
    if existing_out is not None:
        rows = jnp.arange(m)
        computed = (rows >= first_row) & (rows < first_row + computed_rows)
        out = jnp.where(computed[:, None], out, existing_out)
    return out
