"""Where a step's time goes: each GPU kernel of a few calls, under Nsight Compute.

Runs a few jitted calls of each variant of a case, each variant preceded by one launch of a tiny Triton
kernel named `variant_marker`, so that a kernel list from

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/experiments/kernel_times.py --case blocksparse > ncu.csv
    python3 benchmarks/experiments/kernel_times.py --case blocksparse --summarize ncu.csv

can be cut per variant (mean time of each kernel, and their sum per call: what the wall-clock median of the
benchmark adds on top is launch gaps and host time). Cases: `blocksparse` (S=16k, 16 heads, D=128, bf16,
128-blocks, 10 % per-head random mask, non-causal: `benchmarks/blocksparse.py`'s shape; Triton default and
candidates, Pallas, dense flash), `gla`, `lightning`, `recurrent` (`benchmarks/linear_attention.py`'s shape, B=4
H=8 K=V=128 bf16, Triton forward and forward+backward at T=4k and 16k; ``--only fwd-16384`` keeps one of them),
`flash` (forward+backward of the native CUDA kernels and flash-attn3-jax at the standard shapes: 16k tokens,
16 heads, D=128, bf16; S=2k causal and S=8k), `flash-shapes` (the same at S = 2k, 8k and 16k, causal and not).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {
    "blocksparse": ("triton", "triton:pointer-64x64-w4s3", "triton:tma-persistent-128x128-w4s2", "pallas", "flash"),
    "gla": ("fwd-4096", "fwd+bwd-4096", "fwd-16384", "fwd+bwd-16384"),
}
CASES["lightning"] = CASES["recurrent"] = CASES["gla"]
CASES["flash"] = ("native-2048-causal", "fa3-2048-causal", "native-8192", "fa3-8192")
CASES["flash-shapes"] = tuple(f"{impl}-{seq}{causal}" for seq in (2048, 8192, 16384) for causal in ("", "-causal")
                              for impl in ("native", "fa3"))
CASES["flash-softcap"] = ("native-2048-causal-softcap", "native-8192-softcap")  # logits soft cap 30: ours only


def blocksparse_steps():
    import jax.numpy as jnp

    from blocksparse import block_mask, make_step, random_inputs

    q, k, v, _ = random_inputs(0, 1, 16384, 16, 128, jnp.bfloat16, 1)[0]
    mask = jnp.asarray(block_mask(0, 16, 16384, 0.1))
    for name in CASES["blocksparse"]:
        step = make_step(name, "fwd")
        yield name, lambda step=step: step(q, k, v, mask)


def linear_steps(op):
    import jax

    from linear_attention import SHAPE, ejkernel_steps, jax_inputs

    fwd, fwd_bwd = ejkernel_steps(op, "triton")
    for name in CASES[op]:
        mode, total = name.rsplit("-", 1)
        inputs = jax_inputs(jax.random.PRNGKey(0), op, total=int(total), **SHAPE)
        if mode == "fwd":
            yield name, lambda inputs=inputs: fwd(*inputs[:4])
        else:
            yield name, lambda inputs=inputs: fwd_bwd(*inputs)


def flash_steps(case):
    import math

    import jax
    import jax.numpy as jnp

    from attention import _flash_attn3
    from ejkernel_cuda import native_flash

    fa3 = _flash_attn3()
    for name in CASES[case]:
        impl, seq, *flags = name.split("-")
        seq, causal, softcap = int(seq), "causal" in flags, 30.0 if "softcap" in flags else None
        keys = jax.random.split(jax.random.key(seq), 4)
        q, k, v, d_out = (jax.random.normal(kk, (16384 // seq, seq, 16, 128), jnp.float32).astype(jnp.bfloat16)
                          for kk in keys)
        if impl == "native":
            def attend(q, k, v, causal=causal, softcap=softcap):
                return native_flash.attention(q, k, v, 1 / math.sqrt(128), causal, None, softcap)
        elif fa3 is not None:
            def attend(q, k, v, causal=causal):
                return fa3(q, k, v, causal)
        else:
            continue
        step = jax.jit(lambda q, k, v, d_out, attend=attend: jax.vjp(attend, q, k, v)[1](d_out))
        yield name, lambda step=step, x=(q, k, v, d_out): step(*x)


def run(case: str, calls: int, only: str | None) -> None:
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

    steps = list(blocksparse_steps() if case == "blocksparse" else flash_steps(case) if case.startswith("flash")
                 else linear_steps(case))
    if only:
        steps = [(name, step) for name, step in steps if name == only]
    for _, step in steps:  # compile every variant first: only the marked calls follow the markers
        jax.block_until_ready(step())
    for name, step in steps:
        jax.block_until_ready(marker(jnp.zeros((16,), jnp.float32)))
        for _ in range(calls):
            jax.block_until_ready(step())
        print("ran", name, flush=True)


def summarize(case: str, path: str, calls: int, only: str | None) -> None:
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    name_col, metric_col = header.index("Kernel Name"), header.index("Metric Name")
    value_col = header.index("Metric Value")
    kernels = [(r[name_col], float(r[value_col].replace(",", ""))) for r in rows
               if r[metric_col] == "gpu__time_duration.sum"]
    variant, per = None, defaultdict(lambda: defaultdict(list))
    names = iter([only] if only else CASES[case])
    for kname, ns in kernels:
        if "variant_marker" in kname:
            variant = next(names, variant)
            continue
        if variant:
            per[variant][kname].append(ns)
    for name, kerns in per.items():
        print(f"== {name} (per call: the kernel's total over the {calls} marked calls / {calls})")
        total = 0.0
        for kname, times in sorted(kerns.items(), key=lambda kv: -sum(kv[1])):
            per_call = sum(times) / calls
            total += per_call
            print(f"  {per_call / 1e3:9.1f} us  x{len(times) / calls:<4g} {kname[:90]}")
        print(f"  {total / 1e3:9.1f} us per call")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), default="blocksparse")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--only", help="one variant of the case (e.g. fwd-16384)")
    parser.add_argument("--summarize", metavar="NCU_CSV")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.case, args.summarize, args.calls, args.only)
    else:
        run(args.case, args.calls, args.only)
