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


def test_mosaic_kernels_serve_dense_calls_on_hopper(monkeypatch):
    """On Hopper the heuristic takes the Mosaic GPU kernels for bf16 calls they can run (forward, dQ, dK/dV
    over the dense block schedules: three Mosaic GPU custom calls, no Triton one) and not for dropout or
    float32; a config asking for them where they cannot run is refused naming the field."""
    from ejkernel_pallas import mosaic_attention as mosaic

    q = jax.ShapeDtypeStruct((1, 300, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)
    call = flash_call(jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype), jnp.zeros(kv.shape, kv.dtype),
                      causal=True, logits_soft_cap=20.0)
    assert not gpu.heuristic_tuning(300, 300).mosaic_forward  # the tiles alone: Mosaic off
    monkeypatch.setattr(mosaic, "hopper_gpu", lambda: True)
    tuning = gpu.IMPLEMENTATION.heuristic_config(call)
    assert tuning.mosaic_forward and tuning.mosaic_backward
    assert gpu.IMPLEMENTATION.candidate_configs(call)[0] == tuning
    zeros = [jnp.zeros(x.shape, x.dtype) for x in (q, kv, kv)]
    dropout = flash_call(*zeros, dropout_prob=0.1, dropout_seed=1)
    assert not gpu.IMPLEMENTATION.heuristic_config(dropout).mosaic_forward
    assert "dropout runs in the Triton-lowered kernels" in mosaic.refusal(dropout)
    cum = jnp.array([0, 100, 300], jnp.int32)  # one array for both sides: the sequences run as segments
    assert gpu.IMPLEMENTATION.heuristic_config(flash_call(*zeros, cum_seqlens_q=cum, cum_seqlens_k=cum)).mosaic_forward
    separate = flash_call(*zeros, cum_seqlens_q=cum, cum_seqlens_k=cum + 0)
    assert "separate cum_seqlens_q / cum_seqlens_k arrays" in mosaic.refusal(separate)

    def loss(q, k, v):
        call = flash_call(q, k, v, causal=True, logits_soft_cap=20.0)
        return gpu.flash_attention(call, tuning).astype(jnp.float32).sum()

    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("@mosaic_gpu") == 3, text[:2000]
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") == 0, text[:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(True, None), (False, (40, 7))], ids=["causal", "window"])
def test_mosaic_kernels_take_packed_self_attention_on_gpu(causal, window):
    """Varlen with one cum_seqlens array for queries and keys runs the Mosaic GPU kernels (its sequences as
    segment ids) on a Hopper GPU: output and every gradient against the float64 reference, padding past the
    last sequence zero."""
    import numpy as np

    from ejkernel.testing.numerics import check_against_reference

    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((1, 300, 4, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 300, 2, 128)), jnp.bfloat16) for _ in range(2))
    cum = jnp.array([0, 100, 230, 290], jnp.int32)
    inputs = dict(query=q, key=k, value=v, cum_seqlens_q=cum, cum_seqlens_k=cum)
    static = dict(causal=causal, sliding_window=window, softmax_scale=128**-0.5)
    call = flash_call(q, k, v, **static, cum_seqlens_q=cum, cum_seqlens_k=cum)
    tuning = gpu.IMPLEMENTATION.heuristic_config(call)
    assert tuning.mosaic_forward and tuning.mosaic_backward, tuning

    def kernel(query, key, value, **cums):
        return gpu.flash_attention(flash_call(query, key, value, **static, **cums), tuning)

    def reference(query, key, value, **cums):
        return flash_reference(query, key, value, **static, **cums)

    out = check_against_reference(kernel, reference, inputs, ("query", "key", "value"), dtype=jnp.bfloat16)
    assert not np.asarray(out[:, 290:], np.float32).any()


def _native_cuda_kernels_run() -> bool:
    """Whether ejkernel-cuda is installed and its native flash kernels can run here."""
    try:
        from ejkernel_cuda import native_flash
    except ImportError:
        return False
    return native_flash.usable_here() is None


@pytest.mark.gpu
def test_auto_dispatch_ranks_the_mosaic_kernels_above_triton_on_hopper():
    """After cuDNN (which refuses soft caps) and ejkernel-cuda's native kernels where those run (ranked above
    these since 2026-11-27), platform='auto' takes the Pallas kernels where the Mosaic ones run
    (``priority_for``), the Triton backend's where only the Triton-lowered ones would (dropout)."""
    from ejkernel.modules.operations._dispatch import resolve
    from ejkernel.plugins import backends

    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    capped = resolve("flash_attention", None, flash_call(q, q, q, causal=True, logits_soft_cap=30.0))
    assert capped.platform == ("cuda" if _native_cuda_kernels_run() else "pallas"), capped
    dropout = resolve("flash_attention", None, flash_call(q, q, q, dropout_prob=0.1, dropout_seed=3))
    assert dropout.platform == ("triton" if "triton" in backends() else "pallas"), dropout
