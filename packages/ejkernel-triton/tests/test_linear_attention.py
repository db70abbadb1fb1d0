"""The Triton chunked linear attention (gla, lightning_attention, recurrent) on a CPU-only machine: interpreter
numerics (linear_attention_interpreter_cases.py, in a subprocess), sm_90 lowering of the forward and backward,
and what the implementation and its config accept or refuse."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations.recurrent import RecurrentAttention
from ejkernel_triton import launch, plugin
from ejkernel_triton.linear_attention import (IMPLEMENTATION, TritonLinearAttentionConfig, carried_segments,
                                              carried_varlen_run)
from ejkernel_triton.linear_attention.vjp import chunk_table, varlen_segments
from interpreter_support import CUDA_LOWERING, case_row_fixture


CASES_SCRIPT = Path(__file__).with_name("linear_attention_interpreter_cases.py")
TOLERANCE = {"float32": 2e-6, "float16": 2e-3}
# gates of ~-100 per token: cumulative sums of ~-6e3 lose float32 digits (the scalar path forms exp(gc_t - gc_s)
# from two of them, as fla's chunk_simple_gla does; the per-dimension path splits at sub-chunk reference rows)
LOOSER = {"gla_strong_gates": 5e-5, "recurrent_scalar_strong_gates": 1e-4,
          # gates of ~-1.5 per token on average (cumulative ~-95 per chunk): the same errors before the split dots
          "gla_mixed_spans_varlen": 5e-6, "gla_mixed_spans_one_launch": 5e-6}


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---- interpreter numerics ----------------------------------------------------------------------------


interpreter_results, case_row = case_row_fixture(CASES_SCRIPT)


def test_interpreter_case_matches_reference(case_row):
    """Output, final state and every gradient (initial state included) against the float64 recurrence."""
    name, row = case_row
    assert row["finite"], row
    tol = LOOSER.get(name, TOLERANCE[row["dtype"]])
    quantities = [key for key in row if key in ("out", "final_state") or key.startswith("d_")]
    assert {"out", "final_state", "d_query", "d_key", "d_value"} <= set(quantities), row
    for quantity in quantities:
        # the summed gates of a whole sequence (g_gamma's gradient) carry the float16 rounding of every token
        bound = tol * (4 if quantity == "d_g_gamma" else 1)
        assert row[quantity] <= bound, (quantity, row)


def test_sub_chunks_take_the_split_dots_unless_their_gates_span_more(interpreter_results):
    """The intra kernel's choice per sub-chunk (its first launch's flags, recorded by the cases): log-sigmoid
    gates never need the exact pair loop, gates of ~-100 per token always do (5 of 8 flags: the other three
    sub-chunks lie past the short last chunk and keep their zeros), ~-1.5 per token some of them."""
    assert interpreter_results["gla_vector_gates_odd_dims"]["exact_sub_chunks"] == 0.0
    assert interpreter_results["gla_segments_empty_last"]["exact_sub_chunks"] == 0.0
    assert interpreter_results["gla_strong_gates"]["exact_sub_chunks"] == 5 / 8
    assert 0.0 < interpreter_results["gla_mixed_spans_varlen"]["exact_sub_chunks"] < 1.0


# ---- what the implementation takes -------------------------------------------------------------------


def _call(batch=2, total=256, heads=4, kv_heads=4, dk=64, dv=64, dtype=jnp.bfloat16, **kw):
    q = jnp.zeros((batch, total, heads, dk), dtype)
    k = jnp.zeros((batch, total, kv_heads, dk), dtype)
    v = jnp.zeros((batch, total, kv_heads, dv), dtype)
    return RecurrentAttention().validate(q, k, v, **kw)


def test_refuses_what_it_does_not_implement():
    with pytest.raises(UnsupportedFeature, match="gv"):
        IMPLEMENTATION.supports(_call(gv=jnp.zeros((2, 256, 4, 64))))
    with pytest.raises(UnsupportedFeature, match="head dims"):
        IMPLEMENTATION.supports(_call(dk=320))
    for kw in (dict(), dict(g=jnp.zeros((2, 256, 4, 64)), g_gamma=jnp.zeros((4,))),
               dict(kv_heads=1, g=jnp.zeros((2, 256, 4)), reverse=True), dict(dk=256, dv=32),
               dict(batch=1, cu_seqlens=jnp.asarray([0, 100, 256], jnp.int32), reverse=True)):
        IMPLEMENTATION.supports(_call(**kw))  # no exception


def test_config_validation():
    TritonLinearAttentionConfig(block_k=32, block_v=128, output_block_v=64, num_warps=4, state_num_warps=8,
                                backward_num_warps=8, state_block_k=16, state_block_v=32, decayed_keys=True,
                                intra_kernel=True)
    for bad in (dict(block_k=48), dict(block_v=8), dict(output_block_v=96), dict(num_warps=0), dict(num_stages=True),
                dict(state_num_warps=-1), dict(backward_num_warps=0), dict(state_block_k=24), dict(state_block_v=8),
                dict(decayed_keys=1), dict(intra_kernel="yes"), dict(carried_state=0), dict(segments=-1),
                dict(carried_block_v=48), dict(carried_num_warps=0), dict(carried_num_stages=-2),
                dict(cumsum_block_k=8), dict(cumsum_num_warps=0), dict(carried_varlen="no"),
                dict(carried_varlen_run=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TritonLinearAttentionConfig(**bad)
    # the benchmark's --configs specs
    assert TritonLinearAttentionConfig.parse("decayed_keys=1/intra_kernel=1/state_block_k=32/backward_num_warps=8") == \
        TritonLinearAttentionConfig(decayed_keys=True, intra_kernel=True, state_block_k=32, backward_num_warps=8)
    assert TritonLinearAttentionConfig.parse("") == TritonLinearAttentionConfig()
    with pytest.raises(ValueError, match="no field 'block'"):
        TritonLinearAttentionConfig.parse("block=32")
    assert TritonLinearAttentionConfig.parse("carried_state=0/segments=3") == \
        TritonLinearAttentionConfig(carried_state=False, segments=3)
    for bad, field in (("carried_varlen=yes", "carried_varlen"), ("segments=3.5", "segments"),
                       ("segments", "segments")):
        with pytest.raises(ValueError, match=rf"TritonLinearAttentionConfig\.{field} takes .*{bad!r}"):
            TritonLinearAttentionConfig.parse(bad)
    for candidate in IMPLEMENTATION.candidate_configs(_call()):
        assert isinstance(candidate, TritonLinearAttentionConfig)


def test_carried_segments_heuristic():
    """Segments per sequence for the carried-state forward: ~256 programs, at most one per 8 chunks, 0 where
    the carried kernel does not apply (varlen or no intra kernel with per-dimension gates: ``usable``; K > 128;
    switched off), and a configured count capped at the chunks."""
    default = TritonLinearAttentionConfig()
    assert carried_segments(default, batch=4, heads=8, chunks=256, value_tiles=1, dk=128, usable=True) == 8
    assert carried_segments(default, batch=4, heads=8, chunks=256, value_tiles=2, dk=128, usable=True) == 4
    assert carried_segments(default, batch=4, heads=8, chunks=16, value_tiles=1, dk=128, usable=True) == 2
    assert carried_segments(default, batch=64, heads=32, chunks=256, value_tiles=1, dk=64, usable=True) == 1
    assert carried_segments(default, batch=4, heads=8, chunks=256, value_tiles=1, dk=256, usable=True) == 0
    assert carried_segments(default, batch=4, heads=8, chunks=256, value_tiles=1, dk=128, usable=False) == 0
    off = TritonLinearAttentionConfig(carried_state=False)
    assert carried_segments(off, batch=4, heads=8, chunks=256, value_tiles=1, dk=128, usable=True) == 0
    fixed = TritonLinearAttentionConfig(segments=40)
    assert carried_segments(fixed, batch=4, heads=8, chunks=16, value_tiles=1, dk=128, usable=True) == 16
    # varlen: opt-in, runs of at least 8 chunks for ~256 programs
    assert carried_varlen_run(default, chunks=264, heads=8, value_tiles=1, dk=128, usable=True) == 0
    on = TritonLinearAttentionConfig(carried_varlen=True)
    assert carried_varlen_run(on, chunks=264, heads=8, value_tiles=1, dk=128, usable=True) == 9
    assert carried_varlen_run(on, chunks=40, heads=8, value_tiles=1, dk=128, usable=True) == 8
    assert carried_varlen_run(on, chunks=264, heads=8, value_tiles=1, dk=256, usable=True) == 0
    assert carried_varlen_run(dataclasses.replace(on, carried_varlen_run=2), chunks=264, heads=8, value_tiles=1,
                              dk=128, usable=True) == 2


def _unresolved(config):
    return [f.name for f in dataclasses.fields(config) if getattr(config, f.name) is None]


def test_heuristic_config_is_what_runs():
    """The heuristic config leaves nothing to the call: every tile, launch shape and the carried forward's
    segments (0 where it does not run) for per-dimension, scalar and no gates, K > 128, GQA and varlen; the
    candidates are resolved too, and a partial user config resolves to the same values (given ones kept)."""
    f32 = jnp.float32
    vector = _call(batch=2, total=256, g=jnp.zeros((2, 256, 4, 64), f32))
    expected = TritonLinearAttentionConfig(
        block_k=64, block_v=64, output_block_v=64, state_num_stages=2, state_block_k=64, state_block_v=64,
        intra_inside_num_warps=4, segments=1, carried_block_v=64, carried_num_warps=8, carried_num_stages=2,
        carried_varlen_run=0)
    assert IMPLEMENTATION.heuristic_config(vector) == expected
    # scalar gates: no decayed-keys or intra kernel runs; the carried kernel's smaller tile and 4 warps
    scalar = _call(batch=1, total=4096, heads=8, kv_heads=2, dk=128, dv=128, g=jnp.zeros((1, 4096, 8), f32))
    assert IMPLEMENTATION.heuristic_config(scalar) == dataclasses.replace(
        expected, block_k=64, block_v=64, output_block_v=128, decayed_keys=False, intra_kernel=False,
        segments=8, carried_block_v=64, carried_num_warps=4)  # 256 programs / (8 heads * 2 value tiles): 16 > 64/8
    wide = _call(dk=256, dv=32)  # K > 128: no carried forward
    assert IMPLEMENTATION.heuristic_config(wide) == dataclasses.replace(
        expected, block_v=32, output_block_v=32, state_block_v=32, decayed_keys=False, intra_kernel=False,
        segments=0, carried_block_v=32, carried_num_warps=4)
    cu = jnp.asarray([0, 100, 256], jnp.int32)
    varlen = _call(batch=1, cu_seqlens=cu)
    assert IMPLEMENTATION.heuristic_config(varlen).segments == 0
    opted = TritonLinearAttentionConfig(carried_varlen=True).resolved(varlen)
    assert (opted.segments, opted.carried_varlen_run) == (0, 8)  # at least 8 chunks per run
    calls = (vector, scalar, wide, varlen, _call(g=jnp.zeros((2, 256, 4, 64), f32), reverse=True),
             _call(total=200, dk=16, dv=16))
    for call in calls:
        config = IMPLEMENTATION.heuristic_config(call)
        assert _unresolved(config) == [], (call.query.shape, config)
        assert config.resolved(call) == config
        candidates = IMPLEMENTATION.candidate_configs(call)
        assert candidates[0] == config and len(set(candidates)) == len(candidates)
        for candidate in candidates:
            assert _unresolved(candidate) == [] and candidate.resolved(call) == candidate
    # partial user configs: the rules fill the rest (state tiles follow the given block_k), the given ones stay
    partial = TritonLinearAttentionConfig(block_k=32, num_stages=3, segments=40)
    assert partial.resolved(scalar) == dataclasses.replace(
        IMPLEMENTATION.heuristic_config(scalar), block_k=32, num_stages=3, state_block_k=32, state_num_stages=3,
        carried_num_stages=3, segments=40)
    assert TritonLinearAttentionConfig(carried_state=False).resolved(vector) == dataclasses.replace(
        expected, carried_state=False, segments=0)


def test_varlen_segments_cut_each_sequence_into_runs():
    """Sequences of 3, 0 and 5 chunks in runs of 2: [0, 2) [2, 3) | (empty) | [3, 5) [5, 7) [7, 8), then padding
    (empty runs at the end, sequence -1); every chunk-table entry maps to its run, unused ones to the last."""
    cu = jnp.asarray([0, 150, 150, 450], jnp.int32)  # 150 tokens = 3 chunks, 0, 300 = 5 chunks
    tables = chunk_table(cu, 450)
    seg_first, seg_info, chunk_run = varlen_segments(tables, 2)
    count = 3 + tables[0].shape[0] // 2 + 1
    assert seg_first.tolist() == [0, 2, 3, 3, 5, 7] + [8] * (count - 5)
    assert seg_info[:6].tolist() == [[0, 0, 0], [0, 0, 1], [1, 2, 1], [2, 3, 0], [2, 3, 0], [2, 3, 1]]
    assert (seg_info[6:, 0] == -1).all()
    assert chunk_run[:8].tolist() == [0, 0, 1, 3, 3, 4, 4, 5]
    assert (chunk_run[8:] == count - 1).all()


def test_registered_for_the_linear_family():
    for algorithm in ("gla", "lightning_attention", "recurrent"):
        assert plugin.IMPLEMENTATIONS[algorithm] == "ejkernel_triton.linear_attention:IMPLEMENTATION"


# ---- sm_90 lowering ----------------------------------------------------------------------------------


@CUDA_LOWERING
@pytest.mark.parametrize("dtype,dk,dv,kw", [
    (jnp.bfloat16, 128, 128, dict(initial_state=True, reverse=True)),
    (jnp.bfloat16, 128, 128, dict(config=dict(intra_split=False, intra_inside_num_warps=2))),
    (jnp.bfloat16, 128, 128, dict(scalar_gate=True, initial_state=True)),
    (jnp.bfloat16, 128, 128, dict(scalar_gate=True, initial_state=True, config=dict(segments=2))),
    (jnp.bfloat16, 128, 128, dict(config=dict(segments=2))),
    (jnp.bfloat16, 128, 128, dict(scalar_gate=True, config=dict(carried_state=False))),
    (jnp.bfloat16, 8, 8, dict(scalar_gate=True, config=dict(segments=2))),
], ids=["bf16-k128-v128-h0-reverse", "bf16-intra-one-launch", "bf16-scalar-gate", "bf16-scalar-segments",
        "bf16-segments", "bf16-scalar-stored-states", "bf16-k8-v8-scalar-segments"])
def test_forward_and_backward_compile_for_sm90(monkeypatch, dtype, dk, dv, kw):
    """bf16 only: float32's IEEE dots (FMA loops) take ~40 s to compile here; the GPU suites compile them.
    The default splits the intra kernel in two launches, the second aliased to the first's output (operand
    numbering checked by the StableHLO verifier); the second row runs it as one launch; the third takes the
    scalar-gate path (no intra kernel: A by the output kernel's dots); then the carried-state forward over two
    segments (and the backward's per-segment state passes), and the stored-state forward."""
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    b, t, h = 2, 256, 4
    q, k, v = _spec((b, t, h, dk), dtype), _spec((b, t, h, dk), dtype), _spec((b, t, h, dv), dtype)
    g = _spec((b, t, h) if kw.get("scalar_gate") else (b, t, h, dk), jnp.float32)
    h0 = _spec((b, h, dk, dv), jnp.float32)

    def loss(q, k, v, g, h0):
        call = RecurrentAttention().validate(q, k, v, g, initial_state=h0 if kw.get("initial_state") else None,
                                             reverse=kw.get("reverse", False))
        config = dataclasses.replace(IMPLEMENTATION.heuristic_config(call), **kw.get("config", {}))
        out, final = IMPLEMENTATION(call, config)
        return out.astype(jnp.float32).sum() + final.sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(q, k, v, g, h0).lower(
        lowering_platforms=("cuda",)).as_text()
    # forward: states + outputs; backward: states again, state gradients, dv/dA, dq/dk/dg
    assert text.count("triton_kernel_call") >= 6
