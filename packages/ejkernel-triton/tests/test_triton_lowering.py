"""Every Triton kernel compiles for sm_90 on a CPU-only machine (lowering through jax-triton).

jax-triton compiles the kernels (Triton -> PTX -> cubin with ptxas) while JAX lowers for the "cuda"
platform, which the CUDA plugin makes possible with JAX_PLATFORMS=cpu and no GPU.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules.operations.flash_attention import FlashAttention
from ejkernel_triton import launch
from ejkernel_triton.flash_attention import IMPLEMENTATION
from interpreter_support import CUDA_LOWERING

pytestmark = CUDA_LOWERING


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")


def _attend(q, k, v, **kw):
    """The Triton implementation on the validated call, with its heuristic config (no dispatch: no GPU here)."""
    call = FlashAttention().validate(q, k, v, **kw)
    return IMPLEMENTATION(call, IMPLEMENTATION.heuristic_config(call))


def _lower_fwd_bwd(q, k, v, **kw):
    def loss(q, k, v, *extra):
        return _attend(q, k, v, **kw).astype(jnp.float32).sum()

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",))
    return lowered.as_text()


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "dtype,d,kw",
    [
        (jnp.bfloat16, 128, dict(causal=True)),
        (jnp.float16, 64, dict(sliding_window=(64, 0), logits_soft_cap=30.0)),
        (jnp.float32, 64, dict(causal=True)),
    ],
    ids=["bf16-d128-causal", "fp16-d64-window-softcap", "fp32-d64-causal"],
)
def test_fwd_bwd_compile_for_sm90(dtype, d, kw):
    b, s, h, hkv = 2, 256, 4, 2
    text = _lower_fwd_bwd(_spec((b, s, h, d), dtype), _spec((b, s, hkv, d), dtype), _spec((b, s, hkv, d), dtype), **kw)
    # forward, dK/dV and dQ kernels; float32 adds the delta kernel (IEEE dots on CUDA cores)
    assert text.count("triton_kernel_call") >= (4 if dtype == jnp.float32 else 3)


def test_all_features_compile_for_sm90():
    """Varlen + segments + sinks + dropout + GQA + non-power-of-two head dim, bf16, D=96."""
    dtype, d = jnp.bfloat16, 96
    q, k, v = _spec((1, 300, 4, d), dtype), _spec((1, 300, 1, d), dtype), _spec((1, 300, 1, d), dtype)
    cu = jnp.array([0, 100, 250, 290], jnp.int32)
    seg = jnp.zeros((1, 300), jnp.int32)

    def loss(q, k, v, aux):
        out = _attend(q, k, v, causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu, q_segment_ids=seg,
                                 kv_segment_ids=seg, softmax_aux=aux, dropout_prob=0.1, dropout_seed=3)
        return out.astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, _spec((4, 2), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") >= 3


def test_head_dim_256_compiles_for_sm90():
    dtype = jnp.bfloat16
    q = _spec((1, 128, 2, 256), dtype)
    text = jax.jit(lambda q, k, v: _attend(q, k, v)).trace(q, q, q).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton_kernel_call" in text


def test_unmasked_bf16_forward_takes_the_warp_specialized_tma_kernel():
    """No mask, bf16, D=128, whole blocks: the forward is `_fwd_tma_kernel`, compiled with a producer
    warpgroup (12 warps from 4 requested, setmaxnreg) and descriptors in global scratch, and the backward keeps
    the pointer kernels (jax-triton); a causal call keeps the pointer forward too."""
    q = _spec((2, 1024, 4, 128), jnp.bfloat16)
    kv = _spec((2, 1024, 2, 128), jnp.bfloat16)
    launch._COMPILED.clear()
    text = _lower_fwd_bwd(q, kv, kv, logits_soft_cap=30.0)
    assert text.count("triton_kernel_call") == 3
    (compiled,) = launch._COMPILED.values()
    assert compiled.name == "_fwd_tma_kernel"
    assert compiled.num_warps == 12 and "setmaxnreg" in compiled.ptx
    assert compiled.scratch_size > 0  # the descriptors live in per-program global scratch
    launch._COMPILED.clear()
    _lower_fwd_bwd(q, kv, kv, causal=True)
    assert not launch._COMPILED
