"""XLA ``grouped_matmul``: ``jax.lax.ragged_dot`` (native on GPU/TPU, a masked dense product on CPU).

``ragged_dot`` always starts the groups at row 0 and takes every group it is given, so a slice of the
groups (``group_offset``) is expressed by adding two zero "groups": one covering the rows before the
slice and one covering the rows after it. Autodiff of ``ragged_dot`` gives the lhs/rhs gradients, whose
matmuls keep the call's ``precision``. Nothing to tune (XLA lowers ``ragged_dot``), nothing refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.grouped_matmul import GroupedMatmulCall


class XlaGroupedMatmul(Implementation[GroupedMatmulCall, NoConfig]):
    def __call__(self, call: GroupedMatmulCall, config: NoConfig) -> jax.Array:
        lhs, sizes = call.lhs, call.group_sizes
        weights = jnp.swapaxes(call.rhs, 1, 2) if call.transpose_rhs else call.rhs
        num_groups = weights.shape[0]
        m = lhs.shape[0]
        if call.group_offset is None:
            computed_rows = jnp.sum(sizes)
            first_row = jnp.int32(0)
        else:
            offset = call.group_offset[0]
            local = jax.lax.dynamic_slice_in_dim(sizes, offset, num_groups)
            first_row = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < offset, sizes, 0))
            computed_rows = jnp.sum(local)
            sizes = jnp.concatenate([first_row[None], local, (m - first_row - computed_rows)[None]])
            zero = jnp.zeros((1, *weights.shape[1:]), weights.dtype)
            weights = jnp.concatenate([zero, weights, zero])
        out = jax.lax.ragged_dot(lhs, weights, sizes, precision=call.precision, preferred_element_type=jnp.float32)
        out = out.astype(call.preferred_element_type)
        if call.existing_out is not None:
            rows = jnp.arange(m)
            computed = (rows >= first_row) & (rows < first_row + computed_rows)
            out = jnp.where(computed[:, None], out, call.existing_out)
        return out


IMPLEMENTATION = XlaGroupedMatmul()
