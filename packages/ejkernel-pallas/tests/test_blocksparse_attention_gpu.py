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
