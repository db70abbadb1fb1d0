"""GPU tests of the Triton mean_pooling (run on the device: `pytest -m gpu`): the shared conformance suite
with platform="triton", and long packed bf16 batches (split sequences, empty ones, ignored tail tokens)
against the XLA implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import mean_pooling
from ejkernel.testing.mean_pooling import MeanPoolingConformance
from ejkernel.testing.numerics import assert_close, normal_array
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY


class TestTritonMeanPoolingConformance(MeanPoolingConformance):
    platform = "triton"


@pytest.mark.parametrize("bounds,features", [
    ((0, 70000, 70000, 70001, 131072), (8, 64)),  # long sequences (many splits), an empty one, a single token
    ((0, 3, 1000, 5000, 9000), (1000,)),  # a feature width that is no power of two, a tail of ignored tokens
])
def test_long_packed_bf16_against_xla(bounds, features):
    x = normal_array(0, (131072 if bounds[-1] == 131072 else 9500, *features), "bfloat16")
    cu = jnp.asarray(bounds, jnp.int32)
    d_out = normal_array(1, (len(bounds) - 1, *features), "bfloat16")

    def grads(platform):
        out, pullback = jax.vjp(lambda x: mean_pooling(x, cu_seqlens=cu, platform=platform), x)
        return out, *pullback(d_out)

    (out, dx), (ref, ref_dx) = jax.jit(lambda: grads("triton"))(), jax.jit(lambda: grads("xla"))()
    assert_close(out, ref, dtype="bfloat16")
    assert_close(dx, ref_dx, dtype="bfloat16", gradient=True, name="dx")
    np.testing.assert_array_equal(np.asarray(dx[bounds[-1]:], np.float32), 0.0)
