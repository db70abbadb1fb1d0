"""The paged flash-attention forward (``ejkernel_cuda.ragged_page_attention``, ``csrc/flash_attention/
paged_forward.cu``).

CPU: the kernel in the library (sm_90a SASS with wgmma and TMA, no local memory), ptxas's report of it (no
spills), every refusal and its message, the config, its registration (above Triton), the lowering
to the custom call (jit, vmap: one call per element), the refused gradient, and a model of split-K's
arithmetic (every key block of every split packed tile in exactly one chunk, every slot inside the scratch). GPU
(``-m gpu``, sm_90): mixed batches (prefill chunks, decode rows, speculative chunks, 600 slots, NaN past the
contexts, few long decodes that split their keys, 16 launches in one executable against single launches)
against the float32 reference at bf16/fp16 tolerances, and
the shared conformance suite with its inputs widened to what the kernel takes (head_dim 128, pages of 64).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules import ragged_page_attention
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttention
from ejkernel.testing.numerics import assert_close
from ejkernel.testing.page_attention import random_block_tables
from ejkernel.testing.ragged_page_attention import RaggedPageAttentionConformance, reference_ragged_page_attention
from ejkernel_cuda import _native, native_flash, plugin
from ejkernel_cuda import ragged_page_attention as paged
from ejkernel_cuda.ragged_page_attention import IMPLEMENTATION, CudaPagedConfig
from native_tools import cuobjdump, mnemonics, needs_nvcc, ptxas_kernels, ptxas_report

ON_GPU = jax.default_backend() == "gpu"
PACKAGE = Path(__file__).resolve().parents[1]
KERNEL = "paged_forward_kernel"
COMBINE = "combine_split_rows_kernel"
SOURCE = PACKAGE / "csrc" / "flash_attention" / "paged_forward.cu"


def batch(sequences, heads=8, kv_heads=2, dim=128, page_size=64, dtype=jnp.bfloat16, inactive=0, padding=0,
          seed=0, kv_dtype=None):
    """Inputs of a mixed batch: ``sequences`` = [(q_len, kv_len)], then inactive slots and padding rows; pages
    shuffled over the cache (``random_block_tables``: unused entries -1)."""
    q_lens = np.array([q for q, _ in sequences] + [0] * inactive, np.int32)
    kv_lens = np.array([k for _, k in sequences] + [0] * inactive, np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    max_pages = int(-(-max(kv_lens.max(), 1) // page_size)) + 1
    num_pages = len(q_lens) * max_pages + 3
    ks = jax.random.split(jax.random.key(seed), 2)
    return dict(
        queries=jax.random.normal(ks[0], (int(starts[-1]) + padding, heads, dim), jnp.float32).astype(dtype),
        kv_pages=jax.random.normal(ks[1], (num_pages, page_size, 2 * kv_heads, dim), jnp.float32).astype(
            kv_dtype or dtype),
        context_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(random_block_tables(seed, len(q_lens), max_pages, num_pages, kv_lens, page_size)),
        query_start_loc=jnp.asarray(starts),
        num_seqs=jnp.asarray([len(sequences)], jnp.int32),
    )


ARGUMENTS = ("queries", "kv_pages", "context_lens", "block_tables", "query_start_loc", "num_seqs")


def positional(inputs):
    """The operation's positional arguments in order (a dict through jit comes back with its keys sorted)."""
    return [inputs[name] for name in ARGUMENTS] + ([inputs["softmax_aux"]] if "softmax_aux" in inputs else [])


def validated(inputs, **kw):
    return RaggedPageAttention().validate(*positional(inputs), **kw)


# ---- the kernel in the library and in ptxas's report --------------------------------------------------


def _functions(sass: str) -> dict[str, str]:
    """SASS listing per function name."""
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    return dict(zip(parts[1::2], parts[2::2]))


@needs_nvcc
def test_library_holds_the_paged_kernel_with_wgmma_and_tma_without_local_memory():
    """The 24 instantiations (bf16, fp16; D = 64, 128; 2 and 3 K/V stages; plain, window / sinks, soft-capped)
    are in the library: warpgroup MMAs (HGMMA), TMA loads (UTMALDG), 16-byte global stores for the masked output
    (no TMA store), and no local memory (spills would be there)."""
    assert _native.library_missing() is None, _native.library_missing()
    kernels = {name: body for name, body in _functions(cuobjdump("-sass", str(_native.LIBRARY_PATH))).items()
               if KERNEL in name}
    assert len(kernels) == 24, list(kernels)
    assert len(re.findall(rf"Function : \S*{COMBINE}", cuobjdump("-sass", str(_native.LIBRARY_PATH)))) == 4
    for name, body in kernels.items():
        found = mnemonics(body)
        assert {"HGMMA", "UTMALDG", "STG"} <= found, (name, sorted(found))
        assert "UTMASTG" not in found, name
    usage = cuobjdump("-res-usage", str(_native.LIBRARY_PATH))
    lines = re.findall(rf"Function \S*{KERNEL}\S*:\s*\n?\s*(REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+)", usage)
    assert len(lines) == 24, usage[:2000]
    for line in lines:
        assert "STACK:0 " in line and line.endswith("LOCAL:0"), line


def test_ptxas_reports_no_spills_for_the_paged_kernel():
    """ptxas's report of paged_forward.cu (the library build's): all 24 instantiations at the pipeline's 168
    registers (384 threads, one CTA per SM; the producer's setmaxnreg.dec to 40 and the consumers' inc to 232 fit
    that pool), no stack, no spill, and no "Potential Performance Loss" (ptxas ignoring setmaxnreg because a role's
    code needs more registers than its budget, or serializing wgmma for want of registers: both happened to the
    persistent loop's first draft)."""
    report = ptxas_report("flash_attention/paged_forward.cu")
    entries = ptxas_kernels(report, KERNEL)
    assert len(entries) == 24, report[-4000:]
    for name, *usage in entries:
        assert usage == [0, 0, 0, 168], (name, usage)
    assert "Potential Performance Loss" not in report, report


# ---- split-K's arithmetic (a model of the kernel's, on its constants) -----------------------------------


def _kernel_constant(name: str) -> int:
    """A ``constexpr int`` of paged_forward.cu (products of integers and earlier constants)."""
    source = SOURCE.read_text()
    expression = re.search(rf"constexpr int {name} = ([^;]+);", source).group(1)
    for constant in re.findall(r"k[A-Z]\w+", expression):
        expression = expression.replace(constant, str(_kernel_constant(constant)))
    assert re.fullmatch(r"[\d\s*+()]+", expression), expression
    return eval(expression)  # noqa: S307 - digits and * + ( ) only, checked above


def packed_blocks(q_len, kv_len, window_left=-1):
    """Key blocks [first, last) of a packed tile (key_blocks over all its rows: causal, the window's left edge)."""
    block = _kernel_constant("kPagedBlockKeys")
    if kv_len <= 0:
        return 0, 0
    lo = max(0, kv_len - q_len - window_left) if window_left >= 0 else 0
    return lo // block, (kv_len - 1) // block + 1


def split_items(q_lens, kv_lens, heads, kv_heads, sms, window_left=-1):
    """The packed items of a batch as the kernel makes them (build_paged_table, packed_keys, packed_splits,
    paged_item, item_keys + split_chunk): [(sequence, kv head, split, splits, slot, (first block, last block))],
    in packed index order (the slot is the packed index)."""
    slots, max_splits = _kernel_constant("kSplitSlots"), _kernel_constant("kMaxSplits")
    min_keys = _kernel_constant("kMinSplitKeys")
    rows = _kernel_constant("kPackedRows")
    target = min(2 * sms, slots // 2)
    group = heads // kv_heads
    packed = [s for s, q in enumerate(q_lens) if 0 < q and q * group <= rows]
    unsplit = len(packed) * kv_heads
    factor = min(-(-target // unsplit), max_splits) if 0 < unsplit < target else 1
    items = []
    for s in packed:
        kv_len = kv_lens[s]
        keys = min(kv_len, q_lens[s] + window_left) if window_left >= 0 else kv_len  # packed_keys
        splits = max(min(factor, -(-keys // min_keys)), 1)
        first, last = packed_blocks(q_lens[s], kv_len, window_left)
        for local in range(kv_heads * splits):
            head, split = divmod(local, splits)
            count = last - first
            chunk = (first + count * split // splits, first + count * (split + 1) // splits)
            items.append((s, head, split, splits, len(items), chunk))
    return items, target


def check_split_items(q_lens, kv_lens, heads, kv_heads, sms, window_left=-1):
    items, target = split_items(q_lens, kv_lens, heads, kv_heads, sms, window_left)
    split = [item for item in items if item[3] > 1]
    if split:  # slots (packed indices) below 2 * target <= the scratch's
        assert len(items) < 2 * target <= paged.SPLIT_SLOTS, (len(items), target)
    pairs = {}
    for s, head, index, splits, slot, chunk in items:
        pairs.setdefault((s, head), []).append((index, splits, slot, chunk))
    for (s, head), chunks in pairs.items():
        kv_len = kv_lens[s]
        whole = packed_blocks(q_lens[s], kv_len, window_left)
        splits = chunks[0][1]
        assert [c[0] for c in chunks] == list(range(len(chunks))) and len(chunks) == max(splits, 1)
        # the pair's slots are consecutive from chunk 0's (the combine kernel's descriptor), chunks in order
        assert [c[2] for c in chunks] == list(range(chunks[0][2], chunks[0][2] + len(chunks)))
        # every key block in exactly one chunk: the chunks tile [first, last) in order, none empty where there
        # are keys
        bounds = [whole[0]] + [c[3][1] for c in chunks]
        assert [c[3] for c in chunks] == list(zip(bounds, bounds[1:])) and bounds[-1] == whole[1], (kv_len, chunks)
        if kv_len > 0:
            assert all(c[3][1] > c[3][0] for c in chunks), chunks


def test_split_constants_match_the_python_scratch():
    """The scratch's static shape (Python) is the kernel's (the handler refuses any other)."""
    assert paged.SPLIT_SLOTS == _kernel_constant("kSplitSlots")
    assert paged.SPLIT_SLOT_ROWS == _kernel_constant("kPackedRows")
    assert paged.HEAD_DIM == _kernel_constant("kPagedHeadDim")
    assert paged.WORK_INTS == _kernel_constant("kPagedWorkInts")


def test_split_keys_for_two_long_decodes_cover_the_sms():
    """2 decodes over 32k tokens, 8 kv heads (the measured case: 16 packed tiles on 132 SMs): 16 chunks each, 256
    items of 16 key blocks; 60 decodes over 4096 (P0 = 480 >= 264): nothing splits."""
    items, _ = split_items([1, 1], [32768, 32768], 32, 8, 132)
    assert len(items) == 256 and {i[3] for i in items} == {16} and {i[5][1] - i[5][0] for i in items} == {16}
    items, _ = split_items([1] * 60 + [512] * 4, [4096] * 64, 32, 8, 132)
    assert len(items) == 480 and {i[3] for i in items} == {1}


@pytest.mark.parametrize("sms", [1, 2, 7, 66, 114, 132, 133, 264, 1000])
def test_split_chunks_cover_every_key_block_once_within_the_scratch(sms):
    """Batches of 1 to 300 packed sequences (and a prefill one, and a q_len-0 slot) of lengths around the chunk
    and block bounds, GQA 1-8: every pair's chunks tile its key blocks, slots stay below the scratch's bound."""
    rng = np.random.default_rng(sms)
    edges = [1, 2, 127, 128, 129, 1023, 1024, 1025, 2047, 2049, 8191, 32768, 100_000]
    for count in list(range(1, 40)) + [63, 64, 65, 131, 132, 133, 263, 264, 265, 300]:
        for heads, kv_heads in ((8, 8), (8, 2), (32, 8), (8, 1)):
            q_lens = [int(q) for q in rng.integers(1, 64 // (heads // kv_heads) + 1, size=count)] + [300, 0]
            kv_lens = [int(rng.choice(edges)) if rng.random() < 0.5 else int(rng.integers(1, 50_000))
                       for _ in range(count)] + [400, 7]
            kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens)]
            check_split_items(q_lens, kv_lens, heads, kv_heads, sms)


@pytest.mark.parametrize("window_left", [0, 63, 127, 1000, 4095, 20000])
def test_split_chunks_of_windowed_decodes_cover_their_key_blocks(window_left):
    """With a sliding window a packed tile sees only its last q_len + window_left keys: the chunk count follows
    those (packed_keys), not the context, so no chunk is empty and the chunks tile the window's blocks."""
    rng = np.random.default_rng(window_left)
    for count in (1, 2, 3, 8, 33, 70):
        q_lens = [int(q) for q in rng.integers(1, 5, size=count)]
        kv_lens = [max(int(k), q) for k, q in zip(rng.integers(1, 60_000, size=count), q_lens)]
        check_split_items(q_lens, kv_lens, 16, 4, 132, window_left)
    items, _ = split_items([1, 1], [32768, 32768], 32, 8, 132, window_left)
    expected = max(min(16, -(-min(32768, 1 + window_left) // _kernel_constant("kMinSplitKeys"))), 1)
    assert {i[3] for i in items} == {expected}


def test_split_slots_stay_in_the_scratch_at_the_worst_counts():
    """Every P0 below the target, all contexts long (the split factor alone decides): P0 * ceil(target / P0) <
    2 * target <= SPLIT_SLOTS."""
    for sms in (1, 66, 132, 1000):
        target = min(2 * sms, paged.SPLIT_SLOTS // 2)
        for kv_heads in (1, 8):
            for sequences in range(1, target // kv_heads + 2):  # past the target nothing splits
                check_split_items([1] * sequences, [10**6] * sequences, kv_heads, kv_heads, sms)


# ---- refusals, config, registration -------------------------------------------------------------------


@pytest.mark.parametrize("kw,changes,reason", [
    (dict(key_scale=0.5), {}, r"key_scale/value_scale \(quantized pages\)"),
    (dict(), dict(kv_dtype=jnp.float8_e4m3fn), "kv_pages dtype float8_e4m3fn"),
    (dict(), dict(dtype=jnp.float32), "dtype float32 is not supported"),
    (dict(), dict(dim=32), r"head_dim 32 is not supported \(only 64 or 128\)"),
    (dict(), dict(dim=256), r"head_dim 256 is not supported"),
    (dict(), dict(page_size=16), "page_size 16 is not supported"),
    (dict(), dict(page_size=96), "page_size 96 is not supported"),
    (dict(softmax_scale=-0.1), {}, r"softmax_scale=-0.1"),
])
def test_refuses_each_feature_it_does_not_implement(kw, changes, reason):
    inputs = batch([(5, 70), (1, 9)], **{k: v for k, v in changes.items() if k != "softmax_aux"})
    if "softmax_aux" in changes:
        inputs["softmax_aux"] = changes["softmax_aux"]
    call = validated(inputs, **kw)
    assert re.search(reason, paged.refusal(call, check_device=False))
    with pytest.raises(UnsupportedFeature, match=f"cuda paged flash attention: {reason}"):
        paged.check_supported(call, check_device=False)


def test_refuses_more_sequence_slots_than_its_table_holds(monkeypatch):
    monkeypatch.setattr(paged, "MAX_SEQS", 2)
    reason = paged.refusal(validated(batch([(5, 70), (1, 9), (1, 3)])), check_device=False)
    assert reason.startswith("max_num_seqs 3 is not supported (at most 2"), reason


@pytest.mark.parametrize("kw,call_kw", [
    (dict(), {}), (dict(dtype=jnp.float16), {}), (dict(page_size=128), {}), (dict(page_size=192), {}),
    (dict(heads=8, kv_heads=8), {}), (dict(heads=8, kv_heads=1), {}), (dict(heads=32, kv_heads=8), {}),
    (dict(dim=64), {}), (dict(dim=64, dtype=jnp.float16, heads=16, kv_heads=2), dict(sliding_window=128)),
    (dict(), dict(logits_soft_cap=30.0)), (dict(), dict(sliding_window=64)),
    (dict(), dict(logits_soft_cap=50.0, sliding_window=1)), (dict(sinks=(8,)), {}), (dict(sinks=(8, 3)), {}),
])
def test_takes_the_calls_of_its_contract(kw, call_kw):
    sinks = kw.pop("sinks", None)
    inputs = batch([(300, 1000), (0, 5), (1, 64)], **kw)
    if sinks is not None:
        inputs["softmax_aux"] = jnp.zeros(sinks, jnp.float32)
    call = validated(inputs, **call_kw)
    assert paged.refusal(call, check_device=False) is None


@pytest.mark.skipif(ON_GPU, reason="the refusals of a machine without a GPU")
def test_without_a_gpu_it_is_refused_with_the_reason():
    call = validated(batch([(5, 70)]))
    assert paged.refusal(call).startswith("no GPU visible")
    with pytest.raises(UnsupportedFeature, match="cuda paged flash attention: no GPU visible"):
        IMPLEMENTATION.supports(call)
    with pytest.raises(UnsupportedFeature, match="cuda paged flash attention: no GPU visible"):
        IMPLEMENTATION(call, CudaPagedConfig())


def test_config_is_frozen_spelled_out_and_takes_the_compiled_tiles_only():
    config = IMPLEMENTATION.heuristic_config(validated(batch([(5, 70)])))
    assert config == CudaPagedConfig(128, 128, paged.PACKED_SHARE)
    assert all(getattr(config, f.name) is not None for f in dataclasses.fields(config))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_q = 64
    with pytest.raises(ValueError, match=r"CudaPagedConfig.block_kv must be 128 \(the compiled tile\), got 64"):
        CudaPagedConfig(block_kv=64)
    for share in (-1, 9, 2.0):
        with pytest.raises(ValueError, match=r"CudaPagedConfig.packed_share must be an int in \[0, 8\]"):
            CudaPagedConfig(packed_share=share)
    candidates = IMPLEMENTATION.candidate_configs(validated(batch([(5, 70)])))
    assert [c.packed_share for c in candidates] == [3, 4, 5]


def test_registered_and_ranked_above_triton():
    assert plugin.IMPLEMENTATIONS["ragged_page_attention"] == "ejkernel_cuda.ragged_page_attention:IMPLEMENTATION"
    assert "ragged_page_attention" not in plugin.UNVERIFIED
    assert _native.PAGED_TARGET in _native.TARGETS
    # auto takes it over Triton (measured faster: PRIORITY's docstring); what it refuses falls to Triton
    triton_plugin = pytest.importorskip("ejkernel_triton.plugin")
    assert IMPLEMENTATION.priority_for(validated(batch([(5, 70)]))) == paged.PRIORITY > triton_plugin.BACKEND.priority


# ---- lowering (CPU: the custom call, without running it) ----------------------------------------------


def _lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowers_to_the_custom_call_and_vmaps_one_call_per_element(monkeypatch):
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    inputs = batch([(300, 1000), (1, 64)], padding=3)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in positional(inputs)]
    text = _lowered(lambda *a: paged.paged_attention(*a, scale=0.125), *shapes)
    assert "custom_call @EjkPagedForward" in text and "softmax_scale = 1.250000e-01 : f32" in text
    assert f"packed_share = {paged.PACKED_SHARE} : i32" in text
    assert "softcap = 0.000000e+00 : f32" in text and "window_left = -1 : i32" in text  # off
    assert "num_sinks = 0 : i32" in text
    sinks = jax.ShapeDtypeStruct((8, 2), jnp.bfloat16)
    capped = _lowered(lambda *a: paged.paged_attention(*a, scale=0.125, soft_cap=30.0, sliding_window=64),
                      *shapes, sinks)
    assert "softcap = 3.000000e+01 : f32" in capped and "window_left = 63 : i32" in capped
    assert "num_sinks = 2 : i32" in capped and "tensor<8x2xf32>" in capped
    # the scratch results: the work buffer and split-K's partial tiles (static shapes)
    assert f"tensor<{paged.WORK_INTS}xi32>" in text and f"tensor<{paged.SPLIT_SLOTS}x64x130xf32>" in text
    stacked = jax.ShapeDtypeStruct((2, *inputs["queries"].shape), inputs["queries"].dtype)
    vmapped = jax.vmap(lambda q, *rest: paged.paged_attention(q, *rest, scale=0.125), in_axes=(0,) + (None,) * 5)
    text = _lowered(vmapped, stacked, *shapes[1:])
    assert "custom_call @EjkPagedForward" in text and "stablehlo.while" in text  # sequential: a loop of calls


def test_gradient_is_refused(monkeypatch):
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    inputs = batch([(3, 70)])
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in positional(inputs)]

    def loss(q, *rest):
        return paged.paged_attention(q, *rest, scale=0.1).astype(jnp.float32).sum()

    with pytest.raises(UnsupportedFeature, match="cuda paged flash attention is forward-only"):
        jax.jit(jax.grad(loss)).trace(*shapes)


# ---- GPU ----------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU"))


@pytest.fixture
def paged_gpu():
    reason = native_flash.device_refusal()
    if reason is not None:
        pytest.skip(reason)
    assert native_flash.usable_here() is None, native_flash.usable_here()


def run_cuda(inputs, **kw):
    step = jax.jit(lambda x: ragged_page_attention(*positional(x), platform="cuda", cfg=CudaPagedConfig(), **kw))
    return step(inputs)


def reference(inputs, **kw):
    widened = {k: v.astype(jnp.float32) if v.dtype in (jnp.bfloat16, jnp.float16) else v for k, v in inputs.items()}
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda x: reference_ragged_page_attention(*positional(x), **kw))(widened)


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sequences,heads,kv_heads,page_size,inactive,padding", [
    # the reference gathers every row's whole table ([rows, table keys, Hq, D] in float32): kept to ~2 GB each
    # the mixed step, scaled down: prefill chunks, decode rows, a q_len-0 slot, odd lengths and contexts
    ([(300, 1000), (1, 517), (0, 64), (129, 129), (77, 700), (1, 1)], 8, 2, 64, 2, 5),  # GQA 4
    ([(200, 600), (1, 600), (1, 300)], 32, 8, 64, 0, 0),  # GQA 4, the benchmark's heads
    ([(128, 128), (127, 200), (1, 63), (200, 1030)], 8, 8, 128, 1, 0),  # GQA 1, pages of 128
    ([(65, 70), (1, 1), (333, 900)], 8, 1, 192, 0, 11),  # MQA (GQA 8), pages of 192
    ([(1, 5), (1, 64), (1, 65), (1, 4000)], 16, 2, 64, 3, 0),  # decode rows only
    # packed tiles hold up to 64 / G rows of a sequence: speculative chunks at and across that bound (G = 4)
    ([(2, 70), (15, 300), (16, 129), (17, 600), (8, 8), (3, 1)], 16, 4, 64, 0, 2),
])
def test_matches_the_reference(dtype, sequences, heads, kv_heads, page_size, inactive, padding):
    inputs = batch(sequences, heads=heads, kv_heads=kv_heads, page_size=page_size, dtype=jnp.dtype(dtype),
                   inactive=inactive, padding=padding, seed=len(sequences))
    out = run_cuda(inputs, softmax_scale=0.09)
    used = int(inputs["query_start_loc"][len(sequences)])
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)  # padding rows: zeros
    assert_close(out, reference(inputs, softmax_scale=0.09), dtype=dtype)


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("soft_cap,window,sinks", [
    (30.0, None, None), (5.0, None, None),  # a cap that binds (scores of ~|10| at scale 0.09 and these inputs)
    (None, 1, None), (None, 64, None), (None, 100, None), (None, 129, None),  # windows inside a block, on and
    (None, 700, None),  # off its bounds
    (None, None, (8,)), (None, None, (8, 3)),  # one sink per head, three
    (50.0, 200, (8,)),
])
def test_soft_cap_window_and_sinks_match_the_reference(dtype, soft_cap, window, sinks):
    """The mixed step scaled down (prefill chunks longer than the window, decode rows, speculative chunks,
    contexts shorter than the window, a q_len-0 slot) with the logits soft-capped, a sliding window and / or
    attention sinks: query tiles and packed tiles skip the key blocks left of the window and mask inside it; the
    sinks join each row's denominator once (a packed tile's rows are four query heads, each with its own)."""
    sequences = [(300, 1000), (1, 517), (0, 64), (129, 129), (77, 700), (1, 1), (3, 90), (16, 300)]
    inputs = batch(sequences, heads=8, kv_heads=2, dtype=jnp.dtype(dtype), inactive=1, padding=5, seed=31)
    if sinks is not None:  # logits of the scores' size, so that they matter
        inputs["softmax_aux"] = 2.0 * jax.random.normal(jax.random.key(3), sinks, jnp.float32)
    kw = dict(softmax_scale=0.09, logits_soft_cap=soft_cap, sliding_window=window)
    out = run_cuda(inputs, **kw)
    used = int(inputs["query_start_loc"][len(sequences)])
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)
    assert_close(out, reference(inputs, **kw), dtype=dtype)


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("soft_cap,window,sinks", [
    (None, 3000, None), (30.0, None, None), (30.0, 9000, None), (None, None, (8, 2)), (20.0, 5000, (8,)),
])
def test_split_keys_with_soft_cap_window_or_sinks_match_the_reference(soft_cap, window, sinks):
    """Few long decodes split into key chunks (the chunk count from the keys the window leaves) with the soft cap
    (the partials' maxima in capped log2 units, as the combine kernel reads them), a window and / or sinks (in
    the first chunk's partial only, counted once by the combine); pages poisoned with NaN past the contexts."""
    inputs = batch([(1, 20000), (2, 12001), (1, 700)], heads=8, kv_heads=2, page_size=128, seed=41)
    if sinks is not None:
        inputs["softmax_aux"] = 2.0 * jax.random.normal(jax.random.key(4), sinks, jnp.float32)
    kw = dict(softmax_scale=0.09, logits_soft_cap=soft_cap, sliding_window=window)
    out = run_cuda(poisoned_past_contexts(inputs), **kw)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, reference(inputs, **kw), dtype="bfloat16")


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sequences,heads,kv_heads,features", [
    # gpt-oss's shape of attention: head_dim 64, 8 query heads per kv head, sinks, a 128-key window
    ([(300, 1000), (1, 517), (0, 64), (8, 700), (1, 1), (9, 90)], 16, 2, dict(sinks=(16,), sliding_window=128)),
    ([(200, 600), (1, 600), (3, 300)], 16, 2, {}),
    ([(1, 20000), (1, 9000)], 16, 2, dict(logits_soft_cap=30.0)),  # split key chunks
    ([(65, 70), (1, 1), (333, 900)], 8, 8, dict(sliding_window=100)),
])
def test_head_dim_64_matches_the_reference(dtype, sequences, heads, kv_heads, features):
    """Head dim 64 (one 128-byte panel per row; split-K's slots use the first 64 columns), with and without the
    optional features."""
    inputs = batch(sequences, heads=heads, kv_heads=kv_heads, dim=64, dtype=jnp.dtype(dtype), inactive=1,
                   padding=3, seed=51)
    kw = dict(features)
    if "sinks" in kw:
        inputs["softmax_aux"] = 2.0 * jax.random.normal(jax.random.key(5), kw.pop("sinks"), jnp.float32)
    out = run_cuda(poisoned_past_contexts(inputs), softmax_scale=0.125, **kw)
    used = int(inputs["query_start_loc"][len(sequences)])
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)
    assert_close(out, reference(inputs, softmax_scale=0.125, **kw), dtype=dtype)


@gpu
@pytest.mark.usefixtures("paged_gpu")
def test_many_sequences_fill_the_work_table():
    """600 sequence slots (the table's scan takes two entries per thread), decode rows of every context length
    class beside a few prefill chunks; the persistent CTAs hand out both kinds of item."""
    rng = np.random.default_rng(11)
    sequences = [(1, int(n)) for n in rng.integers(1, 300, size=560)] + [(150, 400), (40, 41), (1, 1)]
    inputs = batch(sequences, heads=8, kv_heads=2, inactive=37, padding=3, seed=11)
    assert_close(run_cuda(inputs), reference(inputs), dtype="bfloat16")


def poisoned_past_contexts(inputs):
    """The inputs with NaN in every page row no context covers (unused pages too)."""
    tables, lens = np.asarray(inputs["block_tables"]), np.asarray(inputs["context_lens"])
    page_size = inputs["kv_pages"].shape[1]
    live = np.zeros(inputs["kv_pages"].shape[:2], bool)
    for seq, length in enumerate(lens):
        keys = np.arange(int(length))
        live[tables[seq, keys // page_size], keys % page_size] = True
    return {**inputs, "kv_pages": jnp.where(jnp.asarray(live)[:, :, None, None], inputs["kv_pages"], jnp.nan)}


@gpu
@pytest.mark.usefixtures("paged_gpu")
def test_nan_in_page_storage_past_the_contexts_does_not_reach_the_output():
    """Contexts ending inside a 64-row load (odd lengths, pages of 128): every page row no context covers holds
    NaN, unused pages too; the output is the reference's on the finite cache."""
    sequences = [(70, 130), (1, 65), (129, 200), (1, 1)]
    inputs = batch(sequences, page_size=128, seed=5)
    out = run_cuda(poisoned_past_contexts(inputs))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, reference(inputs), dtype="bfloat16")


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sequences,heads,kv_heads,page_size", [
    # few packed tiles (P0 < 2 per SM): their keys split into chunks on several SMs, merged by the combine kernel
    ([(1, 20000), (1, 20000)], 8, 2, 64),  # 2 long decodes, GQA 4: 4 unsplit tiles -> 16 chunks each
    ([(1, 30001)], 8, 2, 64),  # one decode row
    ([(1, 6000), (1, 5000), (3, 4097), (40, 6000)], 8, 2, 64),  # long decodes, a speculative chunk, a prefill chunk
    ([(1, 1025), (1, 2049), (1, 9999), (16, 3000)], 8, 2, 128),  # contexts off the 128 grid; 16 rows = 64 / G
])
def test_split_keys_of_few_long_decodes_match_the_reference(dtype, sequences, heads, kv_heads, page_size):
    """The reference gathers [rows, table keys, Hq, D] in float32 (keys and values): each under ~1.2 GB here."""
    inputs = batch(sequences, heads=heads, kv_heads=kv_heads, page_size=page_size, dtype=jnp.dtype(dtype),
                   inactive=1, padding=3, seed=len(sequences) + 20)
    out = run_cuda(inputs, softmax_scale=0.09)
    used = int(inputs["query_start_loc"][len(sequences)])
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)
    assert_close(out, reference(inputs, softmax_scale=0.09), dtype=dtype)


@gpu
@pytest.mark.usefixtures("paged_gpu")
def test_split_keys_with_nan_in_page_storage_past_the_contexts():
    """Split chunks over pages poisoned with NaN wherever no context reaches (contexts ending inside a 64-row
    load, pages of 128): only the last chunk holds the tail; no NaN in any partial or the output."""
    inputs = batch([(1, 5000), (1, 3001), (2, 2500)], page_size=128, seed=6)
    out = run_cuda(poisoned_past_contexts(inputs))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, reference(inputs), dtype="bfloat16")


@gpu
@pytest.mark.usefixtures("paged_gpu")
@pytest.mark.parametrize("sequences,heads,kv_heads", [
    ([(1, 32768), (1, 20000)], 8, 2),  # split: chunks of 10-16 key blocks
    ([(1, 4096)] * 40 + [(200, 1000)], 32, 8),  # 320 unsplit packed tiles of 32 key blocks beside a prefill chunk
])
def test_many_launches_in_one_executable_give_the_single_launch_results(sequences, heads, kv_heads):
    """16 calls in one executable, each on its own queries (a model's layers), against the same calls made one by
    one: bit for bit (the kernel is deterministic); the first also against the reference where that is cheap.
    Back-to-back launches catch races between the warpgroups that single launches rarely show: a 3-stage packed
    tile whose warpgroups could wait on a two-phases-old mbarrier parity faulted in a 16-layer timing run and
    passed every other test."""
    inputs = batch(sequences, heads=heads, kv_heads=kv_heads, seed=8)
    calls = [{**inputs, "queries": inputs["queries"] * (1 + i / 64)} for i in range(16)]

    def attend(x):
        return ragged_page_attention(*positional(x), platform="cuda", cfg=CudaPagedConfig())

    together = jax.jit(lambda xs: [attend(x) for x in xs])(calls)
    one_by_one = [jax.jit(attend)(x) for x in calls]
    for i, (a, b) in enumerate(zip(together, one_by_one)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"call {i}")
    if len(sequences) < 4:  # the reference gathers [rows, table keys, Hq, D] in float32
        assert_close(together[0], reference(calls[0]), dtype="bfloat16")


@gpu
@pytest.mark.usefixtures("paged_gpu")
def test_traced_num_seqs_stale_rows_and_vmap():
    """num_seqs traced (rows of the inactive sequences become zeros, whatever they held); vmap over queries."""
    inputs = batch([(200, 700), (1, 100), (90, 90)], seed=3)
    fn = jax.jit(lambda x, n: ragged_page_attention(*positional({**x, "num_seqs": n}), platform="cuda"))
    out = fn(inputs, jnp.asarray([2], jnp.int32))
    expected = reference({**inputs, "num_seqs": jnp.asarray([2], jnp.int32)})
    assert_close(out, expected, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(out[201:], np.float32), 0.0)
    stacked = jnp.stack([inputs["queries"], -inputs["queries"]])
    batched = jax.jit(jax.vmap(lambda q: ragged_page_attention(q, *positional(inputs)[1:], platform="cuda")))(stacked)
    assert_close(batched[1], reference({**inputs, "queries": stacked[1]}), dtype="bfloat16")


@gpu
@pytest.mark.usefixtures("paged_gpu")
class TestPagedConformance(RaggedPageAttentionConformance):
    """The shared suite on the paged kernel: its inputs widened to what the kernel takes (head_dim 128, pages of
    64, 16-bit) and checked at bf16 tolerance; what it refuses (sinks, quantized pages) is reported as skips
    naming the reason."""

    platform = "cuda"
    supports_gradients = False

    def make_inputs(self, seed, case, dtype, **kw):
        heads, kv_heads, _, _, sequences, inactive, padding = case
        dtype = "bfloat16" if dtype == "float32" else dtype
        return super().make_inputs(seed, (heads, kv_heads, 128, 64, sequences, inactive, padding), dtype, **kw)

    def call(self, **arguments):
        try:
            return super().call(**arguments)
        except UnsupportedFeature as error:
            pytest.skip(str(error))

    def check(self, inputs, dtype, **static):
        super().check(inputs, "float16" if dtype == "float16" else "bfloat16", **static)

    def test_num_seqs_as_int_jit_and_vmap(self):
        pytest.skip("float32 tolerances: test_traced_num_seqs_stale_rows_and_vmap covers it at bf16")
