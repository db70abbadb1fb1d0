"""Where the block-sparse forward's time goes: each GPU kernel of one call, under Nsight Compute.

Runs a few jitted calls of each variant (S=16k, 16 heads, D=128, bf16, 128-blocks, 10 % per-head random
mask, non-causal: `benchmarks/blocksparse.py`'s shape), each variant preceded by one launch of a tiny
Triton kernel named `variant_marker`, so that a kernel list from

    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/experiments/blocksparse_kernel_times.py

can be cut per variant: the XLA kernels that build the schedule, the Triton / Pallas kernel itself, and
what the benchmark's wall-clock median adds on top. `--summarize <ncu csv>` prints per-variant sums.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("triton", "triton:pointer-64x64-w4s3", "triton:tma-persistent-128x128-w4s2", "pallas", "flash")


def run(calls: int) -> None:
    import jax
    import jax.numpy as jnp
    import jax_triton as jt
    import triton
    import triton.language as tl

    @triton.jit
    def variant_marker(x_ptr, o_ptr):
        offs = tl.arange(0, 16)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    marker = jax.jit(lambda x: jt.triton_call(x, kernel=variant_marker, out_shape=x, grid=(1,)))

    from blocksparse import block_mask, make_step, random_inputs

    q, k, v, _ = random_inputs(0, 1, 16384, 16, 128, jnp.bfloat16, 1)[0]
    mask = jnp.asarray(block_mask(0, 16, 16384, 0.1))
    for name in VARIANTS:
        step = make_step(name, "fwd")
        jax.block_until_ready(step(q, k, v, mask))  # compile outside the marked calls
        jax.block_until_ready(marker(jnp.zeros((16,), jnp.float32)))
        for _ in range(calls):
            jax.block_until_ready(step(q, k, v, mask))
        print("ran", name, flush=True)


def summarize(path: str) -> None:
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    name_col, metric_col, value_col = header.index("Kernel Name"), header.index("Metric Name"), header.index("Metric Value")
    kernels = [(r[name_col], float(r[value_col].replace(",", ""))) for r in rows if r[metric_col] == "gpu__time_duration.sum"]
    variant, per = None, defaultdict(lambda: defaultdict(list))
    names = iter(VARIANTS)
    for kname, ns in kernels:
        if "variant_marker" in kname:
            variant = next(names, variant)
            continue
        if variant:
            per[variant][kname].append(ns)
    for name, kerns in per.items():
        total = 0.0
        print(f"== {name}")
        for kname, times in sorted(kerns.items(), key=lambda kv: -sum(kv[1])):
            mean = sum(times) / len(times)
            total += mean
            print(f"  {mean / 1e3:9.1f} us  x{len(times):<3} {kname[:90]}")
        print(f"  {total / 1e3:9.1f} us per call (sum of mean kernel times)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--summarize")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.calls)
