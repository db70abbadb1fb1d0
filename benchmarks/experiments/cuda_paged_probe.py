"""The mixed batch of ``decode.py`` (``MIXED``: 4 chunks of 512 new tokens and 60 decode rows over 4096-token
contexts, 32 q / 8 kv heads, D = 128, bf16, pages of 64 shuffled over the cache) and its two parts on
ejkernel-cuda's paged forward at several schedules (``CudaPagedConfig.packed_share``), beside the Triton path
and, for the prefill part, the dense native forward on contiguous K/V (the same work without pages), in one
process.

    python3 benchmarks/experiments/cuda_paged_probe.py [--shares 3,4,5,6] [--parts prefill,decode,mixed]
    (--parts long-decodes: two decode rows over 32k-token contexts; decodes-8x1024: 8 rows over 1024 tokens)
    [--soft-cap 50] [--window 1024] [--sinks 1] [--heads 64 --kv-heads 8 --head-dim 64]: the optional features
    and other head shapes (gpt-oss: --heads 64 --kv-heads 8 --head-dim 64 --sinks 1 --window 128)

Prints one JSON line per measurement (microseconds; TFLOP/s of the causal pairs, GB/s of K/V read once);
``--out PREFIX`` also writes them with the device, date and versions to PREFIX.json and plots Triton's time over
the first CUDA schedule's per part to PREFIX.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import time_calls, versions  # noqa: E402
from decode import MIXED, MIXED_ARGUMENTS, mixed_cost, mixed_inputs, mixed_sequences  # noqa: E402


def decode_rows(part: str) -> list[tuple[int, int]]:
    """[(q_len, kv_len)] of an all-decode batch: "long-decodes" (two rows over 32k tokens: 16 packed tiles, the
    case split-K is for) or "decodes-BxC" (B rows over C tokens); [] for the other parts."""
    if part == "long-decodes":
        return [(1, 32768)] * 2
    if part.startswith("decodes-"):
        batch, context = part.removeprefix("decodes-").split("x")
        return [(1, int(context))] * int(batch)
    return []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shares", default="3,4,5,6")
    p.add_argument("--parts", default="prefill,decode,mixed")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--impls", default="cuda,triton", help="name prefixes to run (cuda, triton, cuda-dense)")
    p.add_argument("--out", default="", help="PREFIX: write PREFIX.json and PREFIX.png too")
    p.add_argument("--soft-cap", type=float, default=None, help="logits_soft_cap of every call")
    p.add_argument("--window", type=int, default=None, help="sliding_window of every call")
    p.add_argument("--sinks", type=int, default=0, help="attention sinks per query head (softmax_aux; 0: none)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=1,
                   help="N > 1: N calls, each on its own cache (a model's layers), in one executable; time per "
                        "call (below ~100 us a single dispatched call times the host, not the kernel)")
    args = p.parse_args()
    os.environ.setdefault("EJKERNEL_UNVERIFIED_KERNELS", "1")
    from ejkernel.modules import ragged_page_attention
    from ejkernel_cuda import native_flash
    from ejkernel_cuda.ragged_page_attention import CudaPagedConfig

    heads, kv_heads, d = args.heads, args.kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    features = {k: v for k, v in dict(logits_soft_cap=args.soft_cap, sliding_window=args.window).items()
                if v is not None}
    # sinks of the scores' size, deterministic
    sinks = (jnp.linspace(-1.0, 1.0, heads * args.sinks, dtype=jnp.float32).reshape(heads, args.sinks)
             if args.sinks else None)
    rows = []
    for part in args.parts.split(","):
        sequences = decode_rows(part) or mixed_sequences(part, **MIXED)
        nbytes, flops = mixed_cost(sequences, heads, kv_heads, d, 2, 2)  # of the whole causal context
        layers = args.layers if args.layers > 1 and nbytes * args.layers <= 16e9 else 1
        sets = [mixed_inputs(jax.random.key(i), sequences, heads, kv_heads, d, args.page_size, jnp.bfloat16, i)
                for i in range(max(2, layers))]
        impls = {f"cuda[share={share}]": (lambda x, share=int(share): ragged_page_attention(
            *(x[n] for n in MIXED_ARGUMENTS), sinks, softmax_scale=scale, platform="cuda",
            cfg=CudaPagedConfig(packed_share=share), **features), [x for x, _ in sets])
            for share in args.shares.split(",")}
        impls["triton"] = (lambda x: ragged_page_attention(*(x[n] for n in MIXED_ARGUMENTS), sinks, softmax_scale=scale,
                                                           platform="triton", **features), [x for x, _ in sets])
        if part == "prefill" and not features and sinks is None:
            new, seqs = MIXED["prefill_len"], MIXED["prefills"]
            impls["cuda-dense"] = (lambda x: native_flash.attention(x[0], x[1], x[2], scale, True, None, None),
                                   [(q.reshape(seqs, new, heads, d), k, v) for _, (q, k, v, _, _) in sets])
        for name, (fn, inputs) in impls.items():
            if not name.startswith(tuple(args.impls.split(","))):
                continue
            if layers > 1:  # one executable over `layers` caches, time per call
                step = jax.jit(lambda xs, fn=fn: [fn(x) for x in xs])
                seconds = time_calls(lambda c: step(inputs[:layers]), 3, args.reps, 5) / layers
            else:
                step = jax.jit(fn)
                seconds = time_calls(lambda c: step(inputs[c % len(inputs)]), 3, args.reps, 5)
            row = dict(part=part, impl=name, layers=layers, us=seconds * 1e6, tflops=flops / seconds / 1e12,
                       gbps=nbytes / seconds / 1e9)
            if args.window is not None:  # the window leaves less work than the whole context: no rates
                row.update(tflops=None, gbps=None)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets
    if args.out:
        described = [f"{heads} q / {kv_heads} kv heads, D = {d}", *(f"{k} {v}" for k, v in features.items())]
        if args.sinks:
            described.append(f"{args.sinks} sinks per head")
        report(args.out, rows, args.page_size, shape=", ".join(described))


def report(prefix: str, rows: list[dict], page_size: int, device: str = "", date: str = "",
           software: str = "", shape: str = "32 q / 8 kv heads, D = 128") -> None:
    """The rows with the device, date and versions (PREFIX.json), and Triton's time over the first CUDA
    schedule's per part (PREFIX.png). device / date / software: those of the run when the rows come from a log
    (default: this process's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = device or jax.devices()[0].device_kind
    date = date or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    software = software or ", ".join(f"{name} {version}" for name, version in versions().items())
    setup = f"{shape}, bfloat16, pages of {page_size} shuffled over the cache"
    Path(f"{prefix}.json").write_text(json.dumps(
        dict(device=device, date=date, versions=software, setup=setup, mixed=MIXED, rows=rows), indent=1))
    parts = list(dict.fromkeys(r["part"] for r in rows))
    pairs = []
    for part in parts:
        cuda = next((r["us"] for r in rows if r["part"] == part and r["impl"].startswith("cuda[")), None)
        triton = next((r["us"] for r in rows if r["part"] == part and r["impl"] == "triton"), None)
        if cuda and triton:
            pairs.append((part, cuda, triton))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(range(len(pairs)), [t / c for _, c, t in pairs], 0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    for i, (_, c, t) in enumerate(pairs):
        ax.text(i, t / c + 0.05, f"{c:.0f} / {t:.0f} us", ha="center", fontsize=6, rotation=90)
    ax.set_xticks(range(len(pairs)))
    ax.set_xticklabels([p for p, _, _ in pairs], rotation=35, ha="right", fontsize=7)
    ax.set_ylim(0, max([t / c for _, c, t in pairs], default=1) * 1.25)
    ax.set_ylabel("Triton time / CUDA time")
    ax.set_title(f"ragged_page_attention, ejkernel-cuda vs ejkernel-triton: {device}, {date}\n{setup}; "
                 f"labels: cuda / triton\n{software}", fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}.png", dpi=110)


if __name__ == "__main__":
    main()
