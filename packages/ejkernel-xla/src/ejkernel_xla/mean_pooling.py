"""XLA ``mean_pooling``: a float32 reduction (fixed length) or a segment sum over packed tokens (varlen).

A segment sum accumulates each sequence on its own, so long packed streams keep full float32
accuracy (a difference of prefix sums would not). Autodiff gives the gradient (a gather). Nothing to
tune, nothing refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.mean_pooling import MeanPoolingCall


class XlaMeanPooling(Implementation[MeanPoolingCall, NoConfig]):
    def __call__(self, call: MeanPoolingCall, config: NoConfig) -> jax.Array:
        x, cu_seqlens = call.x, call.cu_seqlens
        values = x.astype(jnp.float32)
        if cu_seqlens is None:
            return jnp.mean(values, axis=1).astype(x.dtype)
        num_seqs = cu_seqlens.shape[0] - 1
        tokens = jnp.arange(x.shape[0], dtype=jnp.int32)
        # Token t belongs to sequence #(boundaries <= t); tokens past the last boundary get id num_seqs,
        # which segment_sum drops.
        segment = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)
        sums = jax.ops.segment_sum(values, segment, num_segments=num_seqs)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.float32)
        lengths = lengths.reshape((num_seqs,) + (1,) * (x.ndim - 1))
        return (sums / jnp.maximum(lengths, 1.0)).astype(x.dtype)


IMPLEMENTATION = XlaMeanPooling()
