"""The Triton block-sparse attention on a CPU-only machine: interpreter numerics (every gradient, sinks
included; blocksparse_interpreter_cases.py, in a subprocess), sm_90 lowering, the schedule order the kernels
rely on, and what the implementation and its config accept."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention
from ejkernel.ops.utils.block_sparse import effective_block_mask
from ejkernel.testing.blocksparse_attention import random_block_mask
from ejkernel_triton import launch, plugin
from ejkernel_triton.blocksparse_attention import IMPLEMENTATION, TritonBlockSparseConfig, tma_forward_applies
from ejkernel_triton.blocksparse_attention.kernels import kernel_schedule
from interpreter_support import CUDA_LOWERING, case_row_fixture


CASES_SCRIPT = Path(__file__).with_name("blocksparse_interpreter_cases.py")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _call(q_len=256, kv_len=256, heads=4, kv_heads=2, dim=64, v_dim=None, dtype=jnp.bfloat16, block_size=128,
          mask=None, **kw):
    q = jnp.zeros((1, q_len, heads, dim), dtype)
    k = jnp.zeros((1, kv_len, kv_heads, dim), dtype)
    v = jnp.zeros((1, kv_len, kv_heads, v_dim or dim), dtype)
    return BlockSparseAttention().validate(q, k, v, block_mask=mask, block_size=block_size, **kw)


interpreter_results, case_row = case_row_fixture(CASES_SCRIPT)


def test_interpreter_case_matches_reference(case_row):
    name, row = case_row
    assert row["finite"], row
    for quantity in ("out", "dq", "dk", "dv", "d_aux"):
        assert row[quantity] <= TOLERANCE[row["dtype"]], (quantity, row)
    assert row.get("masked_rows_zero", True), row
    forward = {"hopper_tma_forward": "_fwd_tma_kernel", "persistent_forward": "_fwd_persistent_kernel",
               "hopper_tma_persistent_forward": "_fwd_tma_persistent_kernel"}.get(name, "_fwd_kernel")
    assert forward in row["kernels"] and {"_dkv_kernel", "_dq_kernel"} <= set(row["kernels"]), row


def test_registered():
    assert plugin.IMPLEMENTATIONS["blocksparse_attention"] == "ejkernel_triton.blocksparse_attention:IMPLEMENTATION"


@pytest.mark.parametrize("by", ["q", "kv"])
def test_schedule_puts_full_blocks_first_and_visits_every_kept_block(by):
    mask = random_block_mask(0, 1, 2, 200, 300, 32, 16, density=0.4)
    call = _call(200, 300, heads=2, kv_heads=1, block_size=(32, 16), mask=mask, causal=True, sliding_window=(90, 10))
    indices, num_full, counts = map(np.asarray, kernel_schedule(call, by))
    effective = np.asarray(effective_block_mask(call))
    if by == "kv":
        effective = effective.swapaxes(2, 3)
    assert counts.sum() == effective.sum()  # one visit per kept block, none for a disabled one
    q_full = {"q": np.arange(7) * 32 + 31 < 200, "kv": np.arange(19) * 16 + 15 < 300}[by]
    for (b, h, r), count in np.ndenumerate(counts):
        visited = indices[b, h, r, :count]
        assert sorted(visited.tolist()) == np.flatnonzero(effective[b, h, r]).tolist()
        full, partial = visited[: num_full[b, h, r]], visited[num_full[b, h, r]:]
        assert list(full) == sorted(full) and list(partial) == sorted(partial)
        if by == "q" and not q_full[r]:  # a ragged last query block masks every visit
            assert num_full[b, h, r] == 0
    assert num_full.sum() > 0 and (counts - num_full).sum() > 0


def test_segment_ids_mask_every_block():
    seg = jnp.zeros((1, 256), jnp.int32)
    call = _call(q_segment_ids=seg, kv_segment_ids=seg, causal=False)
    _, num_full, counts = kernel_schedule(call, "q")
    assert int(num_full.sum()) == 0 and int(counts.sum()) == 4


@pytest.mark.parametrize("kw,match", [
    (dict(dim=32), "head dims"),
    (dict(dim=128, v_dim=96), "head dims"),
    (dict(q_len=48, block_size=(8, 16)), "q_block_size=8"),
    (dict(kv_len=72, block_size=(16, 24)), "kv_block_size=24"),
])
def test_refused_calls(kw, match):
    with pytest.raises(UnsupportedFeature, match=match):
        IMPLEMENTATION.supports(_call(**kw))


@pytest.mark.parametrize("block_size", [128, (64, 32), (48, 80), (256, 16)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_heuristic_tiles_divide_the_mask_blocks(block_size, dtype):
    call = _call(q_len=512, kv_len=512, dtype=dtype, block_size=block_size)
    IMPLEMENTATION.supports(call)
    configs = [IMPLEMENTATION.heuristic_config(call), *IMPLEMENTATION.candidate_configs(call)]
    for config in configs:
        assert isinstance(config, TritonBlockSparseConfig)
        for name in ("fwd_block_q", "dkv_block_q", "dq_block_q"):
            assert call.q_block_size % getattr(config, name) == 0, (name, config)
        for name in ("fwd_block_kv", "dkv_block_kv", "dq_block_kv"):
            assert call.kv_block_size % getattr(config, name) == 0, (name, config)


def test_config_that_does_not_divide_the_mask_blocks_is_an_error():
    call = _call(block_size=(32, 128))
    with pytest.raises(ValueError, match="fwd_block_q=64 must divide"):
        IMPLEMENTATION(call, TritonBlockSparseConfig(64, 64, 4, 2, 32, 64, 32, 64, 4, 1))


@pytest.mark.parametrize("kw,tma", [
    (dict(causal=False), True), (dict(causal=False, block_size=64), True), (dict(causal=True), False),
    (dict(causal=False, q_len=600), False), (dict(causal=False, dim=64), False),
])
def test_heuristic_takes_the_tma_forward_where_it_applies(monkeypatch, kw, tma):
    """Whole-block calls on Hopper get the TMA forward (tiles fitted to the mask blocks, one program per query
    tile); causal, ragged or D=64 calls the pointer forward."""
    import ejkernel_triton.blocksparse_attention as package

    monkeypatch.setattr(package.launch, "target_compute_capability", lambda: 90)
    monkeypatch.setattr(package.launch, "available", lambda: True)
    monkeypatch.setattr(package, "gpu_device_kind", lambda: "NVIDIA H200")
    call = _call(dtype=jnp.bfloat16, **dict(dict(q_len=512, kv_len=512, block_size=128, dim=128), **kw))
    config = IMPLEMENTATION.heuristic_config(call)
    assert tma_forward_applies(call, config) is tma
    assert config.tma_forward is tma and config.persistent_forward == 0
    if tma:
        assert call.kv_block_size % config.fwd_block_kv == 0 and config.fwd_num_warps == 4


@pytest.fixture
def _sm90(monkeypatch):
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")


def _lower(dtype, dim, heads, kv_heads, *, sinks=False, segments=False, tma=False, persistent=0, **kw):
    """sm_90 lowering of forward and gradients; `tma`: the TMA forward (it compiles the warp-specialized loop,
    which Triton 3.6 refuses for some loop shapes: see `kernels._fwd_tma_kernel`)."""
    spec = jax.ShapeDtypeStruct
    kv_len = 640 if tma else 600  # the TMA forward needs lengths that are multiples of the mask blocks
    q, k = spec((2, 640, heads, dim), dtype), spec((2, kv_len, kv_heads, dim), dtype)
    mask = random_block_mask(0, 2, heads, 640, kv_len, 128, 128, density=0.3)
    seg = jnp.zeros((2, 640), jnp.int32)

    def loss(q, k, v, aux):
        extra = dict(softmax_aux=aux if sinks else None)
        if segments:
            extra.update(q_segment_ids=seg, kv_segment_ids=seg[:, :kv_len])
        call = BlockSparseAttention().validate(q, k, v, block_mask=mask, **extra, **kw)
        config = IMPLEMENTATION.heuristic_config(call)
        if tma:
            config = dataclasses.replace(config, fwd_block_q=128, fwd_block_kv=128, fwd_num_warps=4,
                                         fwd_num_stages=2, tma_forward=True)
            assert tma_forward_applies(call, config)
        config = dataclasses.replace(config, persistent_forward=persistent)
        return IMPLEMENTATION(call, config).astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, k, spec((heads, 2), jnp.float32)).lower(
        lowering_platforms=("cuda",))
    return lowered.as_text()


@CUDA_LOWERING
@pytest.mark.usefixtures("_sm90")
@pytest.mark.parametrize("dtype,dim,kw", [
    (jnp.bfloat16, 128, dict(causal=True)),
    (jnp.float16, 64, dict(causal=False, sliding_window=(200, 0), logits_soft_cap=20.0, sinks=True,
                           segments=True)),
    (jnp.bfloat16, 128, dict(causal=False, sinks=True, tma=True)),
    (jnp.bfloat16, 128, dict(causal=False, sinks=True, tma=True, persistent=1)),
    (jnp.bfloat16, 128, dict(causal=True, persistent=2)),
], ids=["bf16-d128-causal", "fp16-d64-window-softcap-sinks-segments", "bf16-d128-tma-forward",
        "bf16-d128-tma-persistent-forward", "bf16-d128-causal-persistent-forward"])
def test_fwd_bwd_compile_for_sm90(dtype, dim, kw):
    # (float32's IEEE tile steps are flash attention's, compiled for sm_90 by test_triton_lowering.py)
    text = _lower(dtype, dim, 8, 2, **kw)
    assert text.count("triton_kernel_call") == 3  # forward, dK/dV and dQ kernels


@pytest.mark.parametrize("persistent", [0, 1])
def test_block_loops_keep_tiles_in_flight(monkeypatch, persistent):
    """Every block loop of the three kernels waits for its K/V (or Q/dO) tiles with `num_stages - 1` stages
    still in flight, as flash attention's contiguous loops do: the schedule's index load must not take a
    pipeline stage of its own (it did, `async_wait {num = 0}`, before `_next_visit`). Also inside the
    persistent forward's loop over items."""
    import re

    from ejkernel_triton.blocksparse_attention import kernels
    from ejkernel_triton.ttgir import kernel_ttgir

    launches = []

    def record(kernel, args, out_shapes, grid, *, num_warps, num_stages, interpret, zeroed_outputs, **constexprs):
        launches.append((kernel, [*args, *out_shapes], constexprs, num_warps, num_stages))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    monkeypatch.setattr(kernels, "launch", record)
    mask = random_block_mask(0, 1, 4, 512, 512, 128, 128, density=0.5)
    call = _call(512, 512, heads=4, kv_heads=4, dim=64, mask=mask, causal=True)
    config = TritonBlockSparseConfig(128, 64, 4, 3, 64, 64, 64, 64, 4, 3, persistent_forward=persistent)
    jax.eval_shape(jax.grad(lambda q: IMPLEMENTATION(dataclasses.replace(call, query=q), config).astype(
        jnp.float32).sum()), call.query)
    forward = "_fwd_persistent_kernel" if persistent else "_fwd_kernel"
    assert [launch[0].__name__ for launch in launches] == [forward, "_dkv_kernel", "_dq_kernel"]
    for kernel, args, constexprs, num_warps, num_stages in launches:
        ttgir = kernel_ttgir(kernel, args, constexprs, num_warps, num_stages)
        in_loop_waits = [int(n) for n in re.findall(r"async_wait %[^{]*\{num = (\d+)", ttgir)]
        assert len(in_loop_waits) == 2 and min(in_loop_waits) > 0, (kernel.__name__, in_loop_waits)
