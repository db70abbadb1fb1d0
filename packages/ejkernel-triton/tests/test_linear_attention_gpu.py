"""GPU tests of the Triton chunked linear attention (run on the device: `pytest -m gpu`).

The shared conformance suites of recurrent_attention, gla_attention and lightning_attention with
platform="triton" (the value gate ``gv`` is refused: those tests check that the refusal is an
``UnsupportedFeature``), plus bf16 model shapes (K=V=128, K=64/V=128, K=256; several chunks, GQA, scalar
gates, reverse, varlen) against the float32 XLA implementation: output, final state and every gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import gla_attention, recurrent_attention
from ejkernel.testing.gla import GLAConformance
from ejkernel.testing.lightning_attention import LightningAttentionConformance
from ejkernel.testing.recurrent import RecurrentConformance, log_sigmoid_gate
from ejkernel.testing.numerics import relative_error
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY

REFUSED = ("gv",)


class TestTritonRecurrentConformance(RecurrentConformance):
    platform = "triton"
    refused = REFUSED


class TestTritonGLAConformance(GLAConformance):
    platform = "triton"
    refused = REFUSED


class TestTritonLightningAttentionConformance(LightningAttentionConformance):
    platform = "triton"
    refused = REFUSED


CANDIDATE = "decayed_keys=1/intra_kernel=1/state_block_k=32/state_block_v=32"  # the forward's levers (benchmark)


@pytest.mark.parametrize("batch,total,heads,kv_heads,dk,dv,gate,reverse,spec", [
    (2, 1000, 4, 4, 128, 128, "vector", False, None),  # 16 chunks, the last one partial
    (1, 2048, 8, 2, 64, 128, "scalar", True, None),  # GQA 4:1, scalar gates, reverse
    (2, 1000, 4, 4, 128, 128, "scalar", False, None),  # scalar gates over two key tiles
    (1, 512, 2, 2, 256, 64, "scalar", False, None),  # and four
    (1, 512, 2, 2, 256, 64, "vector", False, None),  # head dim 256: four key tiles
    (1, 1500, 4, 4, 128, 128, "varlen", True, None),  # packed sequences of 300, 0, 1000 and 150 tokens (+50 past the end)
    (2, 1000, 4, 4, 128, 128, "vector", False, CANDIDATE),
    # gates of ~-1.1 per token on average: 20 % of the intra kernel's sub-chunks and 37 % of the backward's
    # programs span more than SPAN_LIMIT (exact pair loops), the others go through the split dots, in one call
    (2, 1000, 4, 4, 128, 128, "strong", False, None),
    (1, 1500, 4, 4, 128, 128, "varlen", True, CANDIDATE),
    (1, 1500, 4, 4, 128, 128, "varlen", True, "carried_varlen=1/carried_varlen_run=4"),  # runs inside sequences
])
def test_bf16_model_shapes_against_float32_xla(batch, total, heads, kv_heads, dk, dv, gate, reverse, spec):
    from ejkernel_triton.linear_attention import TritonLinearAttentionConfig

    cfg = TritonLinearAttentionConfig.parse(spec) if spec else None
    keys = jax.random.split(jax.random.PRNGKey(total + dk), 6)
    q = jax.random.normal(keys[0], (batch, total, heads, dk), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, total, kv_heads, dk), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, total, kv_heads, dv), jnp.float32).astype(jnp.bfloat16)
    g_shape = (batch, total, heads) if gate == "scalar" else (batch, total, heads, dk)
    g = log_sigmoid_gate(total, g_shape, strength=8.0) * 1.8 if gate == "strong" else log_sigmoid_gate(total, g_shape)
    cu = jnp.asarray([0, 300, 300, 1300, 1450], jnp.int32) if gate == "varlen" else None
    states = batch if cu is None else cu.shape[0] - 1
    h0 = jax.random.normal(keys[3], (states, heads, dk, dv), jnp.float32)
    op = recurrent_attention if gate == "scalar" else gla_attention

    def loss(platform, q, k, v, g, h0, cot_o, cot_s):
        out, final = op(q, k, v, g, initial_state=h0, reverse=reverse, cu_seqlens=cu, platform=platform,
                        cfg=cfg if platform == "triton" else None)
        return jnp.sum(out.astype(jnp.float32) * cot_o) + jnp.sum(final * cot_s), (out, final)

    cot_o = jax.random.normal(keys[4], (batch, total, heads, dv), jnp.float32)
    cot_s = jax.random.normal(keys[5], h0.shape, jnp.float32)
    grad = lambda p: jax.jit(jax.grad(functools.partial(loss, p), argnums=(0, 1, 2, 3, 4), has_aux=True))  # noqa: E731
    got_grads, (got_out, got_final) = grad("triton")(q, k, v, g, h0, cot_o, cot_s)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        want_grads, (want_out, want_final) = grad("xla")(*f32, g, h0, cot_o, cot_s)
    assert got_out.dtype == jnp.bfloat16 and got_final.dtype == jnp.float32
    assert relative_error(got_out, want_out) < 1e-2
    assert relative_error(got_final, want_final) < 1e-2
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got_grads, want_grads):
        assert relative_error(a, b) < 2e-2, name
