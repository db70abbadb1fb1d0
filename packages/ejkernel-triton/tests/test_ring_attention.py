"""Triton ``ring_attention`` (the shared ring schedule on the Triton flash kernels).

CPU: refusals, registration, the blocks' forward and backward lowered for sm_90. GPU (``-m gpu``, on the
device): the schedule's contract on the kernels (two kv halves merged by log-sum-exp, each half's backward
from the merged output and lse, against flash attention on the whole sequence), a one-GPU ring through
the dispatcher, and the ring over every GPU of the host (the shared :class:`DeviceRingConformance`; skipped
with one GPU). The schedule itself (every step kind, 8 devices) is checked with plain jnp blocks in
ejkernel-core's test_ring_schedule.py.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules import flash_attention
from ejkernel.modules.operations.ring_attention import RingAttention
from ejkernel.testing.numerics import assert_close, normal_array
from ejkernel.testing.ring_attention import DeviceRingConformance, check_one_device_ring, merged_blocks
from ejkernel_triton import launch, plugin
from ejkernel_triton.ring_attention import IMPLEMENTATION
from interpreter_support import CUDA_LOWERING

AXIS = "sp"


def _call(**kw):
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, kw.pop("kv_len", 128), 2, 64), jnp.bfloat16)
    return RingAttention().validate(q, k, k, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=16), "sliding_window"),
    (dict(softmax_aux=jnp.zeros((4,))), "softmax_aux"),
    (dict(causal=True, kv_len=64), "causal with local query length"),
])
def test_refuses_what_the_xla_ring_takes(kw, match):
    with pytest.raises(UnsupportedFeature, match=match):
        IMPLEMENTATION.supports(_call(**kw))


def test_registered_for_ring_attention():
    assert plugin.IMPLEMENTATIONS["ring_attention"] == "ejkernel_triton.ring_attention:IMPLEMENTATION"
    IMPLEMENTATION.supports(_call(causal=True, sequence_layout="zigzag"))


@CUDA_LOWERING
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_compile_for_sm90(monkeypatch, causal):
    """The blocks' forward and backward (kernel calls, lse conversions) lowered for sm_90."""
    from ejkernel_triton.ring_attention import TritonRingBlocks

    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    call = _call(causal=causal, kv_len=128)
    blocks = TritonRingBlocks(IMPLEMENTATION.heuristic_config(call), call.softmax_scale, 0.0, False)
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)

    def step(q, k, v):
        out, lse = blocks.forward(q, k, v, None, None, causal)
        return blocks.backward(q, k, v, None, None, out, lse, out, causal)

    text = jax.jit(step).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") >= 3  # forward, dK/dV, dQ


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")(fn))


@gpu_test
@pytest.mark.parametrize("segments", [False, True], ids=["", "segments"])
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["", "softcap"])
def test_blocks_merge_exactly_on_the_gpu(segments, softcap):
    """The ring schedule's contract on the Triton kernels: two kv halves merged by their log-sum-exps, and
    each half's backward from the merged output and lse, equal flash attention over the whole sequence
    (bf16, GQA 4:2, D=128, 1024 tokens)."""
    from ejkernel_triton.ring_attention import TritonRingBlocks

    b, s, h, hkv, d = 2, 1024, 4, 2, 128
    q, k, v, do = (normal_array(i, shape, "bfloat16") for i, shape in
                   enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)]))
    seg = None
    if segments:
        seg = jnp.asarray(np.broadcast_to(np.minimum(np.arange(s) * 3 // s, 2), (b, s)), jnp.int32)
    call = RingAttention().validate(q, k, v, seg, seg, logits_soft_cap=softcap)
    blocks = TritonRingBlocks(IMPLEMENTATION.heuristic_config(call), call.softmax_scale, softcap or 0.0, False)
    half = s // 2
    halves = [(k[:, :half], v[:, :half], None if seg is None else seg[:, :half], False),
              (k[:, half:], v[:, half:], None if seg is None else seg[:, half:], False)]
    got = jax.jit(lambda: merged_blocks(blocks, q, do, halves, seg))()

    def flash(q, k, v):
        return flash_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, logits_soft_cap=softcap,
                               platform="triton")

    out, pullback = jax.vjp(flash, q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (out, *pullback(do))):
        assert_close(g, w, dtype="bfloat16", gradient=name != "out", name=name)



@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs GPUs")
class TestTritonRingOfGpus(DeviceRingConformance):
    platform = "triton"
    min_accepted = 8  # refuses only the sinks and window cases


@gpu_test
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("contiguous", True), ("zigzag", True)])
def test_one_gpu_ring_matches_flash_attention(layout, causal):
    """ring_attention(platform="triton") under shard_map on a one-GPU mesh (the diagonal / full steps)."""
    check_one_device_ring("triton", "triton", layout, causal, (1, 2048, 8, 2, 128))


@CUDA_LOWERING
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("contiguous", True), ("zigzag", True)])
def test_one_device_ring_compiles_for_sm90(monkeypatch, layout, causal):
    """The whole ring under shard_map (one-device mesh) with its gradients, lowered for sm_90: the step
    branches' types agree although the kernels' results carry no varying-axis mark (caught on the H200
    before the schedule marked them)."""
    from jax.sharding import PartitionSpec as P

    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    mesh = jax.make_mesh((1,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    spec = P(None, AXIS)

    def local(q, k, v):
        call = RingAttention().validate(q, k, v, causal=causal, axis_name=AXIS, sequence_layout=layout)
        return IMPLEMENTATION(call, IMPLEMENTATION.heuristic_config(call))

    def loss(q, k, v):
        ring = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        return ring(q, k, v).astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") >= 3
