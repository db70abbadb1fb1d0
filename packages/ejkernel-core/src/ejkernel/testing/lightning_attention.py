"""Reference and conformance suite of ``lightning_attention``: ``recurrent`` with the layer-dependent
per-head decay. A backend's test module subclasses :class:`LightningAttentionConformance`, sets ``platform``
and ``chunk_config`` as for :class:`~ejkernel.testing.recurrent.RecurrentConformance`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.numerics import exact_matmuls, Tolerance
from ejkernel.testing.recurrent import RecurrentConformance, check_outputs, reference_recurrent


@exact_matmuls
def reference_lightning_attention(query, key, value, initial_state=None, cu_seqlens=None, *, layer_idx, num_layers,
                                  softmax_scale=None, reverse=False):
    """The naive recurrence with ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h``."""
    heads = query.shape[2]
    slopes = -(8.0 / heads) * (1.0 - layer_idx / num_layers) * np.arange(heads)
    return reference_recurrent(query, key, value, g_gamma=jnp.asarray(slopes, query.dtype),
                               initial_state=initial_state, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                               reverse=reverse)


class LightningAttentionConformance:
    """Test base: subclass and set ``platform``."""

    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    chunk_config: ClassVar[type | None] = None
    _inputs = RecurrentConformance.make_inputs
    config = RecurrentConformance.config

    def call(self, **kwargs):
        from ejkernel.modules import lightning_attention

        return lightning_attention(**kwargs, platform=self.platform)

    def check(self, inputs, dtype, *, cfg=None, **static):
        wrt = [name for name, x in inputs.items() if x is not None and jnp.issubdtype(x.dtype, jnp.floating)]
        fn = functools.partial(self.call, cfg=cfg, **static)
        reference = functools.partial(reference_lightning_attention, **static)
        check_outputs(fn, reference, inputs, wrt, jnp.dtype(dtype), self.tolerances)

    @pytest.mark.parametrize("shape,layer", [("gqa_odd", (0, 4)), ("varlen", (3, 4))])
    def test_forward_and_gradients(self, shape, layer):
        inputs = self._inputs(21, shape, "float32", gates=(), initial_state=True)
        self.check(inputs, "float32", cfg=self.config(8), layer_idx=layer[0], num_layers=layer[1])

    @pytest.mark.parametrize("shape", ["mha_17"])
    def test_bfloat16_reverse_default_chunk(self, shape):
        inputs = self._inputs(22, shape, "bfloat16", gates=())
        self.check(inputs, "bfloat16", layer_idx=1, num_layers=3, reverse=True)

    def test_bad_layer_arguments(self):
        inputs = self._inputs(23, "mha_17", "float32", gates=())
        for layer_idx, num_layers in ((4, 4), (-1, 4), (0, 0)):
            with pytest.raises(ValueError, match="layer_idx"):
                self.call(**inputs, layer_idx=layer_idx, num_layers=num_layers)
