"""Decode attention benchmark: ejkernel's page_attention and ragged_decode_attention (every backend registered
for the GPU) against JAX's Pallas `decode_attention.gqa` (contiguous KV) and flash-attn3-jax's
`flash_mha_with_kvcache` with a page table, in one run, with the device's copy bandwidth measured alongside.

One command (on a GPU; through the device tool: `bash scripts/device/run.sh python3 benchmarks/decode.py`):

    python benchmarks/decode.py                       # the standard sweep
    python benchmarks/decode.py --shapes 32x4096 --no-sweep
    python benchmarks/decode.py --replot benchmarks/results/X.json

One decode step: every sequence has one new query token (32 query / 8 kv heads, D=128, bf16) and a full
cache of `context` tokens. Shapes: 32 sequences x 4096 tokens (the standard), contexts 512, 1k, 2k, 8k, 32k at 32
sequences, batches 1, 8, 64 at 4096 tokens; paged caches with pages of 16 and 64 (pages shuffled over the
cache, as a server's allocator leaves them). GB/s = bytes of K and V read (2·B·ctx·Hkv·D·2) / time.
Copy bandwidth: `x + 1` over 4 GiB of float32, bytes read + written. Timing as `attention.py`: jit, warm-up,
median of `--reps` samples, each the mean of `--calls` back-to-back calls, rotating over enough input sets to
exceed the L2 cache. `--layers 1,16` (default): besides one dispatched call per step, the step over 16 caches
(a model's 16 layers, each with its own cache) in ONE executable, time per layer (`gbps_layers16` in the JSON):
a decode step of a few tens of microseconds is otherwise timed at the host's dispatch rate (~30 us per call on
the device machines), not the kernel's; a served model runs all its layers in one executable. Numerics:
relative L2 error of each output against a float32 reference (shapes up to
2 GB of cache). `--sweep`: the Triton kernels with other configs at the standard shape or `--sweep-shapes`
(the schedule candidates of packages/ejkernel-triton/NOTES.md; `--sweep-set former`: the former heuristic's
config, for A/B). `--final`: the short run of scripts/device/serving.sh with FINAL=1: the defaults, then the
mixed batch, then a few candidates at the shapes they concern.

`--mixed` (on by default): `ragged_page_attention` on the mixed batch of `MIXED` (pages of `--page-sizes`),
with its two parts alone (the prefill chunks only; the decode rows only; first page size) to split the time,
and the Triton schedule candidates (`--mixed-candidates`, `MIXED_CANDIDATES`), against both
ceilings: bytes (K+V of every sequence read once, plus queries and outputs) at the copy bandwidth, and FLOPs
(4·H·D per visible (query, key) pair) at the bf16 matmul rate measured in the same run (8192^3 `jnp.dot`).
`--mixed-platforms` picks the backends (XLA gathers every query row's pages: slow, off in the device script).

Writes `benchmarks/results/<gpu>-<date>-decode.json` (after every measurement) and a PNG, prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import relative_error, time_calls, usable_gpu_platforms, versions  # noqa: E402
from _harness import failure  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STANDARD = (32, 4096)
DEFAULT_SHAPES = "32x4096,32x512,32x1024,32x2048,32x8192,32x32768,1x4096,8x4096,64x4096"
MIXED = dict(prefills=4, prefill_len=512, decodes=60, context=4096)
"""The mixed (continuous-batching) step: 4 prefill chunks of 512 new tokens and 60 decode rows, all over 4096
cached tokens (each chunk's tokens are its sequence's last 512)."""


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    layout: str  # "paged" (ejkernel's [pages, Hkv, page, D]), "fa3-paged" ([pages, page, Hkv, D]),
    #              "contiguous" ([B, S, Hkv, D]) or "heads-major" ([B, Hkv, S, D])
    fn: Callable  # (inputs dict) -> out [B, H, D]
    standard_only: bool = False  # slow or reference-only peers: the standard shape only
    note: str = ""
    sweep_shapes: frozenset = frozenset()  # a config-sweep row: the (batch, context) shapes it runs at


# ---- inputs ------------------------------------------------------------------------------------------


def logical_kv(key, batch, context, kv_heads, dim, dtype):
    kk, kv = jax.random.split(key)
    shape = (batch, context, kv_heads, dim)
    return (jax.random.normal(kk, shape, jnp.float32).astype(dtype),
            jax.random.normal(kv, shape, jnp.float32).astype(dtype))


def layout_inputs(layout, k, v, page_size, seed):
    """The same logical cache in an implementation's layout (pages shuffled over the cache)."""
    batch, context, kv_heads, dim = k.shape
    lens = jnp.full((batch,), context, jnp.int32)
    if layout in ("contiguous", "heads-major"):
        if layout == "heads-major":
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return dict(k=k, v=v, lens=lens)
    pages = context // page_size
    perm = np.random.default_rng(seed).permutation(batch * pages)
    inverse = jnp.asarray(np.argsort(perm))
    tables = jnp.asarray(perm.reshape(batch, pages).astype(np.int32))

    def paged(x):
        x = x.reshape(batch * pages, page_size, kv_heads, dim)
        if layout == "paged":
            x = x.transpose(0, 2, 1, 3)
        return x[inverse]  # cache[perm[i]] = logical page i

    return dict(k=paged(k), v=paged(v), lens=lens, tables=tables)


# ---- implementations ---------------------------------------------------------------------------------


def ejkernel_impls(sweep_configs=(), sweep_layouts=("paged", "contiguous")) -> list[Impl]:
    """Every GPU backend's default, and the Triton configs of ``sweep_configs`` ([(config, shapes[, layouts])])
    as extra rows at their shapes (and layouts)."""
    from ejkernel.modules import page_attention, ragged_decode_attention

    impls = []
    for algorithm in ("page_attention", "ragged_decode_attention"):
        for platform in usable_gpu_platforms(algorithm):
            layout = "paged" if algorithm == "page_attention" else "contiguous"
            sweep = sweep_configs if platform == "triton" and layout in sweep_layouts else ()
            for cfg, shapes, *only in [(None, ()), *sweep]:
                if only and layout not in only[0]:
                    continue
                suffix = "" if cfg is None else f"[{cfg_text(cfg)}]"
                if algorithm == "page_attention":
                    def fn(x, platform=platform, cfg=cfg):
                        return page_attention(x["q"], x["k"], x["v"], x["lens"], x["tables"], platform=platform,
                                              cfg=cfg, key_scale=x.get("scale"), value_scale=x.get("scale"))

                    impls.append(Impl(f"ejkernel-{platform} paged{suffix}", "paged", fn,
                                      standard_only=platform != "triton", sweep_shapes=frozenset(shapes)))
                else:
                    def fn(x, platform=platform, cfg=cfg):
                        start = jnp.zeros_like(x["lens"])
                        return ragged_decode_attention(x["q"], x["k"], x["v"], start, x["lens"], platform=platform,
                                                       cfg=cfg)

                    impls.append(Impl(f"ejkernel-{platform} ragged{suffix}", "contiguous", fn,
                                      standard_only=platform != "triton", sweep_shapes=frozenset(shapes)))
    return impls


def cfg_text(cfg) -> str:
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))


def sweep_configs(batch, context, kv_heads) -> list:
    """The decode schedule candidates (NOTES.md, "decode schedule") at the standard shape: [(config, shapes)]."""
    try:
        from ejkernel_triton.decode.config import TritonDecodeConfig, heuristic_config
    except Exception:  # noqa: BLE001
        return []
    h = heuristic_config(batch * kv_heads, context, 128, jnp.bfloat16).num_splits
    # H200 runs of 2026-11-23 at 32 x 4096 (one call per step): 1 split 84-86 %, 2/3/5 splits 57-76 %, 128-key
    # steps / 8 warps / prefetch 3 / the inline combine no better. H100 2026-11-27 (8 layers per executable):
    # the inline combine and 128-key steps won at small batches and short contexts, hence the candidates below
    # (the inline combine only acts when a call has several splits)
    variants = [(64, h, 2, 4, False), (64, h, 2, 4, True), (64, 2 * h, 2, 4, True), (128, h, 1, 4, True),
                (128, h, 2, 4, True), (128, max(1, h // 2), 1, 4, True), (32, h, 3, 4, True), (32, 2 * h, 3, 4, True),
                (256, h, 1, 4, True), (256, h, 1, 8, True)]  # the last two: one-byte (quantized) caches
    out = []
    for n, splits, prefetch, warps, inline in variants:
        cfg = TritonDecodeConfig(block_n=n, num_splits=splits, prefetch=prefetch, num_warps=warps,
                                 inline_combine=inline and splits > 1)
        if cfg not in [c for c, _ in out]:
            out.append((cfg, [(batch, context)]))
    return out


def merged_sweep(shapes, kv_heads) -> list:
    """:func:`sweep_configs` at each of ``shapes``, one row per config with every shape it runs at."""
    by_config: dict = {}
    for batch, context in shapes:
        for cfg, at in sweep_configs(batch, context, kv_heads):
            by_config.setdefault(cfg, []).extend(at)
    return list(by_config.items())


def former_default_configs(shapes, kv_heads) -> list:
    """The heuristic of 2026-11-23 (64-key steps, two in flight, the combine as a second launch) at each shape
    where it differs from today's: [(config, shapes)], for A/B rows beside the defaults. At batch 64 paged caches
    took (and take) the narrow program: that row is then the dense caches' former default."""
    from ejkernel_triton.decode.config import TritonDecodeConfig, heuristic_config

    by_config: dict = {}
    for batch, context in shapes:
        splits = heuristic_config(batch * kv_heads, context, 128, jnp.bfloat16).num_splits
        by_config.setdefault(TritonDecodeConfig(block_n=64, num_splits=splits, prefetch=2), []).append((batch, context))
    return list(by_config.items())


def final_sweep_configs() -> list:
    """The few candidates of the final H200 run (NOTES.md, "decode heuristic"), each at the shapes where the
    heuristic's model is least certain: [(config, shapes, layouts)]."""
    from ejkernel_triton.decode.config import TritonDecodeConfig as C

    both = ("paged", "contiguous")
    return [
        (C(block_n=64, num_splits=1, prefetch=2), [(64, 4096)], ("paged",)),  # the former default at B=64 (1.29 waves)
        (C(block_n=32, num_splits=8, prefetch=3), [(8, 4096)], both),  # B=8: 512 narrow programs, 4 per SM
        (C(block_n=64, num_splits=16, prefetch=2), [(8, 4096)], both),  # B=8: 16 splits, as Pallas gqa (2.6 waves)
        (C(block_n=32, num_splits=2, prefetch=3), [(32, 1024)], both),  # one full wave of narrow programs
    ]


def peer_impls() -> list[Impl]:
    impls = []
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

        def gqa(x):
            # heads-major cache: gqa's own swapaxes cancels against ours, so the kernel reads it in place
            return pallas_decode.gqa(x["q"], x["k"].swapaxes(1, 2), x["v"].swapaxes(1, 2))

        impls.append(Impl("jax-pallas-gqa", "heads-major", gqa, note="defaults: k_splits=16, block_k=128"))
    except Exception as exc:  # noqa: BLE001
        print(f"# no JAX Pallas gqa: {exc}", file=sys.stderr)
    try:
        from flash_attn3_jax import flash_mha_with_kvcache

        def fa3(x, num_splits=1):
            q = x["q"][:, None]
            out = flash_mha_with_kvcache(q, x["k"], x["v"], cache_seqlens=x["lens"], page_table=x["tables"],
                                         softmax_scale=float(q.shape[-1] ** -0.5), num_splits=num_splits)
            return out[:, 0]

        impls.append(Impl("flash-attn3 paged", "fa3-paged", fa3, note="best of num_splits"))
    except Exception as exc:  # noqa: BLE001
        print(f"# no flash-attn3-jax: {type(exc).__name__}: {exc}", file=sys.stderr)

    def dense(implementation):
        def fn(x):
            out = jax.nn.dot_product_attention(x["q"][:, None], x["k"], x["v"], implementation=implementation)
            return out[:, 0]

        return fn

    impls.append(Impl("xla-dense", "contiguous", dense("xla"), standard_only=True))
    impls.append(Impl("cudnn-dense", "contiguous", dense("cudnn"), standard_only=True))
    return impls


# ---- timing ------------------------------------------------------------------------------------------


def copy_bandwidth(warmup=3, reps=10) -> float:
    """GB/s of `x + 1` over 4 GiB of float32 (bytes read + written)."""
    x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.float32)
    step = jax.jit(lambda x: x + 1.0)
    secs = time_calls(lambda c: step(x), warmup, reps, 5)
    del x
    return 2 * 4 * (1 << 30) / secs / 1e9


def reference(q, k, v):
    """Float32 attention of q [B, H, D] over contiguous k/v [B, S, Hkv, D]."""
    group = q.shape[1] // k.shape[2]
    qf = q.astype(jnp.float32).reshape(q.shape[0], k.shape[2], group, q.shape[2])
    with jax.default_matmul_precision("highest"):
        logits = jnp.einsum("bkgd,bskd->bkgs", qf, k.astype(jnp.float32)) * q.shape[-1] ** -0.5
        out = jnp.einsum("bkgs,bskd->bkgd", jax.nn.softmax(logits, axis=-1), v.astype(jnp.float32))
    return out.reshape(q.shape)


def time_layers(fn, extra, inputs, layers, args) -> float:
    """Seconds per layer of a step over ``layers`` caches in one executable (a model's layers, each reading its
    own cache): the host dispatches once per ``layers`` steps, as in a served model's forward."""
    groups = [tuple(inputs[(g * layers + i) % len(inputs)] for i in range(layers))
              for g in range(max(1, len(inputs) // layers))]
    step = jax.jit(lambda xs: [fn(x, **extra) for x in xs])
    return time_calls(lambda c: step(groups[c % len(groups)]), args.warmup, args.reps, args.calls) / layers


# ---- the mixed (continuous-batching) batch -----------------------------------------------------------


def matmul_tflops(dtype, n=8192, warmup=3, reps=10) -> float:
    """The device's dense matmul rate in this run: ``jnp.dot`` of two n x n matrices."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(dtype)
    step = jax.jit(jnp.dot)
    secs = time_calls(lambda c: step(a, b), warmup, reps, 5)
    return 2 * n**3 / secs / 1e12


def mixed_sequences(part: str, prefills, prefill_len, decodes, context):
    """[(q_len, kv_len)] of the mixed batch or one of its parts ("mixed", "prefill", "decode")."""
    seqs = []
    if part in ("mixed", "prefill"):
        seqs += [(prefill_len, context)] * prefills
    if part in ("mixed", "decode"):
        seqs += [(1, context)] * decodes
    return seqs


MIXED_ARGUMENTS = ("queries", "kv_pages", "context_lens", "block_tables", "query_start_loc", "num_seqs")
"""ragged_page_attention's positional arrays, in order, as keys of :func:`mixed_inputs`' dict."""


def mixed_inputs(key, sequences, heads, kv_heads, dim, page_size, dtype, seed, kv_dtype=None):
    """ragged_page_attention's inputs (pages shuffled over the cache) and the logical K/V for the reference
    (``kv_dtype``: a quantized cache, its values as stored, with scales of 1 per kv head)."""
    q_lens = np.array([q for q, _ in sequences], np.int32)
    kv_lens = np.array([k for _, k in sequences], np.int32)
    slots, context = len(sequences), int(kv_lens.max())
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v = logical_kv(key, slots, context, kv_heads, dim, dtype)
    if kv_dtype is not None and kv_dtype != dtype:
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    q = jax.random.normal(jax.random.fold_in(key, 7), (int(starts[-1]), heads, dim), jnp.float32).astype(dtype)
    pages = context // page_size
    perm = np.random.default_rng(seed).permutation(slots * pages)
    kv = jnp.stack([k, v], axis=3).reshape(slots * pages, page_size, 2 * kv_heads, dim)  # K/V interleaved
    x = dict(queries=q, kv_pages=kv[jnp.asarray(np.argsort(perm))], context_lens=jnp.asarray(kv_lens),
             block_tables=jnp.asarray(perm.reshape(slots, pages).astype(np.int32)),
             query_start_loc=jnp.asarray(starts), num_seqs=jnp.asarray([slots], jnp.int32))
    if k.dtype != dtype:
        x["key_scale"] = x["value_scale"] = jnp.ones((kv_heads,), jnp.float32)
    return x, (q, k, v, starts, kv_lens)


def mixed_reference(q, k, v, starts, kv_lens):
    """Float32 attention of each sequence's packed queries (its last tokens, causal) over its logical K/V; runs
    of sequences with equal (q_len, kv_len) in one batched einsum."""
    heads, group = q.shape[1], q.shape[1] // k.shape[2]  # query head h reads kv head h // group
    outs, s = [], 0
    with jax.default_matmul_precision("highest"):
        while s < len(kv_lens):
            q_len, kv_len = starts[s + 1] - starts[s], kv_lens[s]
            e = s
            while e < len(kv_lens) and (starts[e + 1] - starts[e], kv_lens[e]) == (q_len, kv_len):
                e += 1
            rows = q[starts[s]:starts[e]].astype(jnp.float32).reshape(e - s, q_len, k.shape[2], group, -1)
            keys, values = k[s:e, :kv_len].astype(jnp.float32), v[s:e, :kv_len].astype(jnp.float32)
            logits = jnp.einsum("bqkgd,bjkd->bkgqj", rows, keys) * q.shape[-1] ** -0.5
            pos = kv_len - q_len + jnp.arange(q_len)
            logits = jnp.where(jnp.arange(kv_len)[None, :] <= pos[:, None], logits, -jnp.inf)
            out = jnp.einsum("bkgqj,bjkd->bqkgd", jax.nn.softmax(logits, axis=-1), values)
            outs.append(out.reshape(-1, heads, q.shape[-1]))
            s = e
    return jnp.concatenate(outs)


def mixed_cost(sequences, heads, kv_heads, dim, itemsize, kv_itemsize=None) -> tuple[float, float]:
    """(bytes, FLOPs) of one step: K+V of every sequence once (``kv_itemsize`` bytes each: a quantized cache),
    queries and outputs; 4·H·D per visible pair."""
    pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in sequences)
    tokens = sum(q for q, _ in sequences)
    kv_bytes = sum(2 * kv * kv_heads * dim * (kv_itemsize or itemsize) for _, kv in sequences)
    return kv_bytes + 2 * tokens * heads * dim * itemsize, 4.0 * heads * dim * pairs


def heuristic_mixed_config(inputs):
    """The Triton heuristic's config of ragged_page_attention for these inputs."""
    from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttention
    from ejkernel_triton.ragged_page_attention import IMPLEMENTATION

    call = RaggedPageAttention().validate(*[inputs[n] for n in MIXED_ARGUMENTS])
    return IMPLEMENTATION.heuristic_config(call)


MIXED_CANDIDATES = {
    # 64-row, 4-warp prefill tiles, two launches
    "m64": dict(fused=False, block_m=64, num_warps=4),
    # one launch: decode programs (64-key steps, two in flight) and 64-row prefill tiles; H200 batch 2: 625 us
    # at pages of 64 (the default there now), 876 at pages of 16
    "fused-m64": dict(fused=True, block_m=64, num_warps=4, decode_block_n=64, decode_prefetch=2),
    "fused-m64-inline": dict(fused=True, block_m=64, num_warps=4, decode_block_n=64, decode_prefetch=2,
                             decode_inline_combine=True),
    # one launch of 3 programs per SM (sm_90 compile: 66.5 KB shared memory, 160 registers; fused-m64: 116 KB,
    # 220 registers, 1-2 per SM): 32-key steps for both parts
    "fused-m64-n32": dict(fused=True, block_m=64, num_warps=4, block_n=32, decode_block_n=32, decode_prefetch=2),
    # the same with decode and prefill programs alternating in the launch (every SM holds both from the start)
    "fused-m64-n32-mix": dict(fused=True, block_m=64, num_warps=4, block_n=32, decode_block_n=32, decode_prefetch=2,
                              interleave=True),
    "fused-m64-mix": dict(fused=True, block_m=64, num_warps=4, decode_block_n=64, decode_prefetch=2, interleave=True),
    # two launches, the 128-row prefill tile with three K/V steps in flight (one program per SM: latency)
    "seq-p3": dict(fused=False, block_m=128, num_warps=8, prefetch=3),
}
"""Schedule candidates of the Triton mixed batch (``--mixed-candidates``): fields replaced in the heuristic's
config (NOTES.md, "mixed batch")."""


def run_mixed(args, H, Hkv, D, dtype, copy_gbps, tflops, rows, save) -> None:
    from ejkernel.modules import ragged_page_attention

    kv_dtype = jnp.dtype(args.kv_dtype or dtype)
    platforms = [p for p in usable_gpu_platforms("ragged_page_attention")
                 if not args.mixed_platforms or p in args.mixed_platforms.split(",")]
    key = jax.random.key(3)
    page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    for part in args.mixed_parts.split(","):
        sequences = mixed_sequences(part, **MIXED)
        nbytes, flops = mixed_cost(sequences, H, Hkv, D, dtype.itemsize, kv_dtype.itemsize)
        t_bytes, t_flops = nbytes / (copy_gbps * 1e9), flops / (tflops * 1e12)
        for ps in page_sizes if part == "mixed" else page_sizes[:1]:  # the parts alone: the first page size
            sets = [mixed_inputs(jax.random.fold_in(key, s), sequences, H, Hkv, D, ps, dtype, seed=s, kv_dtype=kv_dtype)
                    for s in range(2)]
            ref = jax.jit(mixed_reference, static_argnums=(3, 4))(*sets[0][1][:3], tuple(sets[0][1][3].tolist()),
                                                                  tuple(sets[0][1][4].tolist()))
            variants = [(f"ejkernel-{platform} ragged-page", platform, None) for platform in platforms]
            if "triton" in platforms and part == "mixed":
                default = heuristic_mixed_config(sets[0][0])
                for token in filter(None, args.mixed_candidates.split(",")):
                    cand, _, only = token.partition("@")  # name@64: at pages of 64 only
                    if only and int(only) != ps:
                        continue
                    cfg = dataclasses.replace(default, **MIXED_CANDIDATES[cand])
                    if cfg != default:
                        variants.append((f"ejkernel-triton ragged-page[{cand}]", "triton", cfg))
            for name, platform, cfg in variants:
                row = dict(impl=name, part=part, page_size=ps, batch=len(sequences), kv_dtype=str(kv_dtype),
                           context=MIXED["context"], bytes=nbytes, flops=flops, bytes_us=t_bytes * 1e6,
                           flops_us=t_flops * 1e6, binds="bandwidth" if t_bytes >= t_flops else "compute")
                try:
                    step = jax.jit(lambda x, platform=platform, cfg=cfg: ragged_page_attention(
                        *[x[n] for n in MIXED_ARGUMENTS], platform=platform, cfg=cfg, key_scale=x.get("key_scale"),
                        value_scale=x.get("value_scale")))
                    slow = platform == "xla"  # XLA gathers every row's pages: a few samples
                    secs = time_calls(lambda c: step(sets[c % 2][0]), 1 if slow else args.warmup,
                                      3 if slow else args.reps, 1 if slow else args.calls)
                    row.update(ms=secs * 1e3, roofline_share=max(t_bytes, t_flops) / secs,
                               gbps=nbytes / secs / 1e9, tflops=flops / secs / 1e12,
                               rel_err=relative_error(step(sets[0][0]), ref))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = failure(exc)
                rows.append(row)
                save()
                shown = (f"{row['ms'] * 1e3:8.1f} us = {100 * row['roofline_share']:3.0f} % of the {row['binds']} "
                         f"roofline ({row['bytes_us']:.0f} us bytes, {row['flops_us']:.0f} us FLOPs), "
                         f"{row['gbps']:.0f} GB/s, {row['tflops']:.0f} TFLOP/s, err {row['rel_err']:.1e}"
                         if "ms" in row else row["error"])
                print(f"mixed {part:7s} p{ps:<3d} {row['impl']:28s} {shown}", flush=True)
            del sets, ref


# ---- reporting ---------------------------------------------------------------------------------------


def series(row) -> str:
    return row["impl"] + (f" p{row['page_size']}" if row.get("page_size") else "")


def markdown_table(doc, key: str = "gbps") -> str:
    """Defaults of every implementation, GB/s of ``key`` (``gbps``: one call per step; ``gbps_layersN``: per
    layer of N in one executable) and share of the copy bandwidth."""
    rows = [r for r in doc["results"] if key in r and "[" not in r["impl"] and "part" not in r]
    names = []
    for r in rows:
        if series(r) not in names:
            names.append(series(r))
    copy = doc["copy_gbps"]
    lines = ["| B | context | " + " | ".join(names) + " |", "|" + "---|" * (2 + len(names))]
    for batch, context in doc["setup"]["shapes"]:
        cells = []
        for name in names:
            hit = [r for r in rows if (r["batch"], r["context"], series(r)) == (batch, context, name)]
            cells.append(f"{hit[0][key]:.0f} ({100 * hit[0][key] / copy:.0f} %)" if hit else "—")
        lines.append(f"| {batch} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cache_note(doc) -> str:
    """``, float8_e4m3fn cache`` when the run's caches were quantized."""
    kv_dtype = doc["setup"].get("kv_dtype", doc["setup"]["dtype"])
    return "" if kv_dtype == doc["setup"]["dtype"] else f", {kv_dtype} cache"


def print_report(doc) -> None:
    setup = doc["setup"]
    print(f"## {doc['device']}, {doc['date'][:10]}: decode GB/s (share of copy bandwidth {doc['copy_gbps']:.0f} GB/s); "
          f"{setup['heads']}/{setup['kv_heads']} heads, D={setup['head_dim']}, {setup['dtype']}{cache_note(doc)}")
    print(markdown_table(doc))
    layer_keys = sorted({k for r in doc["results"] for k in r if k.startswith("gbps_layers")})
    for key in layer_keys:
        print(f"\n## per layer, {key[len('gbps_layers'):]} layers in one executable (GB/s, share of copy)")
        print(markdown_table(doc, key))
    sweep = [r for r in doc["results"] if "[" in r["impl"] and "gbps" in r]
    if sweep:
        print("\n## config sweep (GB/s; per layer in brackets)")
        for r in sorted(sweep, key=lambda r: (r["batch"], r["context"], series(r).split("[")[0], -r["gbps"])):
            layered = " ".join(f"[{r[k]:.0f}]" for k in layer_keys if k in r)
            print(f"B={r['batch']:3d} ctx={r['context']:6d} {series(r):70s} {r['gbps']:7.0f} {layered} "
                  f"err {r.get('rel_err', float('nan')):.1e}")
    mixed = [r for r in doc["results"] if "part" in r and "ms" in r]
    if mixed:
        print(f"\n## ragged_page_attention, mixed batch {MIXED} (matmul rate {doc.get('matmul_tflops', 0):.0f} "
              "TFLOP/s, copy bandwidth as above)")
        print("| part | pages | impl | us | bytes ceiling us | FLOPs ceiling us | binds | share of roofline |")
        print("|---|---|---|---|---|---|---|---|")
        for r in mixed:
            print(f"| {r['part']} | {r['page_size']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['bytes_us']:.1f} | "
                  f"{r['flops_us']:.1f} | {r['binds']} | {100 * r['roofline_share']:.0f} % |")
    errors = [r for r in doc["results"] if "error" in r]
    for r in errors:
        print(f"ERROR {series(r)} B={r['batch']} ctx={r['context']}: {r['error']}")


def plot_mixed(ax, rows) -> None:
    """The mixed batch and its parts: time per implementation (bars) and the binding ceiling (line) per part."""
    parts = list(dict.fromkeys((r["part"], r["page_size"]) for r in rows))
    impls = sorted({r["impl"] for r in rows})
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        times = [next((r["ms"] * 1e3 for r in rows if (r["part"], r["page_size"]) == part and r["impl"] == impl), 0)
                 for part in parts]
        ax.bar([x + i * width for x in range(len(parts))], times, width, label=impl)
    for x, part in enumerate(parts):
        row = next(r for r in rows if (r["part"], r["page_size"]) == part)
        ceiling = max(row["bytes_us"], row["flops_us"])
        ax.hlines(ceiling, x - width / 2, x + 0.8 - width / 2, colors="k", lw=1.5)
        ax.text(x + 0.4 - width / 2, ceiling, f"{row['binds']} ceiling", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(parts))])
    ax.set_xticklabels([f"{part} p{ps}" for part, ps in parts])
    ax.set_ylabel("us per step (lower is better)")
    ax.set_title(f"ragged_page_attention: mixed batch {MIXED}", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the layered timing when the run has one (per call, small steps measure the host's dispatch), else per call
    layered = sorted({k for r in doc["results"] for k in r if k.startswith("gbps_layers")},
                     key=lambda k: int(k[len("gbps_layers"):]))
    key = layered[-1] if layered else "gbps"
    rows = [r for r in doc["results"] if key in r and "[" not in r["impl"] and "part" not in r]
    mixed = [r for r in doc["results"] if "part" in r and "ms" in r and "[" not in r["impl"]]
    fig, axes = plt.subplots(1, 3 if mixed else 2, figsize=(19 if mixed else 13, 4.6))
    if mixed:
        plot_mixed(axes[2], mixed)
    batch0, context0 = doc["setup"].get("standard", STANDARD)
    for ax, (fixed, vary, value) in zip(axes, (("batch", "context", batch0), ("context", "batch", context0))):
        names = sorted({series(r) for r in rows})
        for name in names:
            pts = sorted((r[vary], r[key]) for r in rows if series(r) == name and r[fixed] == value)
            if pts:  # one shape alone is a point
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(doc["copy_gbps"], color="k", ls="--", lw=1, label="copy bandwidth")
        ax.axhline(0.85 * doc["copy_gbps"], color="gray", ls=":", lw=1, label="85 % of copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(vary)
        ax.set_ylabel("GB/s (K+V bytes / step time)" if key == "gbps" else
                      f"GB/s per layer ({key[len('gbps_layers'):]} layers per executable)")
        ax.set_title(f"{fixed} = {value}", fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    setup, software = doc["setup"], doc["versions"]
    fig.suptitle(f"decode attention, {setup['heads']}/{setup['kv_heads']} heads, D={setup['head_dim']},"
                 f" {setup['dtype']}{cache_note(doc)} — {doc['device']}, {doc['date'][:10]} "
                 f"(jax {software.get('jax')}, triton {software.get('triton')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.94))
    fig.savefig(path, dpi=110)


# ---- main --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BATCHxCONTEXT")
    p.add_argument("--standard", default="32x4096", help="the shape that also runs the config sweep and slow peers")
    p.add_argument("--page-sizes", default="16,64")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default="", help="the caches' dtype when quantized (float8_e4m3fn, float8_e5m2, "
                   "int8): ejkernel's page_attention and the mixed batch (ragged_page_attention) only, GB/s of the "
                   "stored bytes, scales of 1 per kv head")
    p.add_argument("--impls", default="", help="comma-separated name prefixes to keep")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sweep-layouts", default="paged,contiguous", help="paged (page_attention), contiguous (ragged)")
    p.add_argument("--sweep-page-sizes", default="", type=lambda t: [int(x) for x in t.split(",") if x],
                   help="page sizes of the sweep rows (default: --page-sizes)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rotate-bytes", type=float, default=256e6, help="input sets rotated through: this many bytes")
    p.add_argument("--error-max-bytes", type=float, default=2e9, help="largest K+V checked against the reference")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--name", default="", help="result file stem (default <gpu>-<date>-decode)")
    p.add_argument("--replot", default="")
    p.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                   help="ragged_page_attention on the mixed prefill + decode batch")
    p.add_argument("--mixed-platforms", default="", help="comma-separated platforms for --mixed (default: all)")
    p.add_argument("--mixed-candidates", default="m64,fused-m64,fused-m64-n32,fused-m64-n32-mix,fused-m64-mix,seq-p3",
                   help=f"Triton schedule candidates on the mixed batch, of {','.join(MIXED_CANDIDATES)} (name@64: "
                        "at pages of 64 only)")
    p.add_argument("--mixed-parts", default="mixed,prefill,decode", help="the mixed batch and/or its parts alone")
    p.add_argument("--layers", default="1,16", type=lambda t: [int(x) for x in t.split(",") if x],
                   help="comma-separated layer counts: a timed call runs the step over that many caches (a "
                        "model's layers, each with its own cache) in one executable; time per layer. 1: one "
                        "dispatched call per step (host dispatch included)")
    p.add_argument("--layers-max-bytes", type=float, default=16e9,
                   help="layered timing only where the layers' caches together hold at most this many bytes")
    p.add_argument("--sweep-shapes", default="", help="BATCHxCONTEXT list: the config sweep at each (default: "
                   "--standard)")
    p.add_argument("--sweep-set", default="schedule", choices=("schedule", "former"),
                   help="the sweep's configs: schedule candidates (sweep_configs), or the former heuristic's "
                        "default at each sweep shape (former_default_configs)")
    p.add_argument("--final", action="store_true",
                   help="the short final run: the decode defaults at --shapes, then the mixed batch, then the few "
                        "candidates of final_sweep_configs (instead of the standard shape's sweep)")
    args = p.parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        plot(doc, Path(args.replot).with_suffix(".png"))
        print_report(doc)
        return 0

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    now = dt.datetime.now(dt.timezone.utc)
    stem = args.name or f"{'-'.join(kind.lower().split()[:2])}-{now:%Y-%m-%d}-decode"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    standard_shape = tuple(int(v) for v in args.standard.split("x"))
    page_sizes = [int(s) for s in args.page_sizes.split(",") if s]
    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.dtype(args.kv_dtype or args.dtype)
    quantized = kv_dtype != dtype  # a quantized cache: ejkernel's page_attention only (scales per kv head)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    sweep_shapes = [tuple(int(v) for v in t.split("x")) for t in args.sweep_shapes.split(",") if t] or [standard_shape]
    if not args.sweep:
        sweep = []
    elif args.final:
        sweep = final_sweep_configs()
    elif args.sweep_set == "former":
        sweep = former_default_configs(sweep_shapes, Hkv)
    else:
        sweep = merged_sweep(sweep_shapes, Hkv)
    impls = ejkernel_impls(sweep, tuple(args.sweep_layouts.split(","))) + peer_impls()
    if args.impls:
        impls = [i for i in impls if any(i.name.startswith(s) for s in args.impls.split(","))]
    print(f"# {kind}, {now:%Y-%m-%d %H:%M} UTC: {', '.join(i.name for i in impls if '[' not in i.name)}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_gbps = copy_bandwidth()
    print(f"# copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    tflops = matmul_tflops(dtype) if args.mixed else None
    if tflops:
        print(f"# {dtype} matmul (8192^3): {tflops:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []

    def document():
        return dict(device=kind, date=now.isoformat(timespec="seconds"), versions=versions(), copy_gbps=copy_gbps,
                    matmul_tflops=tflops,
                    setup=dict(shapes=shapes, standard=standard_shape, page_sizes=page_sizes, heads=H, kv_heads=Hkv,
                               head_dim=D, dtype=str(dtype), kv_dtype=str(kv_dtype), warmup=args.warmup, reps=args.reps,
                               calls=args.calls,
                               timing="median of reps; each rep = mean of back-to-back calls ended by "
                                      "block_until_ready",
                               gbps="K+V bytes read (2*B*ctx*Hkv*D*itemsize) / time",
                               copy="x + 1 over 4 GiB float32, read + write"),
                    implementations=[i.name for i in impls], results=rows)

    def save():
        (out_dir / f"{stem}.json").write_text(json.dumps(document(), indent=1))

    if args.mixed and not args.final:  # first: the ragged target, before the long decode sweep
        run_mixed(args, H, Hkv, D, dtype, copy_gbps, tflops, rows, save)
    key = jax.random.key(0)
    mixed_done = False
    # every implementation's default at every shape first, then the Triton sweep at the standard shape (a run cut
    # off by a time limit keeps the comparisons)
    for sweep_pass, (batch, context) in [(p, shape) for p in (False, True) for shape in shapes]:
        if sweep_pass and args.final and args.mixed and not mixed_done:
            # the final run: the mixed batch between the defaults and the candidates
            mixed_done = True
            run_mixed(args, H, Hkv, D, dtype, copy_gbps, tflops, rows, save)
        standard = (batch, context) == standard_shape
        if sweep_pass and not any((batch, context) in i.sweep_shapes for i in impls):
            continue
        kv_bytes = 2 * batch * context * Hkv * D * kv_dtype.itemsize
        layer_counts = [n for n in args.layers if n > 1 and n * kv_bytes <= args.layers_max_bytes]
        sets = max(1, min(16, math.ceil(args.rotate_bytes / kv_bytes)), *layer_counts)
        key, sub = jax.random.split(key)
        logical = [logical_kv(jax.random.fold_in(sub, s), batch, context, Hkv, D, dtype) for s in range(sets)]
        if quantized:  # the cache as stored (one scale per kv head: the kernels' scale path, values unchanged)
            logical = [(k.astype(kv_dtype), v.astype(kv_dtype)) for k, v in logical]
        queries = [jax.random.normal(jax.random.fold_in(sub, 100 + s), (batch, H, D), jnp.float32).astype(dtype)
                   for s in range(sets)]
        ref = None
        if kv_bytes <= args.error_max_bytes:
            ref = jax.jit(reference)(queries[0], *logical[0])
        groups = []
        for layout in ("paged", "fa3-paged", "contiguous", "heads-major"):
            for ps in page_sizes if "paged" in layout else [None]:
                groups.append((layout, ps))
        for layout, ps in groups:
            if sweep_pass and ps is not None and args.sweep_page_sizes and ps not in args.sweep_page_sizes:
                continue
            chosen = [i for i in impls if i.layout == layout and (standard or not i.standard_only)
                      and (not quantized or (i.name.startswith("ejkernel-") and layout == "paged"))
                      and (((batch, context) in i.sweep_shapes) if sweep_pass else not i.sweep_shapes)]
            if not chosen:
                continue
            inputs = [dict(q=q, **layout_inputs(layout, k, v, ps, seed=s))
                      for s, (q, (k, v)) in enumerate(zip(queries, logical))]
            if quantized:
                inputs = [dict(x, scale=jnp.ones((Hkv,), jnp.float32)) for x in inputs]
            for impl in chosen:
                row = dict(impl=impl.name, layout=layout, page_size=ps, batch=batch, context=context, sets=sets)
                try:
                    variants = [dict()]
                    if impl.layout == "fa3-paged":  # generous to the peer: its best split count
                        from ejkernel_triton.decode.config import heuristic_config

                        ours = heuristic_config(batch * Hkv, context, D, dtype).num_splits
                        variants = [dict(num_splits=n) for n in sorted({1, ours})]
                    best = None
                    for extra in variants:
                        step = jax.jit(lambda x, extra=extra, impl=impl: impl.fn(x, **extra))
                        secs = time_calls(lambda c: step(inputs[c % len(inputs)]), args.warmup, args.reps, args.calls)
                        if best is None or secs < best[0]:
                            best = (secs, extra, step)
                    secs, extra, step = best
                    row.update(ms=secs * 1e3, gbps=kv_bytes / secs / 1e9, share=kv_bytes / secs / 1e9 / copy_gbps,
                               **extra)
                    for layers in layer_counts:
                        secs = time_layers(impl.fn, extra, inputs, layers, args)
                        row[f"gbps_layers{layers}"] = kv_bytes / secs / 1e9
                    if ref is not None:
                        row["rel_err"] = relative_error(step(inputs[0]), ref)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = failure(exc)
                rows.append(row)
                save()
                shown = (f"{row['gbps']:7.0f} GB/s ({100 * row['share']:3.0f} %) {row['ms']:8.4f} ms "
                         f"err {row.get('rel_err', float('nan')):.1e}" if "gbps" in row else row["error"])
                shown += "".join(f"  [{k[5:]}: {v:.0f} GB/s = {100 * v / copy_gbps:.0f} %]" for k, v in row.items()
                                 if k.startswith("gbps_layers"))
                print(f"B={batch:3d} ctx={context:6d} {impl.name + (f' p{ps}' if ps else ''):62s} {shown}", flush=True)
            del inputs
        del logical, queries, ref
    if args.final and args.mixed and not mixed_done:
        run_mixed(args, H, Hkv, D, dtype, copy_gbps, tflops, rows, save)

    save()
    doc = document()
    try:
        plot(doc, out_dir / f"{stem}.png")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print()
    print_report(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
