"""The CUDA backend's cuDNN attention: flash_attention and ring_attention.

CPU: registration, the backend's status, what cuDNN refuses (before anything compiles), the private JAX API
it reaches being there. GPU (``-m gpu``, on the device): flash_attention's conformance suite in bfloat16,
long bf16 problems against float32, the ring schedule's contract on cuDNN's blocks (two kv halves merged by
log-sum-exp, each half's backward from the merged output and lse), a one-GPU ring, and the ring over every
GPU of the host (the shared :class:`DeviceRingConformance`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules import flash_attention
from ejkernel.modules.operations.flash_attention import FlashAttention
from ejkernel.modules.operations.ring_attention import RingAttention
from ejkernel.testing.flash_attention import FlashAttentionConformance, reference_flash_attention
from ejkernel.testing.numerics import assert_close, normal_array
from ejkernel.testing.scaled_dot_product_attention import ScaledDotProductAttentionConformance
from ejkernel.testing.ring_attention import DeviceRingConformance, check_one_device_ring, merged_blocks
from ejkernel_cuda import cudnn_attention, plugin
from ejkernel_cuda.flash_attention import IMPLEMENTATION as FLASH
from ejkernel_cuda.ring_attention import IMPLEMENTATION as RING

ON_GPU = jax.default_backend() == "gpu"


def _flash_call(dtype=jnp.bfloat16, q_len=128, kv_len=128, head_dim=64, v_head_dim=None, **kw):
    q = jnp.zeros((1, q_len, 4, head_dim), dtype)
    k = jnp.zeros((1, kv_len, 2, head_dim), dtype)
    v = jnp.zeros((1, kv_len, 2, v_head_dim or head_dim), dtype)
    return FlashAttention().validate(q, k, v, **kw)


def test_registered_with_the_highest_gpu_priority():
    assert plugin.IMPLEMENTATIONS == {"flash_attention": "ejkernel_cuda.flash_attention:IMPLEMENTATION",
                                      "ring_attention": "ejkernel_cuda.ring_attention:IMPLEMENTATION",
                                      "scaled_dot_product_attention":
                                          "ejkernel_cuda.scaled_dot_product_attention:IMPLEMENTATION",
                                      "ragged_page_attention": "ejkernel_cuda.ragged_page_attention:IMPLEMENTATION"}
    assert plugin.BACKEND.priority > 15  # above Triton: the faster kernel is tried first


def test_scaled_dot_product_attention_refuses_what_cudnn_cannot_take():
    from ejkernel.modules.operations.scaled_dot_product_attention import ScaledDotProductAttention
    from ejkernel_cuda.scaled_dot_product_attention import IMPLEMENTATION as SDPA

    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    SDPA.supports(ScaledDotProductAttention().validate(q, k, k, causal=True))
    with pytest.raises(UnsupportedFeature, match="bias"):
        SDPA.supports(ScaledDotProductAttention().validate(q, k, k, jnp.zeros((1, 4, 128, 128), jnp.bfloat16)))


def test_jax_exposes_what_the_blocks_use():
    assert cudnn_attention.api_missing() is None


@pytest.mark.skipif(ON_GPU, reason="the status on a machine without a GPU")
def test_status_without_a_gpu_names_the_reason():
    assert plugin.BACKEND.check_usable() == "no GPU visible"


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(head_dim=36), "head dims 36/36"),
    (dict(head_dim=64, v_head_dim=32), "head dims 64/32"),
    (dict(causal=True, kv_len=256), "query length 128 != key length 256"),
    (dict(sliding_window=(8, 4)), "reaches right"),
    (dict(logits_soft_cap=5.0), "logits_soft_cap"),
    (dict(softmax_aux=jnp.zeros((4,))), "softmax_aux"),
    (dict(dropout_prob=0.1, dropout_seed=1), "dropout_prob"),
    (dict(bias=jnp.zeros((1, 4, 128, 128), jnp.bfloat16)), "bias"),
    (dict(q_segment_ids=jnp.zeros((1, 128), jnp.int32), kv_segment_ids=jnp.zeros((1, 128), jnp.int32)),
     "segment_ids"),
])
def test_flash_attention_refuses_what_cudnn_cannot_compute(kw, match):
    with pytest.raises(UnsupportedFeature, match=match):
        FLASH.supports(_flash_call(**kw))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(sliding_window=(16, 0)),
                                dict(causal=True, sliding_window=(16, 0)), dict(kv_len=300)])
def test_flash_attention_takes(kw):
    FLASH.supports(_flash_call(**kw))


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=16), "sliding_window"),
    (dict(logits_soft_cap=3.0), "logits_soft_cap"),
    (dict(segments=True), "segment_ids"),
    (dict(causal=True, kv_len=64), "query length 128 != key length 64"),
])
def test_ring_refuses_what_its_blocks_do_not_carry(kw, match):
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, kw.pop("kv_len", 128), 2, 64), jnp.bfloat16)
    seg = [jnp.zeros(x.shape[:2], jnp.int32) for x in (q, k)] if kw.pop("segments", False) else [None, None]
    with pytest.raises(UnsupportedFeature, match=match):
        RING.supports(RingAttention().validate(q, k, k, *seg, **kw))
    RING.supports(RingAttention().validate(q, q[:, :, :2], q[:, :, :2], causal=True, sequence_layout="zigzag"))


# ---- GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU"))


@gpu
class TestCudnnFlashAttentionConformance(FlashAttentionConformance):
    platform = "cuda"
    input_dtype = jnp.bfloat16  # cuDNN takes half precision only: every test runs in bfloat16
    allow_unsupported = True  # masks, bias, segments, soft cap, sinks, dropout, varlen are refused


@gpu
class TestCudnnScaledDotProductAttentionConformance(ScaledDotProductAttentionConformance):
    platform = "cuda"
    input_dtype = jnp.bfloat16
    allow_unsupported = True
    verify_reference = False


@gpu
class TestCudnnRingOfGpus(DeviceRingConformance):
    platform = "cuda"
    min_accepted = 4  # the device cases without segments or soft cap


def _inputs(b, s, h, hkv, d, dtype="bfloat16"):
    return [normal_array(i, shape, dtype) for i, shape in
            enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)])]


@gpu
@pytest.mark.parametrize("d,h,hkv,seq,kw", [
    (128, 8, 2, 1000, dict(causal=True)),
    (64, 4, 4, 1536, dict(sliding_window=(300, 0))),
    (256, 4, 1, 777, dict(causal=True)),
    (96, 4, 2, 640, dict()),
])
def test_bf16_long_problems_match_float32(d, h, hkv, seq, kw):
    q, k, v, do = _inputs(2, seq, h, hkv, d)

    def run(fn, *args):
        out, pullback = jax.vjp(fn, *args[:3])
        return (out, *pullback(args[3]))

    got = jax.jit(lambda *a: run(lambda q, k, v: flash_attention(q, k, v, platform="cuda", **kw), *a))(q, k, v, do)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: run(lambda q, k, v: reference_flash_attention(q, k, v, **kw), *a))(
            *(x.astype(jnp.float32) for x in (q, k, v, do)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w, dtype="bfloat16", gradient=name != "out", name=name)


@gpu
def test_auto_takes_cudnn_for_what_it_supports():
    q, k, v, _ = _inputs(1, 256, 4, 2, 128)
    assert FlashAttention().explain(q, k, v, causal=True).platform == "cuda"
    # cuDNN refuses soft caps: next come this backend's native kernels on Hopper (ranked above the Pallas and
    # Triton kernels for the calls they take), else the Pallas kernels where installed, else Triton's
    from ejkernel.plugins import backends
    from ejkernel_cuda import native_flash

    if native_flash.usable_here() is None:
        expected = "cuda"
    else:
        expected = "pallas" if "pallas" in backends() else "triton"
    assert FlashAttention().explain(q, k, v, logits_soft_cap=5.0).platform == expected


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_merge_exactly_on_the_gpu(causal):
    """The ring schedule's contract on cuDNN: the first kv half (causal diagonal or full) and the second
    merged by their log-sum-exps, and each half's backward from the merged output and lse, equal flash
    attention over the whole sequence."""
    from ejkernel_cuda.ring_attention import CudnnRingBlocks

    b, s, h, hkv, d = 2, 1024, 4, 2, 128
    q, k, v, do = _inputs(b, s, h, hkv, d)
    blocks = CudnnRingBlocks(d ** -0.5)
    half = s // 2
    # queries of the second half see the first half in full and the second through the diagonal (causal),
    # or both halves in full
    qh, doh = (q[:, half:], do[:, half:]) if causal else (q, do)
    parts = [(k[:, :half], v[:, :half], None, False), (k[:, half:], v[:, half:], None, causal)]
    got = jax.jit(lambda: merged_blocks(blocks, qh, doh, parts))()
    flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="triton")[:, half:] if causal \
        else flash_attention(q, k, v, platform="triton")  # noqa: E731
    out, pullback = jax.vjp(flash, q, k, v)
    dq, dk, dv = pullback(doh)
    want = (out, dq[:, half:] if causal else dq, dk, dv)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w, dtype="bfloat16", gradient=name != "out", name=name)


@gpu
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("contiguous", True), ("zigzag", True)])
def test_one_gpu_ring_matches_flash_attention(layout, causal):
    check_one_device_ring("cuda", "triton", layout, causal, (1, 2048, 8, 2, 128))
