"""Triton ragged_page_attention on a CPU-only machine: interpreter numerics (ragged_page_interpreter_cases.py,
in a subprocess), sm_90 lowering of both launches, the tile table, and what the implementation and its config
accept. The GPU tests are in test_ragged_page_attention_gpu.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttention, RaggedPageAttentionCall
from ejkernel_triton import launch, plugin
from ejkernel_triton.ragged_page_attention import IMPLEMENTATION, TritonRaggedPageConfig, config
from interpreter_support import CUDA_LOWERING, assert_forward_only_row, case_row_fixture


CASES_SCRIPT = Path(__file__).with_name("ragged_page_interpreter_cases.py")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(tokens=2108, heads=32, kv_heads=8, dim=128, page_size=16, max_num_seqs=64, context=4096,
          dtype=jnp.bfloat16, precision=None, **static):
    """A call from shapes alone (the standard mixed batch: 4 prefill chunks of 512 + 60 decode rows)."""
    pages = max_num_seqs * context // page_size
    return RaggedPageAttentionCall(
        queries=_spec((tokens, heads, dim), dtype), kv_pages=_spec((pages, page_size, 2 * kv_heads, dim), dtype),
        context_lens=_spec((max_num_seqs,), jnp.int32),
        block_tables=_spec((max_num_seqs, context // page_size), jnp.int32),
        query_start_loc=_spec((max_num_seqs + 1,), jnp.int32), num_seqs=_spec((1,), jnp.int32),
        softmax_aux=None, softmax_scale=dim**-0.5, precision=resolve_precision(precision, dtype), **static)


interpreter_results, case_row = case_row_fixture(CASES_SCRIPT)


def test_interpreter_case_matches_reference(case_row):
    _, row = case_row
    assert_forward_only_row(row, TOLERANCE[row["dtype"]])
    assert row["padding_zero"], row  # rows past query_start_loc[num_seqs] are exact zeros


def test_tile_table_covers_prefill_and_padding_rows_once():
    """Every prefill row and every padding row is in exactly one tile of at most block_q rows of one sequence;
    decode rows (q_len 1) and inactive slots are in none."""
    from ejkernel_triton.ragged_page_attention.kernels import max_tiles, tile_table

    q_lens = np.array([1, 20, 0, 1, 7, 33, 5, 0], np.int32)  # the last two slots are inactive
    kv_lens = np.array([40, 37, 9, 1, 7, 100, 9, 0], np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total, block_q = int(starts[6]) + 4, 8  # 4 padding rows (inactive slot 6's rows count as padding)
    tiles, is_decode = jax.jit(tile_table, static_argnums=(3, 4))(
        jnp.asarray(starts), jnp.asarray(kv_lens), jnp.asarray([6], jnp.int32), total, block_q)
    tiles, is_decode = np.asarray(tiles), np.asarray(is_decode)
    assert tiles.shape == (max_tiles(total, 8, block_q), 5)
    np.testing.assert_array_equal(is_decode, [True, False, False, True, False, False, False, False])
    covered = np.zeros(total, int)
    for seq, row0, row1, pos0, kv_len in tiles:
        if row1 <= row0:
            continue
        assert row1 - row0 <= block_q
        covered[row0:row1] += 1
        if row0 >= starts[6]:  # padding: no keys
            assert kv_len == 0
        else:
            assert starts[seq] <= row0 and row1 <= starts[seq + 1] and q_lens[seq] > 1
            assert pos0 == kv_lens[seq] - q_lens[seq] + row0 - starts[seq] and kv_len == kv_lens[seq]
    decode_rows = starts[:-1][is_decode]
    expected = np.ones(total, int)
    expected[decode_rows] = 0
    np.testing.assert_array_equal(covered, expected)


@CUDA_LOWERING
@pytest.mark.parametrize("page_size,window,fused,inline,interleave", [
    (16, None, False, False, False), (64, 1000, False, False, False), (12, None, True, True, False),
    (64, None, True, False, True)])
def test_compiles_for_sm90(monkeypatch, page_size, window, fused, inline, interleave):
    """Both launches (prefill tiles; decode split + combine), or the fused launch with the inline combine (one
    launch in all; pages of 12: per-row lookups), or fused with decode and prefill programs alternating, lower for
    sm_90: pages of 16 and 64 (one table entry per step), a window, sinks (float32's IEEE dots: the interpreter
    cases)."""
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    call = _call(tokens=600, max_num_seqs=8, context=1024, page_size=page_size)
    cfg = TritonRaggedPageConfig(decode_num_splits=4, fused=fused, decode_inline_combine=inline,
                                 interleave=interleave)

    def fn(q, kv, lens, tables, starts, count, aux):
        validated = RaggedPageAttention().validate(q, kv, lens, tables, starts, count, softmax_aux=aux,
                                                   sliding_window=window, logits_soft_cap=30.0)
        return IMPLEMENTATION(validated, cfg)

    text = jax.jit(fn).trace(call.queries, call.kv_pages, call.context_lens, call.block_tables,
                             call.query_start_loc, call.num_seqs, _spec((32, 2), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == 3 - fused - inline


@CUDA_LOWERING
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_pages_compile_for_sm90(monkeypatch, fused):
    """float8 pages with per-page key scales and per-kv-head value scales: the prefill tiles and the decode
    programs (both launches, or one with the inline combine) read the stored bytes and lower for sm_90."""
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    call = _call(tokens=600, max_num_seqs=8, context=1024, page_size=16)
    pages = _spec(call.kv_pages.shape, jnp.float8_e4m3fn)
    cfg = TritonRaggedPageConfig(decode_num_splits=4, fused=fused, decode_inline_combine=fused)

    def fn(q, kv, lens, tables, starts, count, key_scale, value_scale):
        validated = RaggedPageAttention().validate(q, kv, lens, tables, starts, count, key_scale=key_scale,
                                                   value_scale=value_scale)
        return IMPLEMENTATION(validated, cfg)

    text = jax.jit(fn).trace(call.queries, pages, call.context_lens, call.block_tables, call.query_start_loc,
                             call.num_seqs, _spec((pages.shape[0], 8), jnp.float32), _spec((8,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == (1 if fused else 3)


def test_plugin_entry():
    assert plugin.IMPLEMENTATIONS["ragged_page_attention"] == "ejkernel_triton.ragged_page_attention:IMPLEMENTATION"
    assert IMPLEMENTATION.config_type is TritonRaggedPageConfig


def test_supports(monkeypatch):
    for precision in ("default", "highest"):
        IMPLEMENTATION.supports(_call(dtype=jnp.float32, precision=precision, max_num_seqs=4, context=256))
    with pytest.raises(UnsupportedFeature, match="head_dim"):
        IMPLEMENTATION.supports(_call(dim=512, max_num_seqs=4, context=256))
    with pytest.raises(UnsupportedFeature, match="query heads per kv head"):
        IMPLEMENTATION.supports(_call(heads=256, kv_heads=1, dim=64, max_num_seqs=4, context=256))
    float8 = _call(max_num_seqs=4, context=256)
    float8 = dataclasses.replace(float8, kv_pages=_spec(float8.kv_pages.shape, jnp.float8_e4m3fn))
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "80")
    with pytest.raises(UnsupportedFeature, match="sm_89"):
        IMPLEMENTATION.supports(float8)
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    IMPLEMENTATION.supports(float8)


def test_heuristic_and_candidates():
    call = _call()
    cfg = IMPLEMENTATION.heuristic_config(call)
    assert cfg.block_m == 128 and not cfg.fused and cfg.decode_config().num_splits >= 1
    # pages of 16: two launches; the decode rows take the decode heuristic's config for 64 slots x 8 kv heads
    from ejkernel_triton.decode import config as decode_config

    assert cfg.decode_config() == decode_config.heuristic_config(64 * 8, 4096, 128, jnp.bfloat16)
    # pages of 64 (whole 64-key steps): one launch of 64-row prefill tiles and 64-key decode programs
    fused = IMPLEMENTATION.heuristic_config(_call(page_size=64))
    assert fused.fused and not fused.interleave
    assert (fused.block_m, fused.num_warps, fused.decode_block_n, fused.decode_prefetch) == (64, 4, 64, 2)
    candidates = IMPLEMENTATION.candidate_configs(call)
    assert candidates[0] == cfg and len(set(candidates)) == len(candidates) > 1
    assert {c.fused for c in candidates} == {False, True}  # one launch and two are both tried
    # groups of 8 need tiles of at least 8 rows; a group of 128 raises the tile to 128 rows
    wide = config.heuristic_config(4, 1, 128, 256, 64, jnp.bfloat16)
    assert wide.block_m >= 128


@pytest.mark.parametrize("field,value", [("block_m", 48), ("block_n", 8), ("num_warps", 3), ("prefetch", 0),
                                         ("decode_num_splits", 0), ("decode_block_n", 24), ("fused", 1),
                                         ("interleave", 1),
                                         ("decode_inline_combine", 0)])
def test_config_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        TritonRaggedPageConfig(**{field: value})
