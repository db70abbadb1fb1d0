"""Experiment: the TMA + warp-specialized forward (`_fwd_tma_kernel`) against the pointer-load forward.

Forward only, bf16, D=128, 16 heads, 16k tokens, S in {2k, 8k}, causal and not, in one run with cuDNN:
each forward block configuration through `flash_attention(..., cfg=TritonFlashConfig(...))` (4 warps and
<= 2 stages select the TMA kernel, other configs the pointer kernel), with its relative error against
cuDNN's output.

    python benchmarks/experiments/triton_tma_ws.py --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

FWD_VARIANTS = [(128, 128, 4, 2), (128, 64, 4, 2), (256, 64, 4, 2), (64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seqs", default="2048,8192")
    args = ap.parse_args()
    from ejkernel.modules.operations.flash_attention import flash_attention
    from ejkernel_triton.flash_attention import TritonFlashConfig

    results = []
    for seq in map(int, args.seqs.split(",")):
        b, h, d = 16384 // seq, 16, 128
        sets = []
        for i in range(4):
            ks = jax.random.split(jax.random.key(i), 3)
            sets.append([jax.random.normal(kk, (b, seq, h, d), jnp.float32).astype(jnp.bfloat16) for kk in ks])
        for causal in (False, True):
            flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
            ref = jax.nn.dot_product_attention(*sets[0], implementation="cudnn", is_causal=causal)

            def bench(name, fn):
                f = jax.jit(fn)
                try:
                    out = jax.block_until_ready(f(*sets[0]))
                except Exception as e:  # noqa: BLE001
                    results.append(dict(seq=seq, causal=causal, name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(seq, causal, name, "ERROR", str(e)[:300], flush=True)
                    return
                err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
                for i in range(3):
                    jax.block_until_ready(f(*sets[i % 4]))
                samples = []
                for _ in range(15):
                    t0 = time.perf_counter()
                    last = None
                    for c in range(8):
                        last = f(*sets[c % 4])
                    jax.block_until_ready(last)
                    samples.append((time.perf_counter() - t0) / 8)
                ms = 1e3 * float(np.median(samples))
                results.append(dict(seq=seq, causal=causal, name=name, ms=ms, tflops=flops / ms / 1e9, rel_err_vs_cudnn=err))
                print(f"S={seq} causal={causal:d} {name:28s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.2e}",
                      flush=True)

            bench("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=causal))
            bench("triton default", lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="triton"))
            for bq, bkv, w, s in FWD_VARIANTS:
                cfg = TritonFlashConfig(fwd_block_q=bq, fwd_block_kv=bkv, fwd_num_warps=w, fwd_num_stages=s)
                bench(f"fwd {bq}x{bkv} w{w} s{s}",
                      lambda q, k, v, cfg=cfg: flash_attention(q, k, v, causal=causal, cfg=cfg))
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(dict(device=str(jax.devices()[0].device_kind), results=results), fh, indent=1)


if __name__ == "__main__":
    main()
