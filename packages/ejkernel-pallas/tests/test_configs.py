"""Block sizes come from the executor's config: the Pallas heuristics (TPU / GPU), the pruned autotuning
spaces, a config reaching the kernel's tiling, and bad blocks refused naming the config field."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import equations

from ejkernel.modules import FlashAttention, flash_attention, grouped_matmul, ragged_page_attention, ring_attention
from ejkernel.modules.operations.grouped_matmul import GroupedMatmul
from ejkernel.modules.operations.ring_attention import RingAttention
from ejkernel.ops import get_default_executor
from ejkernel_pallas import gpu_flash_attention as gpu
from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning
from ejkernel_pallas.tpu_flash_attention import TpuFlashBlocks
from ejkernel_pallas import tpu_flash_attention as tpu
from ejkernel_pallas.grouped_matmul import PallasGroupedMatmulConfig
from ejkernel_pallas.ragged_page_attention import TpuRaggedPageBlocks
from ejkernel_pallas.tpu_tiling import TpuTilingError


def _qkv(seq, dtype=jnp.bfloat16, head_dim=64, heads=2, batch=1):
    shape = (batch, seq, heads, head_dim)
    return [jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype) for i in range(3)]


def _pallas_grids(fn, *args):
    """The grid of every pallas_call in ``fn``'s jaxpr (nested jaxprs included), in program order."""
    return [tuple(eqn.params["grid_mapping"].grid) for eqn in equations(fn, *args, primitive="pallas_call")]


# ---- TPU (interpret mode on this machine) -----------------------------------------------------------


def test_executor_config_is_the_tpu_heuristic(pallas_interpret):
    """By sequence length (one block when short, 128-multiples when long) and head dim (caps halve above
    128); rows are whole sublane tiles (16 for bf16)."""
    executor = get_default_executor()
    for seq, head_dim, fwd, bwd in (
        (40, 64, (48, 48), (48, 48, 48, 48)),  # one block over the padded length
        (1000, 64, (512, 512), (256, 256, 256, 256)),
        (1000, 256, (256, 256), (128, 128, 128, 128)),
    ):
        cfg = executor.choose(FlashAttention(), *_qkv(seq, head_dim=head_dim), platform="pallas")
        assert cfg == TpuFlashBlocks(*fwd, *bwd), (seq, head_dim, cfg)
        for block in (*fwd, *bwd):
            assert block % 16 == 0 and (block % 128 == 0 or block >= seq)
    q, k, v = _qkv(256)
    ring_cfg = executor.choose(RingAttention(), q, k, v, platform="pallas")
    assert ring_cfg == TpuFlashBlocks(*(256,) * 6)  # the flash heuristic on the local shards
    lhs, rhs = jnp.ones((300, 200), jnp.bfloat16), jnp.ones((3, 200, 700), jnp.bfloat16)
    gmm_cfg = executor.choose(GroupedMatmul(), lhs, rhs, jnp.array([100, 100, 100], jnp.int32), platform="pallas")
    assert gmm_cfg == PallasGroupedMatmulConfig(block_m=304, block_k=200, block_n=512)


def test_config_space_candidates_all_tile():
    for seq, head_dim, segments in ((40, 64, False), (1000, 64, True), (4096, 128, True), (3000, 256, False)):
        candidates = tpu.candidate_blocks(seq, seq, jnp.bfloat16, head_dim)
        assert candidates[0] == tpu.heuristic_blocks(seq, seq, jnp.bfloat16, head_dim)
        assert 1 <= len(candidates) <= 8 and len(set(candidates)) == len(candidates)
        for blocks in candidates:
            tpu.validate_blocks(blocks, seq, seq, q_rows=16, kv_rows=16, kv_lanes=segments)
    gpu_space = gpu.candidate_tunings(8192, 8192)
    assert gpu_space[0] == GpuFlashTuning() and len(gpu_space) == 5
    assert all(t.fwd_q <= 32 and t.fwd_kv <= 32 for t in gpu.candidate_tunings(20, 9))  # fitted to short lengths


def test_a_config_with_other_blocks_changes_the_tiling(pallas_interpret):
    q, k, v = _qkv(256, dtype=jnp.float32)
    call = lambda cfg: lambda q, k, v: flash_attention(q, k, v, causal=True, platform="pallas", cfg=cfg)  # noqa: E731
    # the heuristic: one 256-row block -> grid (batch, heads, 1, 1)
    assert _pallas_grids(call(None), q, k, v) == [(1, 2, 1, 1)]
    heuristic = TpuFlashBlocks(*(256,) * 6)
    small = dataclasses.replace(heuristic, fwd_q=128, fwd_kv=64)
    assert _pallas_grids(call(small), q, k, v) == [(1, 2, 2, 4)]
    # the backward kernels follow dkv_* / dq_*: dK/dV grid (b, kv head, kv blocks, group, q blocks), dQ grid
    # (b, head, q blocks, kv blocks)
    bwd = dataclasses.replace(heuristic, dkv_q=64, dkv_kv=128, dq_q=32, dq_kv=256)
    grad = lambda q, k, v: jax.grad(lambda q: call(bwd)(q, k, v).sum())(q)  # noqa: E731
    assert _pallas_grids(grad, q, k, v) == [(1, 2, 1, 1), (1, 2, 2, 1, 4), (1, 2, 8, 1)]
    # and the numbers do not change with the tiling
    out = jax.jit(call(None))(q, k, v)
    assert float(jnp.max(jnp.abs(jax.jit(call(small))(q, k, v) - out))) < 1e-5


def test_bad_blocks_are_refused_naming_the_config_field(pallas_interpret):
    q, k, v = _qkv(256)
    heuristic = TpuFlashBlocks(*(256,) * 6)
    cases = [
        (dataclasses.replace(heuristic, fwd_q=24), {}, r"TpuFlashBlocks\.fwd_q=24: .*multiple of 16"),
        (dataclasses.replace(heuristic, dq_kv=8), {}, r"TpuFlashBlocks\.dq_kv=8: .*multiple of 16"),
        # per-key segment ids travel as [B, 1, S]: key blocks become lane tiles (multiples of 128)
        (dataclasses.replace(heuristic, fwd_kv=64), {"q_segment_ids": jnp.zeros((1, 256), jnp.int32)},
         r"TpuFlashBlocks\.fwd_kv=64: .*multiple of 128"),
    ]
    for cfg, extra, match in cases:
        with pytest.raises(TpuTilingError, match=match):
            flash_attention(q, k, v, platform="pallas", cfg=cfg, **extra)
    with pytest.raises(ValueError, match=r"TpuFlashBlocks\.dkv_kv must be a positive int, got -128"):
        dataclasses.replace(heuristic, dkv_kv=-128)
    with pytest.raises(TypeError, match="cfg must be a ejkernel_pallas.tpu_flash_attention.TpuFlashBlocks"):
        flash_attention(q, k, v, platform="pallas", cfg=GpuFlashTuning())
    ring_blocks = TpuFlashBlocks(fwd_q=256, fwd_kv=256, dkv_q=100, dkv_kv=256, dq_q=256, dq_kv=256)
    with pytest.raises(TpuTilingError, match=r"TpuFlashBlocks\.dkv_q=100: .*multiple of 16"):
        jax.grad(lambda q: ring_attention(q, k, v, cfg=ring_blocks).astype(jnp.float32).sum())(q)
    lhs, rhs, sizes = jnp.ones((300, 200)), jnp.ones((3, 200, 700)), jnp.array([100, 100, 100], jnp.int32)
    with pytest.raises(TpuTilingError, match=r"PallasGroupedMatmulConfig\.block_n=200: .*multiple of 128"):
        grouped_matmul(lhs, rhs, sizes, platform="pallas", cfg=PallasGroupedMatmulConfig(block_n=200))
    with pytest.raises(TpuTilingError, match=r"PallasGroupedMatmulConfig\.block_m=12: .*multiple of 8"):
        grouped_matmul(lhs, rhs, sizes, platform="pallas", cfg=PallasGroupedMatmulConfig(block_m=12))
    pages = jnp.ones((4, 8, 2, 16))
    with pytest.raises(TpuTilingError, match=r"TpuRaggedPageBlocks\.block_q=12: .*multiple of 8"):
        ragged_page_attention(jnp.ones((20, 2, 16)), pages, jnp.array([20], jnp.int32), jnp.array([[0, 1, 2, 3]], jnp.int32),
                              jnp.array([0, 20], jnp.int32), 1, platform="pallas",
                              cfg=TpuRaggedPageBlocks(block_q=12))


# ---- GPU (the Triton-lowered kernels; interpret mode "gpu" here) ---------------------------------------


def test_executor_config_is_the_gpu_heuristic(pallas_interpret_gpu):
    """The H200 defaults (NOTES.md): forward 128x64, 4 warps, 2 stages; backward 64x64, 4 warps, 2 stages;
    blocks shrink to short sequences."""
    executor = get_default_executor()
    cfg = executor.choose(FlashAttention(), *_qkv(8192, head_dim=128), platform="pallas")
    assert cfg == GpuFlashTuning(fwd_q=128, fwd_kv=64, fwd_warps=4, fwd_stages=2, dkv_q=64, dkv_kv=64, dq_q=64,
                                 dq_kv=64, bwd_warps=4, bwd_stages=2)
    short = executor.choose(FlashAttention(), *_qkv(20), platform="pallas")
    assert short == GpuFlashTuning(fwd_q=32, fwd_kv=32, dkv_q=32, dkv_kv=32, dq_q=32, dq_kv=32)


def test_gpu_config_reaches_the_kernel(pallas_interpret_gpu):
    """A GpuFlashTuning given as ``cfg`` sets the grid (values Triton cannot take: test_gpu_flash_attention)."""
    q, k, v = _qkv(64, dtype=jnp.float32)
    call = lambda cfg: lambda q, k, v: flash_attention(q, k, v, platform="pallas", cfg=cfg)  # noqa: E731
    assert _pallas_grids(call(None), q, k, v) == [(1, 1, 2)]  # (q blocks, batch, heads): one 64-row block
    assert _pallas_grids(call(GpuFlashTuning(fwd_q=16)), q, k, v) == [(4, 1, 2)]
