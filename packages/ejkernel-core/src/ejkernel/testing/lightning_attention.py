"""Reference and conformance suite of ``lightning_attention``: ``recurrent`` with the layer-dependent
per-head decay. A backend's test module subclasses :class:`LightningAttentionConformance`, sets ``platform``
and ``chunk_config`` as for :class:`~ejkernel.testing.recurrent.RecurrentConformance`."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.numerics import exact_matmuls
from ejkernel.testing.recurrent import RecurrentSuite, reference_recurrent


@exact_matmuls
def reference_lightning_attention(query, key, value, initial_state=None, cu_seqlens=None, *, layer_idx, num_layers,
                                  softmax_scale=None, reverse=False):
    """The naive recurrence with ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h``."""
    heads = query.shape[2]
    slopes = -(8.0 / heads) * (1.0 - layer_idx / num_layers) * np.arange(heads)
    return reference_recurrent(query, key, value, g_gamma=jnp.asarray(slopes, query.dtype),
                               initial_state=initial_state, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                               reverse=reverse)


class LightningAttentionConformance(RecurrentSuite):
    """Test base: subclass and set ``platform``."""

    operation: ClassVar[str] = "lightning_attention"
    reference = staticmethod(reference_lightning_attention)

    @pytest.mark.parametrize("shape,layer", [("gqa_odd", (0, 4)), ("varlen", (3, 4))])
    def test_forward_and_gradients(self, shape, layer):
        inputs = self.make_inputs(21, shape, "float32", gates=(), initial_state=True)
        self.check(inputs, "float32", cfg=self.config(8), layer_idx=layer[0], num_layers=layer[1])

    @pytest.mark.parametrize("shape", ["mha_17"])
    def test_bfloat16_reverse_default_chunk(self, shape):
        inputs = self.make_inputs(22, shape, "bfloat16", gates=())
        self.check(inputs, "bfloat16", layer_idx=1, num_layers=3, reverse=True)

    def test_bad_layer_arguments(self):
        inputs = self.make_inputs(23, "mha_17", "float32", gates=())
        for layer_idx, num_layers in ((4, 4), (-1, 4), (0, 0)):
            with pytest.raises(ValueError, match="layer_idx"):
                self.call(**inputs, layer_idx=layer_idx, num_layers=num_layers)
