"""Pallas GPU (Triton-lowered) block-sparse attention: the shared conformance suite in interpret mode on
CPU (CI-sized subset; all of it on the device with ``-m gpu``) and the lowering for sm_90."""

from __future__ import annotations

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

CI_TESTS = {"test_window_soft_cap_sinks_and_segments"}


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


def test_refuses_blocks_triton_cannot_tile(pallas_interpret_gpu):
    q = jnp.ones((1, 64, 2, 32), jnp.float32)
    with pytest.raises(UnsupportedFeature, match="q_block_size=8"):
        gpu_blocksparse.IMPLEMENTATION.supports(BlockSparseAttention().validate(q, q, q, block_size=(8, 16)))
    assert gpu_blocksparse.refusal(BlockSparseAttention().validate(q, q, q, block_size=(16, 32))) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_sm90(dtype):
    """Triton lowering (jax side) of forward, dK/dV and dQ for an H100: scalar schedule loads and the
    partial/full branch inside the block loop."""
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), dtype)
    kv = jax.ShapeDtypeStruct((1, 512, 1, 128), dtype)
    mask = random_block_mask(0, 1, 2, 512, 512, 128, 64)
    seg = jnp.zeros((1, 512), jnp.int32)

    def loss(q, k, v):
        call = BlockSparseAttention().validate(
            q, k, v, seg, seg, jnp.zeros((2, 3)), block_mask=mask, block_size=(128, 64), causal=True,
            sliding_window=(256, 0), logits_soft_cap=30.0,
        )
        out = gpu_blocksparse.blocksparse_attention(call, gpu_blocksparse.heuristic_tuning(call))
        return out.astype(jnp.float32).sum()

    with abstract_device("NVIDIA H100 80GB HBM3", "gpu", 132):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 3, text[:2000]
