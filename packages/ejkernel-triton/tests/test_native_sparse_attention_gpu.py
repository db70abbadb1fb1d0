"""GPU tests of the Triton native_sparse_attention (``-m gpu``): the shared conformance suite with platform="triton" (bfloat16 included), and long bf16 problems (GQA 16, 64-token
blocks, 16 selected) against the XLA implementation in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import native_sparse_attention
from ejkernel.testing.native_sparse_attention import NativeSparseAttentionConformance, random_block_indices
from ejkernel.testing.numerics import assert_close, normal_array
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY


class TestTritonNativeSparseAttentionConformance(NativeSparseAttentionConformance):
    platform = "triton"


@pytest.mark.parametrize("seq,heads,kv_heads,selection", [(2048, 16, 1, "given"), (1000, 8, 2, "compressed")])
def test_bf16_long_problems_match_float32_xla(seq, heads, kv_heads, selection):
    d, bs, n = 128, 64, 16
    q = normal_array(0, (1, seq, heads, d), "bfloat16")
    k = normal_array(1, (1, seq, kv_heads, d), "bfloat16")
    v = normal_array(2, (1, seq, kv_heads, d), "bfloat16")
    gates = {name: jax.nn.sigmoid(normal_array(3 + i, (1, seq, heads), "float32")).astype(jnp.bfloat16)
             for i, name in enumerate(("g_cmp", "g_slc", "g_swa"))}
    kw = dict(block_size=bs, window_size=256, block_counts=n)
    if selection == "given":
        kw["block_indices"] = random_block_indices(0, 1, seq, kv_heads, n, bs)

    def run(platform, *arrays):
        def f(q, k, v):  # gates in the query's dtype: the float32 reference gets float32 copies of the bf16 gates
            cast = {name: g.astype(q.dtype) for name, g in gates.items()}
            return native_sparse_attention(q, k, v, **cast, **kw, platform=platform)

        out, pullback = jax.vjp(f, *arrays)
        return (out, *pullback(normal_array(9, out.shape, out.dtype)))

    got = jax.jit(lambda *a: run("triton", *a))(q, k, v)
    want = jax.jit(lambda *a: run("xla", *a))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w, dtype="bfloat16", gradient=name != "out", name=name)
