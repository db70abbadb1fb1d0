"""Where the time of a small decode step goes: per-layer time of 16 layers in one executable (as
``benchmarks/decode.py --layers 16``) beside the kernels' own durations under Nsight Compute.

    python3 benchmarks/experiments/decode_small_batch.py --time            # per-layer times, JSON lines
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/experiments/decode_small_batch.py --profile      # 2 layers, kernel durations

Batch 1 (and 8), 4096 cached tokens (``--contexts``), 32 query / 8 kv heads, D=128, bf16, pages of 16 and 64;
ours (Triton: the heuristic and ``--splits`` split counts, with and without the inline combine; ragged decode
over the same keys) against flash-attn3-jax (num_splits 1, 8, 16). Inputs are built on the host (numpy), so
that the only kernels under the profiler are the step's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import time_calls  # noqa: E402

H, HKV, D = 32, 8, 128


def inputs(batch, context, page_size, layers, seed=0, kv_dtype=jnp.bfloat16):
    """Per layer: the query, one logical cache in both paged layouts (ours [pages, Hkv, page, D], FA3's
    [pages, page, Hkv, D], pages shuffled) and contiguous ([B, S, Hkv, D]) for ragged decode; ``kv_dtype``: the
    caches' (a quantized one has no scales: the kernels' conversions, not their scale loads)."""
    rng = np.random.default_rng(seed)
    pages = batch * context // page_size
    layer_bytes = 2 * pages * page_size * HKV * D * 2
    distinct = max(2, min(layers, -(-(256 << 20) // layer_bytes)))  # 256 MB of caches: 5 x the L2
    out = []
    for _ in range(distinct):
        k = rng.standard_normal((pages, page_size, HKV, D), np.float32)
        v = rng.standard_normal((pages, page_size, HKV, D), np.float32)
        tables = rng.permutation(pages).reshape(batch, context // page_size).astype(np.int32)
        q = rng.standard_normal((batch, H, D), np.float32)
        cache = lambda x: jnp.asarray(x, jnp.bfloat16).astype(kv_dtype)  # noqa: E731
        out.append(dict(q=jnp.asarray(q, jnp.bfloat16), lens=jnp.full((batch,), context, jnp.int32),
                        tables=jnp.asarray(tables), k_fa3=cache(k), v_fa3=cache(v), k=cache(k.transpose(0, 2, 1, 3)),
                        v=cache(v.transpose(0, 2, 1, 3)), k_dense=cache(k[tables].reshape(batch, context, HKV, D)),
                        v_dense=cache(v[tables].reshape(batch, context, HKV, D))))
    return [out[i % distinct] for i in range(layers)]


def impls(split_counts=(4, 8, 32), both_combines=True, configs=()):
    from ejkernel.modules import page_attention, ragged_decode_attention
    from ejkernel_triton.decode import TritonDecodeConfig

    def ours(cfg=None):
        return lambda x: page_attention(x["q"], x["k"], x["v"], x["lens"], x["tables"], platform="triton", cfg=cfg)

    def ragged(cfg=None):
        return lambda x: ragged_decode_attention(x["q"], x["k_dense"], x["v_dense"], jnp.zeros_like(x["lens"]),
                                                 x["lens"], platform="triton", cfg=cfg)

    table = {"ours": ours(), "ragged": ragged()}
    for splits in split_counts:
        for inline in (True, False) if both_combines else (True,):
            cfg = TritonDecodeConfig(block_n=64, num_splits=splits, prefetch=2, inline_combine=inline)
            table[f"ours-s{splits}{'-inline' if inline else ''}"] = ours(cfg)
            table[f"ragged-s{splits}{'-inline' if inline else ''}"] = ragged(cfg)
    try:
        from flash_attn3_jax import flash_mha_with_kvcache

        for splits in (1, 8, 16):
            table[f"fa3-s{splits}"] = lambda x, s=splits: flash_mha_with_kvcache(
                x["q"][:, None], x["k_fa3"], x["v_fa3"], cache_seqlens=x["lens"], page_table=x["tables"],
                softmax_scale=D ** -0.5, num_splits=s)[:, 0]
    except ImportError as error:
        print(f"# no flash-attn3-jax: {error}", file=sys.stderr)
    for text in configs:  # "block_n=32,prefetch=3,num_splits=2": paged and ragged rows of that config
        cfg = TritonDecodeConfig(**{k: (v == "True") if v in ("True", "False") else int(v)
                                    for k, v in (item.split("=") for item in text.split(","))})
        table[f"ours[{text}]"] = ours(cfg)
        table[f"ragged[{text}]"] = ragged(cfg)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="2 layers, 2 calls per implementation (under ncu)")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--only", default="", help="comma-separated implementation names")
    parser.add_argument("--kv-dtype", default="bfloat16", help="the caches' dtype (float8_e4m3fn, int8: quantized)")
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--splits", default="4,8,32", help="split counts of the config rows (with the heuristic's)")
    parser.add_argument("--inline-only", action="store_true", help="config rows with the inline combine only")
    parser.add_argument("--config", action="append", default=[], help="a TritonDecodeConfig row, e.g. "
                        "block_n=32,prefetch=3,num_splits=2 (repeatable)")
    args = parser.parse_args()
    only = [n for n in re.split(r",(?![^\[]*\])", args.only) if n]  # commas inside "ours[...]" names stay
    table = impls(tuple(int(x) for x in args.splits.split(",") if x), not args.inline_only, args.config)
    shapes = itertools.product(*(map(int, text.split(",")) for text in (args.contexts, args.batches, args.page_sizes)))
    for context, batch, page_size in shapes:
        layers = 2 if args.profile else 16
        xs = inputs(batch, context, page_size, layers * (1 if args.profile else 2), kv_dtype=jnp.dtype(args.kv_dtype))
        for name, fn in table.items():
            if name.startswith("ragged") and page_size != int(args.page_sizes.split(",")[0]):
                continue  # the contiguous cache does not depend on the page size
            if only and name not in only:
                continue
            step = jax.jit(lambda group, fn=fn: [fn(x) for x in group])
            groups = [xs[:layers], xs[layers:]] if not args.profile else [xs]
            try:
                if args.profile:
                    jax.block_until_ready(step(groups[0]))  # the profiler sees the compile's call too
                    jax.block_until_ready(step(groups[0]))
                    print(f"# profiled {name} batch={batch} page={page_size}", flush=True)
                    continue
                seconds = time_calls(lambda c: step(groups[c % 2]), 5, 20, 5) / layers
            except Exception as error:  # noqa: BLE001
                print(f"# {name}: {type(error).__name__}: {str(error)[:200]}")
                continue
            nbytes = 2 * batch * context * HKV * D * jnp.dtype(args.kv_dtype).itemsize
            print(json.dumps(dict(impl=name, batch=batch, context=context, page_size=page_size,
                                  us_per_layer=seconds * 1e6,
                                  gbps=nbytes / seconds / 1e9)), flush=True)


if __name__ == "__main__":
    main()
