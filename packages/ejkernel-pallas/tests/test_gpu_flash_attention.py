"""GPU flash attention (Pallas, Triton lowering): interpret-mode numerics on CPU, lowering for sm_90."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import abstract_device, blocks, normal, out_and_grads, rel_err
from pallas_reference import flash_attention_reference

from ejkernel import UnsupportedFeature
from ejkernel_pallas import gpu_flash_attention as gpu


def test_interpret_mode_matches_reference_with_features():
    """Causal + window + soft cap + sinks + dropout + GQA, Sq != Skv, small blocks so every loop range is used."""
    b, sq, skv, h, hkv, d = 1, 40, 72, 4, 2, 32
    ks = jax.random.split(jax.random.key(21), 4)
    q, k, v = normal(ks[0], (b, sq, h, d)), normal(ks[1], (b, skv, hkv, d)), normal(ks[2], (b, skv, hkv, d))
    aux = normal(ks[3], (h,))
    kw = dict(softmax_scale=d**-0.5, causal=True, sliding_window=(20, 3), logits_soft_cap=5.0, dropout_prob=0.2,
              dropout_seed=2024)
    cfg = blocks(fwd_q=16, fwd_kv=16, bwd_q=16, bwd_kv=32, dq_q=32, dq_kv=16)

    def kernel(q, k, v, aux):
        return gpu.flash_attention(q, k, v, softmax_aux=aux, cfg=cfg, interpret=True, **kw)

    def reference(q, k, v, aux):
        return flash_attention_reference(q, k, v, softmax_aux=aux, **kw)

    out, grads = out_and_grads(kernel, (0, 1, 2, 3))(q, k, v, aux)
    want_out, want = out_and_grads(reference, (0, 1, 2, 3))(q, k, v, aux)
    assert rel_err(out, want_out) < 2e-6
    for name, g, w in zip("qkva", grads, want):
        assert rel_err(g, w) < 1e-5, name


def test_interpret_mode_segments_and_varlen_forward():
    b, s, h, d = 2, 48, 2, 16
    ks = jax.random.split(jax.random.key(22), 3)
    q, k, v = (normal(kk, (b, s, h, d)) for kk in ks)
    seg = jnp.broadcast_to((jnp.arange(s) >= 21).astype(jnp.int32), (b, s))
    kw = dict(softmax_scale=0.25, causal=False, q_segment_ids=seg, kv_segment_ids=seg)
    cfg = blocks(fwd_q=16, fwd_kv=16)
    out = jax.jit(lambda q, k, v: gpu.flash_attention(q, k, v, cfg=cfg, interpret=True, **kw))(q, k, v)
    assert rel_err(out, flash_attention_reference(q, k, v, **kw)) < 2e-6
    cum = jnp.array([0, 5, 30, 41], jnp.int32)
    kw = dict(softmax_scale=0.25, causal=True, cum_seqlens_q=cum, cum_seqlens_k=cum)
    q1, k1, v1 = q[:1], k[:1], v[:1]
    out = jax.jit(lambda q, k, v: gpu.flash_attention(q, k, v, cfg=cfg, interpret=True, **kw))(q1, k1, v1)
    assert rel_err(out, flash_attention_reference(q1, k1, v1, **kw)) < 2e-6
    assert float(jnp.max(jnp.abs(out[:, 41:]))) == 0.0  # padding past cum_seqlens[-1]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lowers_for_sm90(dtype):
    """Triton lowering (jax side) of forward, dK/dV and dQ for an H100, at benchmark-like tilings."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), dtype)
    kv = jax.ShapeDtypeStruct((1, 512, 1, 128), dtype)

    def loss(q, k, v):
        out = gpu.flash_attention(
            q, k, v, softmax_scale=0.1, causal=True, sliding_window=(256, 0), logits_soft_cap=30.0,
            softmax_aux=jnp.zeros((2, 3)), dropout_prob=0.1, dropout_seed=3,
        )
        return out.astype(jnp.float32).sum()

    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 3, text[:2000]


def test_refuses_what_it_does_not_implement():
    q = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.float32)
    with pytest.raises(UnsupportedFeature, match="bias"):
        gpu.check_supported(q, q, q, jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.float32))
    with pytest.raises(UnsupportedFeature, match="attention_mask"):
        gpu.check_supported(q, q, q, attention_mask=jax.ShapeDtypeStruct((1, 1, 16, 16), jnp.bool_))


def test_tuning_validation():
    with pytest.raises(ValueError, match="powers of two"):
        gpu.GpuFlashTuning(fwd_q=96)
    t = gpu.choose_tuning(None, 8192, 8192, 128)
    assert (t.fwd_q, t.fwd_kv, t.fwd_warps, t.dkv_q, t.dq_kv) == (128, 64, 4, 64, 64)
    assert gpu.choose_tuning(None, 20, 9, 64).fwd_kv == 16  # short sequences shrink the blocks
