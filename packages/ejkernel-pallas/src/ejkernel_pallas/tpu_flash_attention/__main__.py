"""Micro-benchmark of the TPU flash attention (on a TPU): ``python -m ejkernel_pallas.tpu_flash_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp



def _benchmark(batch=4, seq=4096, heads=16, dim=128, causal=True, iters=20):
    import time

    from ejkernel.modules import flash_attention as public_flash_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, dim), jnp.bfloat16) for kk in keys)
    fn = jax.jit(lambda q, k, v: public_flash_attention(q, k, v, causal=causal, platform="pallas"))
    fn(q, k, v).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(q, k, v)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / iters
    flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    print(f"tpu flash fwd B={batch} S={seq} H={heads} D={dim} causal={causal}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    _benchmark()
