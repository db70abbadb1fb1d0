"""GPU tests of the Triton block-sparse attention (run on the device: `pytest -m gpu`).

The shared conformance suite with platform="triton", its cases mapped by the suite's hook onto what the
kernels take (``head_dims`` 64/128, ``block_multiple`` 16; the suite's lengths, head counts, masks and
features kept), and bf16 at a serving shape (S=1024, D=128, GQA 4:1, 128-blocks at 25 % density, per-head masks)
against the float32 reference, plus a full mask against the Triton flash attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import blocksparse_attention, flash_attention
from ejkernel.testing.blocksparse_attention import (
    BlockSparseAttentionConformance,
    random_block_mask,
    reference_blocksparse_attention,
)
from ejkernel.testing.numerics import assert_close, normal_array
from ejkernel_triton.blocksparse_attention import TritonBlockSparseConfig
from gpu_support import GPU_ONLY

pytestmark = GPU_ONLY


class TestTritonBlockSparseConformance(BlockSparseAttentionConformance):
    platform = "triton"
    head_dims = (64, 128)  # the suite maps its cases onto what the kernels take
    block_multiple = 16  # (mask blocks: multiples of the smallest kernel tile)


class TestTritonBlockSparseSmallTilesConformance(TestTritonBlockSparseConformance):
    """Every mask block spans several kernel tiles (16-row tiles)."""

    cfg = TritonBlockSparseConfig(16, 16, 4, 2, 16, 16, 16, 16, 4, 1)


def _grads(fn, q, k, v, aux, do):
    out, pullback = jax.vjp(fn, q, k, v, aux)
    return (out, *pullback(do))


def _serving_problem(seq_len, mask_seed):
    """bf16 q, k, v, d_out ``[2, seq_len, 8 (2 kv) heads, 128]``, float32 sinks, 128-blocks at 25 % density."""
    b, s, h, hkv, d = 2, seq_len, 8, 2, 128
    q, k, v, do = (normal_array(i, shape, "bfloat16") for i, shape in
                   enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)]))
    aux = normal_array(9, (h,))
    mask = random_block_mask(mask_seed, b, h, s, s, 128, 128, density=0.25)
    return q, k, v, do, aux, mask


def _assert_matches_float32_reference(q, k, v, do, aux, cfg=None, **kw):
    """The Triton output and gradients (q, k, v, sinks) against the reference on the float32 inputs."""
    got = jax.jit(lambda *a: _grads(lambda q, k, v, x: blocksparse_attention(
        q, k, v, softmax_aux=x, platform="triton", cfg=cfg, **kw), *a))(q, k, v, aux, do)
    ref = jax.jit(lambda *a: _grads(lambda q, k, v, x: reference_blocksparse_attention(
        q, k, v, softmax_aux=x, **kw), *a))(*(x.astype(jnp.float32) for x in (q, k, v)), aux, do.astype(jnp.float32))
    for name, g, r in zip(("out", "dq", "dk", "dv", "d_aux"), got, ref):
        assert_close(g, r, dtype="bfloat16", gradient=name != "out", name=name)


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_serving_shape_against_float32_reference(causal):
    q, k, v, do, aux, mask = _serving_problem(1024, mask_seed=3)
    _assert_matches_float32_reference(q, k, v, do, aux, block_mask=mask, block_size=128, causal=causal)


def test_full_mask_matches_flash_attention():
    b, s, h, d = 1, 1000, 4, 64
    q, k, v = (normal_array(i, (b, s, h, d), "bfloat16") for i in range(3))
    sparse = blocksparse_attention(q, k, v, causal=True, block_size=128, platform="triton")
    dense = flash_attention(q, k, v, causal=True, platform="triton")
    np.testing.assert_allclose(np.asarray(sparse, np.float32), np.asarray(dense, np.float32), atol=2e-2, rtol=2e-2)


def test_tma_forward_against_float32_reference():
    """The Hopper TMA forward (non-causal, whole blocks, D=128; one program per query tile) with the backward
    it feeds; the mask has a row that visits nothing (`random_block_mask`): the loop's discarded visit."""
    import dataclasses

    from ejkernel_triton.blocksparse_attention import IMPLEMENTATION, tma_forward_applies
    from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention

    q, k, v, do, aux, mask = _serving_problem(1024, mask_seed=4)
    kw = dict(block_mask=mask, block_size=128, causal=False, logits_soft_cap=30.0)
    call = BlockSparseAttention().validate(q, k, v, softmax_aux=aux, **kw)
    cfg = dataclasses.replace(IMPLEMENTATION.heuristic_config(call), fwd_block_q=128, fwd_block_kv=128,
                              fwd_num_warps=4, fwd_num_stages=2, tma_forward=True)
    assert tma_forward_applies(call, cfg)
    _assert_matches_float32_reference(q, k, v, do, aux, cfg, **kw)


@pytest.mark.parametrize("tma,causal", [(True, False), (False, True)],
                         ids=["tma", "pointer-causal"])
def test_persistent_forward_against_float32_reference(tma, causal):
    """The persistent forwards (`persistent_forward=1`: one program per SM looping over the items, longest
    schedule rows first), TMA where it applies, the pointer kernel with causal partial blocks."""
    import dataclasses

    from ejkernel_triton.blocksparse_attention import IMPLEMENTATION, tma_forward_applies
    from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention

    q, k, v, do, aux, mask = _serving_problem(2048, mask_seed=5)  # 2 x 8 x 16 items over 132 programs: some take two
    kw = dict(block_mask=mask, block_size=128, causal=causal, logits_soft_cap=30.0)
    call = BlockSparseAttention().validate(q, k, v, softmax_aux=aux, **kw)
    cfg = dataclasses.replace(IMPLEMENTATION.heuristic_config(call), persistent_forward=1)
    assert tma_forward_applies(call, cfg) is tma
    _assert_matches_float32_reference(q, k, v, do, aux, cfg, **kw)
