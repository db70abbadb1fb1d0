"""Pallas GPU (Triton-lowered) block-sparse attention: the shared conformance suite in interpret mode on
CPU (CI-sized subset; all of it on the device with ``-m gpu``) and the lowering for sm_90."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_helpers import abstract_device, full_conformance

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention
from ejkernel.testing.blocksparse_attention import BlockSparseAttentionConformance, random_block_mask
from ejkernel.testing.numerics import INTERPRET_COMPILER_OPTIONS
from ejkernel_pallas import blocksparse_attention_gpu as gpu_blocksparse
from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning

CI_TESTS = set()  # CI runs test_kernel_blocks_walk_the_mask_blocks (every feature) instead


class Blocks16:
    """The suite's cases with their mask blocks raised to 16 (Triton blocks are powers of two >= 16; same
    lengths, so ragged tails, rows masked whole and GQA stay; coarser masks)."""

    mask_form_block = (16, 16)

    def make_inputs(self, seed, case, dtype, *, scale=1.0):
        batch, q_len, kv_len, heads, kv_heads, head_dim, v_dim, block, mask_heads = case
        case = (batch, q_len, kv_len, heads, kv_heads, head_dim, v_dim, (16, 16), mask_heads)
        return super().make_inputs(seed, case, dtype, scale=scale)


class TestPallasGpuBlockSparseInterpreted(Blocks16, BlockSparseAttentionConformance):
    """The GPU kernels interpreted on CPU."""

    platform = "pallas"
    verify_reference = False
    compiler_options = INTERPRET_COMPILER_OPTIONS

    @pytest.fixture(autouse=True)
    def _interpret_gpu(self, request, pallas_interpret_gpu):
        if not full_conformance() and request.node.name not in CI_TESTS:
            pytest.skip("CI-sized run: EJKERNEL_PALLAS_CONFORMANCE=1 runs the whole suite")
        yield


@pytest.mark.gpu
class TestPallasGpuBlockSparse(Blocks16, BlockSparseAttentionConformance):
    """On an NVIDIA GPU (``pytest -m gpu``)."""

    platform = "pallas"


def test_kernel_blocks_walk_the_mask_blocks():
    """32 x 32 mask blocks walked in 16-row / 16-column kernel tiles (a different tiling per pass), with
    causal + window + soft cap + sinks + segments + GQA + per-head masks + a row all off, odd lengths; against
    the reference, in interpret mode."""
    from ejkernel.testing.blocksparse_attention import reference_blocksparse_attention
    from ejkernel.testing.numerics import assert_close, forward_and_vjp

    rng = np.random.default_rng(4)
    batch, q_len, kv_len, heads, kv_heads, dim = 1, 77, 93, 4, 2, 32
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, dim)), jnp.float32)
    aux = jnp.asarray(rng.standard_normal((heads, 2)), jnp.float32)
    seg_q = jnp.asarray((np.arange(q_len) >= 30)[None], jnp.int32)
    seg_kv = jnp.asarray((np.arange(kv_len) >= 46)[None], jnp.int32)
    mask = random_block_mask(5, batch, heads, q_len, kv_len, 32, 32, density=0.6)
    static = dict(block_mask=mask, block_size=(32, 32), causal=True, sliding_window=(50, 4), logits_soft_cap=4.0)
    tuning = GpuFlashTuning(fwd_q=32, fwd_kv=16, dkv_q=16, dkv_kv=32, dq_q=16, dq_kv=16)

    def kernel(query, key, value, softmax_aux):
        call = BlockSparseAttention().validate(query, key, value, seg_q, seg_kv, softmax_aux, **static)
        return gpu_blocksparse.blocksparse_attention(call, tuning, interpret=True)

    def reference(query, key, value, softmax_aux):
        return reference_blocksparse_attention(query, key, value, seg_q, seg_kv, softmax_aux, **static)

    inputs = dict(query=q, key=k, value=v, softmax_aux=aux)
    wrt = tuple(inputs)
    out, grads, _ = forward_and_vjp(kernel, inputs, wrt, 3, INTERPRET_COMPILER_OPTIONS)
    want, want_grads, _ = forward_and_vjp(reference, inputs, wrt, 3)
    assert_close(out, want, dtype="float32")
    for name in wrt:
        assert_close(grads[name], want_grads[name], dtype="float32", gradient=True)
    with pytest.raises(ValueError, match="GpuFlashTuning.fwd_kv=64"):
        gpu_blocksparse.check_tuning(
            dataclasses.replace(tuning, fwd_kv=64), BlockSparseAttention().validate(q, k, v, **static)
        )


def test_refuses_blocks_triton_cannot_tile(pallas_interpret_gpu):
    q = jnp.ones((1, 64, 2, 32), jnp.float32)
    with pytest.raises(UnsupportedFeature, match="q_block_size=8"):
        gpu_blocksparse.IMPLEMENTATION.supports(BlockSparseAttention().validate(q, q, q, block_size=(8, 16)))
    assert gpu_blocksparse.refusal(BlockSparseAttention().validate(q, q, q, block_size=(16, 32))) is None


def test_heuristic_takes_the_wide_forward_for_128_blocks():
    q = jnp.zeros((1, 512, 2, 128), jnp.bfloat16)
    wide = gpu_blocksparse.heuristic_tuning(BlockSparseAttention().validate(q, q, q, block_size=128))
    assert (wide.fwd_q, wide.fwd_kv, wide.fwd_warps, wide.fwd_stages) == (128, 128, 8, 3)
    assert (wide.dkv_q, wide.dkv_kv, wide.bwd_warps) == (64, 64, 4)  # the backward keeps the flash defaults
    narrow = gpu_blocksparse.heuristic_tuning(BlockSparseAttention().validate(q, q, q, block_size=(128, 64)))
    assert (narrow.fwd_q, narrow.fwd_kv, narrow.fwd_warps, narrow.fwd_stages) == (128, 64, 4, 2)


@pytest.mark.parametrize("dtype,block", [(jnp.bfloat16, (128, 64)), (jnp.float32, (128, 64)),
                                         (jnp.bfloat16, (128, 128))])
def test_lowers_for_sm90(dtype, block):
    """Triton lowering (jax side) of forward, dK/dV and dQ for an H100: scalar schedule loads and the
    partial/full branch inside the block loop (128-blocks: the wide forward)."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), dtype)
    kv = jax.ShapeDtypeStruct((1, 512, 1, 128), dtype)
    mask = random_block_mask(0, 1, 2, 512, 512, *block)
    seg = jnp.zeros((1, 512), jnp.int32)

    def loss(q, k, v):
        call = BlockSparseAttention().validate(
            q, k, v, seg, seg, jnp.zeros((2, 3)), block_mask=mask, block_size=block, causal=True,
            sliding_window=(256, 0), logits_soft_cap=30.0,
        )
        out = gpu_blocksparse.blocksparse_attention(call, gpu_blocksparse.heuristic_tuning(call))
        return out.astype(jnp.float32).sum()

    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 3, text[:2000]


# ---------------------------------------------------------------------------------------------------
# The Mosaic GPU forward (ejkernel_pallas.mosaic_attention)

# (batch, q_len, kv_len, heads, kv_heads, head_dim, kv_block, causal, window, soft cap, mask density); names
# with "segments" / "sinks" add those (segments: two per sequence, split at different points for q and kv)
MOSAIC_CASES = {
    "segments_sinks_gqa": (2, 384, 384, 4, 2, 128, 128, True, None, None, 0.6),
    "segments_sinks_kv64": (1, 256, 320, 2, 1, 64, 64, False, (90, 30), 20.0, 0.8),
    "gqa_random_mask": (2, 384, 384, 4, 2, 128, 128, False, None, None, 0.5),
    "ragged_causal_window_cap": (1, 300, 333, 4, 4, 64, 64, True, (100, 20), 30.0, 0.7),
    "ragged_causal_window_cap_d64": (1, 300, 333, 4, 4, 64, 128, True, (100, 20), 30.0, 0.7),
    "mqa_causal_dense": (1, 512, 512, 4, 1, 128, 128, True, None, None, 1.0),
    "kv_blocks_64_long_rows": (1, 256, 1024, 2, 2, 128, 64, False, None, None, 0.8),
}


def _mosaic_case(name, dtype):
    batch, q_len, kv_len, heads, kv_heads, dim, kv_block, causal, window, cap, density = MOSAIC_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, dim)), dtype)
    mask = random_block_mask(3, batch, heads, q_len, kv_len, 128, kv_block, density=density)
    static = dict(block_mask=mask, block_size=(128, kv_block), causal=causal, sliding_window=window,
                  logits_soft_cap=cap)
    inputs = dict(query=q, key=k, value=v)
    if "segments" in name:
        q_ids = np.broadcast_to(np.arange(q_len) >= q_len // 3, (batch, q_len))
        inputs["q_segment_ids"] = jnp.asarray(q_ids, jnp.int32)
        inputs["kv_segment_ids"] = jnp.asarray(np.broadcast_to(np.arange(kv_len) >= kv_len // 2, (batch, kv_len)),
                                               jnp.int32)
    if "sinks" in name:
        inputs["softmax_aux"] = jnp.asarray(rng.standard_normal((heads, 2)), jnp.float32)
    return inputs, static


def test_mosaic_forward_refusals_name_the_reason(monkeypatch):
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    seg = jnp.zeros((1, 256), jnp.int32)
    validate = BlockSparseAttention().validate
    cases = {
        "dtype float32": validate(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32)),
        "head dims": validate(q[..., :96], q[..., :96], q[..., :96]),
        "mask blocks (64, 128)": validate(q, q, q, block_size=(64, 128)),
        "Hopper": validate(q, q, q),  # this machine has no GPU
    }
    for reason, call in cases.items():
        assert reason in gpu_blocksparse.mosaic.refusal(call), (reason, gpu_blocksparse.mosaic.refusal(call))
    call = validate(q, q, q)
    assert gpu_blocksparse.mosaic.refusal(call, check_device=False) is None
    with_segments_and_sinks = validate(q, q, q, seg, seg, jnp.zeros((2, 3)))
    assert gpu_blocksparse.mosaic.backward_refusal(with_segments_and_sinks, check_device=False) is None
    assert not gpu_blocksparse.heuristic_tuning(call).mosaic_forward  # no Hopper GPU here
    assert "key mask blocks of 64" in gpu_blocksparse.mosaic.backward_refusal(
        validate(q, q, q, block_size=(128, 64)), check_device=False)
    assert not any(t.mosaic_forward for t in gpu_blocksparse.candidate_tunings(call))
    applied = gpu_blocksparse.mosaic.applied
    both = GpuFlashTuning(mosaic_forward=True, mosaic_backward=True)
    assert applied(both, call, interpret=False) == GpuFlashTuning()  # no Hopper GPU: the Triton-lowered kernels
    with pytest.raises(ValueError, match="mosaic_forward must be a bool"):
        GpuFlashTuning(mosaic_forward=1)
    with pytest.raises(ValueError, match="mosaic_stages must be an int >= 2"):
        GpuFlashTuning(mosaic_stages=1)
    monkeypatch.setattr(gpu_blocksparse.mosaic, "hopper_gpu", lambda: True)
    assert gpu_blocksparse.heuristic_tuning(call).mosaic_forward
    assert gpu_blocksparse.heuristic_tuning(call).mosaic_backward
    assert applied(both, call, interpret=False) == both
    assert applied(both, call, interpret=True) == GpuFlashTuning()  # Pallas' interpreter runs no Mosaic kernel
    kv64 = validate(q, q, q, block_size=(128, 64))  # the forward only: the backward takes key blocks of 128
    assert applied(both, kv64, interpret=False) == GpuFlashTuning(mosaic_forward=True)
    three = GpuFlashTuning(mosaic_forward=True, mosaic_stages=3)
    with pytest.raises(ValueError, match="mosaic_stages=3: .* bytes of shared memory at head_dim 128"):
        applied(three, call, interpret=False)  # 3 x 64 KiB of K/V slots beside 32 KiB of Q/O: over 227 KiB
    assert applied(three, validate(q[..., :64], q[..., :64], q[..., :64]), interpret=False) == three


@pytest.mark.parametrize("name,mosaic_kernels", [("gqa_random_mask", 3), ("ragged_causal_window_cap", 1),
                                                 ("segments_sinks_gqa", 3), ("segments_sinks_kv64", 1)])
def test_mosaic_kernels_lower_for_sm90(name, mosaic_kernels, monkeypatch):
    """Mosaic GPU lowering (jax side) for an H100: forward, dQ and dK/dV for 128-row key blocks; the forward
    with the Triton-lowered backward for key blocks of 64."""
    inputs, static = _mosaic_case(name, jnp.bfloat16)
    monkeypatch.setattr(gpu_blocksparse.mosaic, "hopper_gpu", lambda: True)

    def loss(query, key, value):
        call = BlockSparseAttention().validate(query, key, value, **others, **static)
        tuning = gpu_blocksparse.heuristic_tuning(call)
        assert tuning.mosaic_forward
        return gpu_blocksparse.blocksparse_attention(call, tuning).astype(jnp.float32).sum()

    others = {name: value for name, value in inputs.items() if name not in ("query", "key", "value")}
    shapes = [jax.ShapeDtypeStruct(inputs[name].shape, inputs[name].dtype) for name in ("query", "key", "value")]
    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*shapes).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("@mosaic_gpu") == mosaic_kernels, text[:2000]
    triton_kernels = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call")
    assert triton_kernels == (0 if mosaic_kernels == 3 else 2), text[:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(MOSAIC_CASES))
def test_mosaic_kernels_on_gpu(name, dtype):
    """The Mosaic kernels (chosen by the heuristic on a Hopper GPU: the forward, and the backward where key
    blocks hold 128) against the float64 reference, output and every gradient: ragged tails, rows that see
    nothing, causal + window + soft cap, GQA/MQA."""
    from ejkernel.testing.blocksparse_attention import reference_blocksparse_attention
    from ejkernel.testing.numerics import check_against_reference

    inputs, static = _mosaic_case(name, dtype)
    call = BlockSparseAttention().validate(**inputs, **static)
    tuning = gpu_blocksparse.heuristic_tuning(call)
    assert tuning.mosaic_forward, gpu_blocksparse.mosaic.refusal(call)

    def kernel(**arrays):
        call = BlockSparseAttention().validate(**arrays, **static)
        return gpu_blocksparse.blocksparse_attention(call, tuning)

    def reference(**arrays):
        return reference_blocksparse_attention(**arrays, **static)

    wrt = tuple(name for name in inputs if "segment" not in name)  # every differentiable input, sinks too
    out = check_against_reference(kernel, reference, inputs, wrt, dtype=dtype)
    first = static["block_mask"].shape[2] // 2 * 128  # random_block_mask turns this query block's row off
    assert not np.asarray(out[:, first:first + 128], np.float32).any()


@pytest.mark.gpu
def test_auto_dispatch_ranks_the_mosaic_kernels_first_on_hopper():
    """platform='auto' on a Hopper GPU takes the Pallas block-sparse kernels where the Mosaic ones run forward
    and backward (``priority_for``: above Triton's), the Triton backend's where it is installed otherwise."""
    from ejkernel.modules.operations._dispatch import resolve
    from ejkernel.plugins import backends

    def chosen(name):
        inputs, static = _mosaic_case(name, jnp.bfloat16)
        return resolve("blocksparse_attention", None, BlockSparseAttention().validate(**inputs, **static)).platform

    assert chosen("gqa_random_mask") == "pallas"
    assert chosen("ragged_causal_window_cap") == ("triton" if "triton" in backends() else "pallas")  # key blocks 64
