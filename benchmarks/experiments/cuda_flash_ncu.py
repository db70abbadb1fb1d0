"""One fwd+bwd step of the native CUDA flash attention and of FlashAttention-3 (flash-attn3-jax), for Nsight
Compute to profile (bf16, D=128, 16 heads, 16k tokens: the standard shape at --seq).

    ncu --clock-control none -k regex:'flash_backward_kernel|FlashAttnBwd' --launch-skip 2 --launch-count 2 \
        --section WarpStateStats --section SpeedOfLight ... python3 benchmarks/experiments/cuda_flash_ncu.py

Each implementation runs --steps jitted steps on fresh random inputs; ncu picks which launches it profiles.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import _flash_attn3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--impls", default="native,flash-attn3")
    args = parser.parse_args()
    from ejkernel_cuda import native_flash

    seq, d, heads = args.seq, 128, 16
    batch = 16384 // seq
    impls = {"native": lambda q, k, v: native_flash.attention(q, k, v, 1 / math.sqrt(d), args.causal, None, None)}
    fa3 = _flash_attn3()
    if fa3 is not None:
        impls["flash-attn3"] = lambda q, k, v: fa3(q, k, v, args.causal)
    for name in args.impls.split(","):
        fn = impls[name]

        @jax.jit
        def step(q, k, v, do, fn=fn):
            _, pull = jax.vjp(fn, q, k, v)
            return pull(do)

        for i in range(args.steps):
            keys = jax.random.split(jax.random.fold_in(jax.random.key(seq), i), 4)
            q, k, v, do = (jax.random.normal(kk, (batch, seq, heads, d), jnp.float32).astype(jnp.bfloat16)
                           for kk in keys)
            jax.block_until_ready(step(q, k, v, do))
        print(f"{name}: {args.steps} steps done", flush=True)


if __name__ == "__main__":
    main()
