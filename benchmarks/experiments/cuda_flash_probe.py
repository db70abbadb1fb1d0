"""A/B timing of builds of ejkernel-cuda's native flash-attention kernels: one process per library, the same
harness (``benchmarks/attention.py``'s timing) and standard shapes, cuDNN and FlashAttention-3 beside them.

    python3 benchmarks/experiments/cuda_flash_probe.py --library path/to/libejkernel_cuda.so [--impls ...]

``--library`` replaces the installed package's library (``ejkernel_cuda._native.LIBRARY_PATH``) before
anything loads it, so a kernel change is timed against the previous build in one device call (run the
script once per library). Numerics are the GPU tests' job (``packages/ejkernel-cuda/tests``). Prints one
JSON line per measurement; writes them to $OUT/cuda_flash_probe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import _flash_attn3, time_step  # noqa: E402


def timing(seqs, reps, names) -> list[dict]:
    from ejkernel_cuda import native_flash

    rows = []
    fa3 = _flash_attn3()
    for seq in seqs:
        batch, heads, d = 16384 // seq, 16, 128
        inputs = []
        for i in range(3):
            ks = jax.random.split(jax.random.fold_in(jax.random.key(seq), i), 4)
            inputs.append(tuple(jax.random.normal(kk, (batch, seq, heads, d), jnp.float32).astype(jnp.bfloat16)
                                for kk in ks))
        for causal in (False, True):
            impls = {
                "ejkernel-cuda-native": lambda q, k, v, c=causal: native_flash.attention(q, k, v, 1 / math.sqrt(d), c,
                                                                                         None, None),
                "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                                 implementation="cudnn"),
            }
            if fa3 is not None:
                impls["flash-attn3"] = lambda q, k, v, c=causal: fa3(q, k, v, c)
            flops = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
            for name, fn in impls.items():
                if names and name not in names:
                    continue

                def step(q, k, v, do, fn=fn):
                    _, pull = jax.vjp(fn, q, k, v)
                    return pull(do)

                try:
                    t_fwd = time_step(jax.jit(fn), inputs, "fwd", 3, reps, 5)
                    t_both = time_step(jax.jit(step), inputs, "fwd+bwd", 3, reps, 5)
                except Exception as error:  # noqa: BLE001 - one column failing leaves the others
                    print(f"# {name} S={seq} causal={causal}: {type(error).__name__}: {error}"[:300])
                    continue
                row = dict(impl=name, seq=seq, causal=causal, fwd_ms=t_fwd * 1e3, fwd_bwd_ms=t_both * 1e3,
                           fwd_tflops=flops / t_fwd / 1e12, fwd_bwd_tflops=3.5 * flops / t_both / 1e12)
                print(json.dumps(row))
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", help="the libejkernel_cuda.so to time (default: the installed package's)")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--impls", default="", help="comma-separated subset of the timed columns")
    args = parser.parse_args()
    if args.library:
        from ejkernel_cuda import _native

        _native.LIBRARY_PATH = Path(args.library).resolve()
    result = {"device": str(jax.devices()[0].device_kind), "library": args.library,
              "timing": timing([int(s) for s in args.seqs.split(",")], args.reps,
                               [name for name in args.impls.split(",") if name])}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "cuda_flash_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
