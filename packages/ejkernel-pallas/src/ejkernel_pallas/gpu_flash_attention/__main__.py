"""Micro-benchmark of the GPU flash attention (on a GPU): ``python -m ejkernel_pallas.gpu_flash_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _benchmark(batch=2, seq=8192, heads=16, dim=128, causal=False, iters=15):
    import time

    from ejkernel.modules import flash_attention as public_flash_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, dim), jnp.bfloat16) for kk in keys)
    fwd = jax.jit(lambda q, k, v: public_flash_attention(q, k, v, causal=causal, platform="pallas"))
    bwd = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    for name, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", bwd, 3.5)):
        jax.block_until_ready(fn(q, k, v))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        print(f"{name} S={seq} causal={causal}: {seconds * 1e3:.3f} ms {mult * flops / seconds / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    _benchmark()
