"""GPU tests of the Triton flash attention (run on the device: `pytest -m gpu`).

The shared conformance suite (float64 reference, every feature, fp32/bf16/fp16) with platform="triton",
plus larger bf16 problems that span many blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations.flash_attention import flash_attention
from ejkernel.testing.flash_attention import FlashAttentionConformance, reference_flash_attention
from ejkernel.testing.numerics import relative_error
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY


class TestTritonFlashAttentionConformance(FlashAttentionConformance):
    platform = "triton"
    allow_unsupported = True  # bias and attention_mask are refused (the dispatcher falls back)


def triton_attention(q, k, v, **kw):
    return flash_attention(q, k, v, platform="triton", **kw)


def float32_reference(q, k, v, **kw):
    """The dense reference in float32 with float32 matmuls (not TF32)."""
    with jax.default_matmul_precision("highest"):
        return reference_flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)), **kw)


@pytest.mark.parametrize(
    "d,h,hkv,seq,kw",
    [
        (128, 8, 2, 1000, dict(causal=True)),
        (64, 4, 4, 1536, dict(sliding_window=(300, 20), logits_soft_cap=20.0)),
        (256, 4, 1, 777, dict(causal=True, softmax_aux=True)),
        (96, 4, 2, 640, dict()),
        # no mask, D=128, whole blocks: the TMA + warp-specialized forward (test below checks it is taken)
        (128, 8, 2, 1024, dict(logits_soft_cap=30.0, softmax_aux=True)),
    ],
)
def test_bf16_many_blocks_matches_float32_reference(d, h, hkv, seq, kw):
    ks = jax.random.split(jax.random.key(seq + d), 5)
    b = 2
    q = jax.random.normal(ks[0], (b, seq, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, seq, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, seq, hkv, d), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, seq, h, d), jnp.float32).astype(jnp.bfloat16)
    if kw.pop("softmax_aux", False):
        kw["softmax_aux"] = jax.random.normal(ks[4], (h,), jnp.float32)

    def run(fn, q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (out, *pullback(do))

    ours = jax.jit(lambda *a: run(triton_attention, *a))(q, k, v, do)
    ref = jax.jit(lambda *a: run(float32_reference, *a))(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert relative_error(a, r) < 1.5e-2, (name, relative_error(a, r))


def test_varlen_matches_per_sequence_calls():
    lengths = [300, 1, 517, 64]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    total = int(cu[-1]) + 13  # padding rows past the last sequence
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, total, 4, 64), jnp.float32).astype(jnp.bfloat16) for kk in ks)
    packed = triton_attention(q, k, v, causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu)
    assert np.all(np.asarray(packed[0, cu[-1]:], np.float32) == 0)
    for n in range(len(lengths)):
        s, e = int(cu[n]), int(cu[n + 1])
        alone = triton_attention(q[:, s:e], k[:, s:e], v[:, s:e], causal=True)
        assert relative_error(packed[:, s:e], alone) < 1e-2


def test_unmasked_d128_forward_takes_the_tma_kernel(monkeypatch):
    from ejkernel_triton.flash_attention import forward

    calls = []
    original = forward.forward_tma
    monkeypatch.setattr(forward, "forward_tma", lambda *a: calls.append(1) or original(*a))
    q = jax.random.normal(jax.random.key(0), (2, 1024, 4, 128), jnp.float32).astype(jnp.bfloat16)
    out = triton_attention(q, q, q)
    ref = float32_reference(q, q, q)
    assert calls and relative_error(out, ref) < 1e-2
    calls.clear()
    triton_attention(q, q, q, causal=True)
    assert not calls  # causal keeps the pointer kernel (faster there)
