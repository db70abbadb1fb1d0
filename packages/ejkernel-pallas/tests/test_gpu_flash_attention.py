"""GPU flash attention (Pallas, Triton lowering): interpret-mode numerics on CPU, lowering for sm_90."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import abstract_device, equations, flash_call, flash_reference, normal, out_and_grads, rel_err

from ejkernel import UnsupportedFeature
from ejkernel_pallas import gpu_flash_attention as gpu
from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning


def _kernel(tuning=None, interpret=True):
    """The GPU kernels on the validated call of the public keywords (the heuristic's tuning by default)."""

    def run(q, k, v, **kw):
        call = flash_call(q, k, v, **kw)
        return gpu.flash_attention(call, tuning or gpu.IMPLEMENTATION.heuristic_config(call), interpret=interpret)

    return run


def test_interpret_mode_matches_reference_with_features():
    """Causal + window + soft cap + sinks + dropout + GQA, Sq != Skv, small blocks so every loop range is used."""
    b, sq, skv, h, hkv, d = 1, 40, 72, 4, 2, 32
    ks = jax.random.split(jax.random.key(21), 4)
    q, k, v = normal(ks[0], (b, sq, h, d)), normal(ks[1], (b, skv, hkv, d)), normal(ks[2], (b, skv, hkv, d))
    aux = normal(ks[3], (h,))
    kw = dict(softmax_scale=d**-0.5, causal=True, sliding_window=(20, 3), logits_soft_cap=5.0, dropout_prob=0.2,
              dropout_seed=2024)
    kernel = _kernel(GpuFlashTuning(fwd_q=16, fwd_kv=16, dkv_q=16, dkv_kv=32, dq_q=32, dq_kv=16))

    out, grads = out_and_grads(lambda q, k, v, aux: kernel(q, k, v, softmax_aux=aux, **kw), (0, 1, 2, 3))(q, k, v, aux)
    want_out, want = out_and_grads(lambda q, k, v, aux: flash_reference(q, k, v, softmax_aux=aux, **kw), (0, 1, 2, 3))(
        q, k, v, aux
    )
    assert rel_err(out, want_out) < 2e-6
    for name, g, w in zip("qkva", grads, want):
        assert rel_err(g, w) < 1e-5, name


def test_interpret_mode_segments_and_varlen_forward():
    b, s, h, d = 2, 48, 2, 16
    ks = jax.random.split(jax.random.key(22), 3)
    q, k, v = (normal(kk, (b, s, h, d)) for kk in ks)
    seg = jnp.broadcast_to((jnp.arange(s) >= 21).astype(jnp.int32), (b, s))
    kw = dict(softmax_scale=0.25, causal=False, q_segment_ids=seg, kv_segment_ids=seg)
    kernel = _kernel(GpuFlashTuning(fwd_q=16, fwd_kv=16))
    out = jax.jit(lambda q, k, v: kernel(q, k, v, **kw))(q, k, v)
    assert rel_err(out, flash_reference(q, k, v, **kw)) < 2e-6
    cum = jnp.array([0, 5, 30, 41], jnp.int32)
    kw = dict(softmax_scale=0.25, causal=True, cum_seqlens_q=cum, cum_seqlens_k=cum)
    q1, k1, v1 = q[:1], k[:1], v[:1]
    out = jax.jit(lambda q, k, v: kernel(q, k, v, **kw))(q1, k1, v1)
    assert rel_err(out, flash_reference(q1, k1, v1, **kw)) < 2e-6
    assert float(jnp.max(jnp.abs(out[:, 41:]))) == 0.0  # padding past cum_seqlens[-1]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_lowers_for_sm90(dtype):
    """Triton lowering (jax side) of forward, dK/dV and dQ for an H100, at benchmark-like tilings (float32:
    IEEE dots)."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), dtype)
    kv = jax.ShapeDtypeStruct((1, 512, 1, 128), dtype)

    def loss(q, k, v):
        out = _kernel(interpret=False)(
            q, k, v, softmax_scale=0.1, causal=True, sliding_window=(256, 0), logits_soft_cap=30.0,
            softmax_aux=jnp.zeros((2, 3)), dropout_prob=0.1, dropout_seed=3,
        )
        return out.astype(jnp.float32).sum()

    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 3, text[:2000]


def test_refuses_what_it_does_not_implement(pallas_interpret_gpu):
    q = jnp.ones((1, 16, 1, 16), jnp.float32)
    cum = jnp.array([0, 16], jnp.int32)
    for extra, what in (
        ({"bias": jnp.ones((1, 1, 16, 16))}, "bias"),
        ({"attention_mask": jnp.ones((1, 1, 16, 16), bool)}, "attention_mask"),
        ({"q_segment_ids": jnp.zeros((1, 16), jnp.int32), "cum_seqlens_q": cum, "cum_seqlens_k": cum},
         "segment ids together with cum_seqlens"),
    ):
        with pytest.raises(UnsupportedFeature, match=f"{what} is not implemented \\(platform='xla' takes it\\)"):
            gpu.IMPLEMENTATION.supports(flash_call(q, q, q, **extra))
    wide = jnp.ones((1, 16, 1, 512))
    with pytest.raises(UnsupportedFeature, match="head_dim > 256"):
        gpu.IMPLEMENTATION.supports(flash_call(wide, wide, wide))


def test_tuning_validation():
    with pytest.raises(ValueError, match=r"GpuFlashTuning\.fwd_q=96: Triton blocks are powers of two"):
        GpuFlashTuning(fwd_q=96)
    with pytest.raises(ValueError, match=r"GpuFlashTuning\.bwd_warps=3: num_warps must be a power of two"):
        GpuFlashTuning(bwd_warps=3)
    with pytest.raises(ValueError, match=r"GpuFlashTuning\.fwd_stages must be a positive int, got 0"):
        GpuFlashTuning(fwd_stages=0)
    t = gpu.heuristic_tuning(8192, 8192)
    assert (t.fwd_q, t.fwd_kv, t.fwd_warps, t.dkv_q, t.dq_kv) == (128, 64, 4, 64, 64)
    assert gpu.heuristic_tuning(20, 9).fwd_kv == 16  # short sequences shrink the blocks


def test_float32_dots_run_ieee_unless_default_is_asked_for():
    """Triton runs a float32 dot as TF32 for DEFAULT and HIGH, IEEE for HIGHEST: float32 calls run IEEE
    (HIGH too: more precise than asked) unless the caller asked for "default"; 16-bit dots carry none."""

    def dot_precisions(dtype, **kw):
        q = jnp.ones((1, 16, 1, 16), dtype)
        dots = equations(lambda q: _kernel()(q, q, q, **kw), q, primitive="dot_general")
        return {eqn.params["precision"] for eqn in dots}

    highest, default = (jax.lax.Precision.HIGHEST,) * 2, (jax.lax.Precision.DEFAULT,) * 2
    assert dot_precisions(jnp.float32) == dot_precisions(jnp.float32, precision="high") == {highest}
    assert dot_precisions(jnp.float32, precision="default") == {default}
    assert dot_precisions(jnp.bfloat16, precision="highest") == {None}
