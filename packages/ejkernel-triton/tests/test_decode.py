"""The Triton decode kernels (page_attention, ragged_decode_attention) on a CPU-only machine: interpreter
numerics (decode_interpreter_cases.py, in a subprocess), sm_90 lowering, the software pipeline Triton builds
for the paged loop, and what the implementations and their config accept."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations.page_attention import PageAttention, PageAttentionCall
from ejkernel.modules.operations.ragged_decode_attention import RaggedDecodeAttention, RaggedDecodeAttentionCall
from ejkernel_triton import launch, plugin
from ejkernel_triton.decode import TritonDecodeConfig, config
from ejkernel_triton.decode.page_attention import IMPLEMENTATION as PAGED
from ejkernel_triton.decode.ragged_decode_attention import IMPLEMENTATION as RAGGED
from ejkernel_triton.ttgir import kernel_ttgir
from interpreter_support import CUDA_LOWERING, assert_forward_only_row, case_row_fixture


CASES_SCRIPT = Path(__file__).with_name("decode_interpreter_cases.py")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _paged_call(num_seqs=32, heads=32, kv_heads=8, dim=128, page_size=16, context=4096, dtype=jnp.bfloat16,
                precision=None, **static):
    """A call built from shapes alone (backends read shapes, dtypes and static fields before tracing)."""
    pages = num_seqs * context // page_size
    cache = _spec((pages, kv_heads, page_size, dim), dtype)
    return PageAttentionCall(query=_spec((num_seqs, heads, dim), dtype), key_cache=cache, value_cache=cache,
                             context_lens=_spec((num_seqs,), jnp.int32),
                             block_tables=_spec((num_seqs, context // page_size), jnp.int32),
                             attn_scale=dim**-0.5, max_context_len=context,
                             precision=resolve_precision(precision, dtype), **static)


def _ragged_call(batch=4, heads=8, kv_heads=2, dim=64, seq_len=1000, dtype=jnp.bfloat16, precision=None, **static):
    kv = _spec((batch, seq_len, kv_heads, dim), dtype)
    bounds = _spec((batch,), jnp.int32)
    return RaggedDecodeAttentionCall(query=_spec((batch, heads, dim), dtype), key=kv, value=kv, sequence_start=bounds,
                                     sequence_end=bounds, softmax_scale=dim**-0.5,
                                     precision=resolve_precision(precision, dtype), **static)


# ---- interpreter numerics ----------------------------------------------------------------------------


interpreter_results, case_row = case_row_fixture(CASES_SCRIPT)


def test_interpreter_case_matches_reference(case_row):
    _, row = case_row
    assert_forward_only_row(row, TOLERANCE[row["dtype"]])
    assert row.get("empty_rows_zero", True), row  # zero-length contexts / empty ranges give exact zeros


# ---- sm_90 lowering and the software pipeline --------------------------------------------------------


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")


def _lower(fn, *specs) -> str:
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@CUDA_LOWERING
@pytest.mark.parametrize("page_size,splits,inline", [(16, 5, False), (64, 1, False), (12, 3, False), (16, 5, True)])
def test_page_attention_compiles_for_sm90(sm90, page_size, splits, inline):
    """Pages of 16 (one table entry per step with 16-key steps, per-row lookups with 64), 64 and 12; several
    splits launch the combine kernel too, unless the last split merges (inline: an atomic arrival counter)."""
    call = _paged_call(num_seqs=4, context=768, page_size=page_size)
    cfg = TritonDecodeConfig(block_n=64, num_splits=splits, inline_combine=inline)
    text = _lower(lambda q, k, v, lens, tables: PAGED(
        PageAttention().validate(q, k, v, lens, tables, attn_logits_soft_cap=30.0, max_context_len=700), cfg),
        call.query, call.key_cache, call.value_cache, call.context_lens, call.block_tables)
    assert text.count("triton_kernel_call") == (1 if splits == 1 or inline else 2)


@CUDA_LOWERING
@pytest.mark.parametrize("cache_dtype,page_size", [(jnp.float8_e4m3fn, 64), (jnp.float8_e5m2, 12), (jnp.int8, 16)])
def test_quantized_cache_compiles_for_sm90(sm90, cache_dtype, page_size):
    """A quantized cache (read as stored, multiplied in bf16) with per-(page, kv head) scales, through the
    one-entry-per-step and the per-row page lookups."""
    call = _paged_call(num_seqs=4, context=768, page_size=page_size)
    cache = _spec(call.key_cache.shape, cache_dtype)
    scales = _spec(call.key_cache.shape[:2], jnp.float32)
    cfg = TritonDecodeConfig(block_n=64, num_splits=3, inline_combine=True)
    text = _lower(lambda q, k, v, lens, tables, ks, vs: PAGED(
        PageAttention().validate(q, k, v, lens, tables, key_scale=ks, value_scale=vs), cfg),
        call.query, cache, cache, call.context_lens, call.block_tables, scales, scales)
    assert text.count("triton_kernel_call") == 1


@CUDA_LOWERING
def test_quantized_ragged_buffer_compiles_for_sm90(sm90):
    """A float8 dense buffer with one scale per kv head (no page lookup for the scales)."""
    call = _ragged_call(dtype=jnp.bfloat16)
    buffer = _spec(call.key.shape, jnp.float8_e4m3fn)
    scales = _spec(call.key.shape[2:3], jnp.float32)
    text = _lower(lambda q, k, v, s, e, ks, vs: RAGGED(
        RaggedDecodeAttention().validate(q, k, v, s, e, key_scale=ks, value_scale=vs),
        TritonDecodeConfig(num_splits=3, inline_combine=True)),
        call.query, buffer, buffer, call.sequence_start, call.sequence_end, scales, scales)
    assert text.count("triton_kernel_call") == 1


def test_float8_caches_are_refused_before_sm89(monkeypatch):
    """Triton has float8 conversions from sm_89 on: older GPUs fall back to another backend."""
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "80")
    call = _paged_call(num_seqs=2, context=256)
    cache = _spec(call.key_cache.shape, jnp.float8_e4m3fn)
    with pytest.raises(UnsupportedFeature, match="sm_89"):
        PAGED.supports(dataclasses.replace(call, key_cache=cache, value_cache=cache))


@CUDA_LOWERING
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ragged_decode_attention_compiles_for_sm90(sm90, dtype):
    call = _ragged_call(dtype=dtype)

    def fn(q, k, v, start, end, aux):
        call = RaggedDecodeAttention().validate(q, k, v, start, end, softmax_aux=aux, sliding_window=(300, 0),
                                             logit_soft_cap=20.0)
        return RAGGED(call, TritonDecodeConfig(num_splits=3))  # the sinks join in the combine kernel

    text = _lower(fn, call.query, call.key, call.value, call.sequence_start, call.sequence_end,
                  _spec((8, 2), jnp.float32))
    assert text.count("triton_kernel_call") == 2


@pytest.mark.parametrize("page_size,prefetch", [(16, 2), (64, 2), (0, 2), (16, 1)])
def test_key_loop_keeps_prefetch_steps_in_flight(monkeypatch, page_size, prefetch):
    """The key loop's K and V tiles get `prefetch` shared-memory buffers, paged (the block-table lookup is an
    indirect load, which Triton 3.6 gives stages of its own) or dense; page_size 0: the ragged op."""
    from ejkernel_triton.decode import kernels

    launches = []

    def record(kernel, args, out_shapes, grid, *, num_warps, num_stages, interpret, zeroed_outputs=(), **constexprs):
        launches.append((kernel, [*args, *out_shapes], constexprs, num_warps, num_stages))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    monkeypatch.setattr(kernels, "launch", record)
    cfg = TritonDecodeConfig(block_n=64, num_splits=4, prefetch=prefetch)
    if page_size:
        call = _paged_call(num_seqs=2, context=1024, page_size=page_size)
        jax.eval_shape(lambda c: PAGED(c, cfg), call)
    else:
        call = _ragged_call(batch=2, heads=32, kv_heads=8, dim=128, seq_len=1024)
        jax.eval_shape(lambda c: RAGGED(c, cfg), call)
    kernel, args, constexprs, num_warps, num_stages = launches[0]  # the split kernel (outputs follow inputs)
    ttgir = kernel_ttgir(kernel, args, constexprs, num_warps, num_stages)
    assert f"memdesc<{prefetch}x64x128xbf16" in ttgir, [line for line in ttgir.splitlines() if "x64x128xbf16" in line][:3]


# ---- implementations and config ----------------------------------------------------------------------


def test_plugin_lists_both_operations():
    assert plugin.IMPLEMENTATIONS["page_attention"] == "ejkernel_triton.decode.page_attention:IMPLEMENTATION"
    assert (plugin.IMPLEMENTATIONS["ragged_decode_attention"]
            == "ejkernel_triton.decode.ragged_decode_attention:IMPLEMENTATION")
    assert PAGED.config_type is RAGGED.config_type is TritonDecodeConfig


@pytest.mark.parametrize("dim", [4, 512])
def test_refuses_head_dims_outside_8_to_256(dim):
    with pytest.raises(UnsupportedFeature, match="head_dim"):
        PAGED.supports(_paged_call(dim=dim, num_seqs=2, context=64))
    with pytest.raises(UnsupportedFeature, match="head_dim"):
        RAGGED.supports(_ragged_call(dim=dim))


def test_takes_every_precision_and_page_size():
    """Float32 runs IEEE dots (nothing refused for precision); pages of any size, 4 included."""
    for precision in ("default", "high", "highest"):
        PAGED.supports(_paged_call(dtype=jnp.float32, precision=precision, num_seqs=2, context=64))
        RAGGED.supports(_ragged_call(dtype=jnp.float32, precision=precision))
    PAGED.supports(_paged_call(page_size=4, num_seqs=2, context=64))


@pytest.mark.parametrize(
    "num_seqs,context",
    [(32, 4096), (32, 512), (32, 32768), (1, 4096), (8, 4096), (64, 4096), (128, 4096)],
)
def test_heuristic_makes_one_full_wave(num_seqs, context):
    """The model of NOTES.md ("decode heuristic"): every program resident at once (one wave of the config's slots
    per SM) and the wave as full as splitting allows, or, with more work than one wave, the config whose last
    wave is fuller; never more splits than blocks of keys."""
    call = _paged_call(num_seqs=num_seqs, context=context)
    cfg = PAGED.heuristic_config(call)
    chunk, splits = config.split_plan(context, cfg.block_n, cfg.num_splits)
    work = num_seqs * 8
    programs = work * splits
    slots = config.DEFAULT_SM_COUNT * config.resident_programs(cfg.block_n, cfg.prefetch, 128, jnp.bfloat16)
    assert chunk % cfg.block_n == 0 and chunk * splits >= context
    if splits > 1:
        assert programs <= slots  # one wave
        assert work * (splits + 1) > slots or chunk < 2 * config.MIN_CHUNK  # no further split fits it
    wide_slots = 3 * config.DEFAULT_SM_COUNT
    if work > wide_slots:  # the 32-key program's 4 per SM make a fuller wave
        assert (cfg.block_n, cfg.prefetch, splits) == (32, 3, 1)
        assert config.wave_fill(programs, slots) > config.wave_fill(programs, wide_slots)
    elif splits > 1:  # split calls: the wide program, the last split merging (no second launch)
        assert (cfg.block_n, cfg.prefetch, cfg.inline_combine) == (64, 2, True)
    else:  # one split: the long-step program, the wide program's shared memory in one 128-key step
        assert (cfg.block_n, cfg.prefetch) == (128, 1)
        assert config.resident_programs(128, 1, 128, jnp.bfloat16) == 3
    assert cfg in PAGED.candidate_configs(call) and len(PAGED.candidate_configs(call)) > 1


def test_ragged_heuristic_takes_the_long_steps_past_one_wave():
    """Dense caches with more work than one wave keep one split in the long-step program (H100, 8 layers per
    executable: 2868 against 2710 GB/s for the 64-key program at B=64), where paged caches take the narrow one."""
    cfg = RAGGED.heuristic_config(_ragged_call(batch=64, heads=32, kv_heads=8, dim=128, seq_len=4096))
    assert (cfg.block_n, cfg.num_splits, cfg.prefetch) == (128, 1, 1)


def test_resident_programs_match_the_sm90_compile():
    """Shared memory per program (ptxas, sm_90, bf16, D=128): 72 KB at 64-key steps with two in flight (3 per
    SM), 55 KB at 32-key steps with three (4 per SM, the register limit)."""
    assert config.resident_programs(64, 2, 128, jnp.bfloat16) == 3
    assert config.resident_programs(32, 3, 128, jnp.bfloat16) == 4
    assert config.resident_programs(64, 2, 128, jnp.float32) == 1


def test_one_byte_caches_count_their_registers():
    """float8's 64-key program takes 149 registers (ptxas, sm_90): 3 per SM although its 39 KB of shared memory
    would allow 5, so 32 x 8 (sequence, kv head) pairs fill one wave without splitting (the heuristic's former 2
    splits made 1.29 waves: 143 against 107 us per layer, H100); its long-step program (206 registers) is not
    taken. int8's 128 registers keep 4 per SM."""
    assert config.resident_programs(64, 2, 128, jnp.float8_e4m3fn) == 3
    assert config.resident_programs(64, 2, 128, jnp.int8) == 4
    assert config.resident_programs(128, 1, 128, jnp.float8_e5m2) == 2
    cfg = config.heuristic_config(32 * 8, 4096, 128, jnp.float8_e4m3fn, sms=132)
    assert (cfg.block_n, cfg.prefetch, cfg.num_splits) == (64, 2, 1)
    assert config.heuristic_config(32 * 8, 4096, 128, jnp.bfloat16, sms=132).block_n == 128


def test_ragged_heuristic_counts_the_window():
    """With a window only its keys can be visible: splits are planned over window + 1 keys, not seq_len."""
    wide = RAGGED.heuristic_config(_ragged_call(batch=1, seq_len=65536))
    narrow = RAGGED.heuristic_config(_ragged_call(batch=1, seq_len=65536, sliding_window=(1023, 0)))
    assert narrow.num_splits < wide.num_splits
    assert narrow.num_splits <= 1024 // config.MIN_CHUNK


def test_split_plan():
    assert config.split_plan(4096, 64, 5) == (832, 5)
    assert config.split_plan(100, 64, 8) == (64, 2)  # no split shorter than one block
    assert config.split_plan(0, 64, 3) == (64, 1)


@pytest.mark.parametrize("field,value", [("block_n", 48), ("block_n", 8), ("num_splits", 0), ("num_warps", 3),
                                         ("prefetch", 0), ("inline_combine", 1)])
def test_config_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        TritonDecodeConfig(**{field: value})


def test_paged_prefetch_takes_twice_the_stages():
    cfg = TritonDecodeConfig(prefetch=2)
    assert cfg.num_stages(paged=True) == 5 and cfg.num_stages(paged=False) == 3
