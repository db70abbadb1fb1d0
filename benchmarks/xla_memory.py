"""Memory evidence for the XLA ``flash_attention``: compiled temp memory against sequence length, next to
the naive (dense) formula, and a forward+backward run at S=64k on CPU.

    JAX_PLATFORMS=cpu python benchmarks/xla_memory.py            # table + the 64k run
    JAX_PLATFORMS=cpu python benchmarks/xla_memory.py --no-run   # compile-only table

Shapes: batch 1, 1 head, head_dim 64, float32, causal. ``temp`` is XLA's ``memory_analysis()
.temp_size_in_bytes`` of the jitted program (scratch besides inputs and outputs); the naive program is
softmax(q k^T) v differentiated by autodiff, compiled only (never run at these lengths). Results are
recorded in ``docs/xla_memory.md``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from ejkernel.modules import flash_attention


def naive(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    n = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def flash(q, k, v):
    return flash_attention(q, k, v, causal=True, platform="xla")


def with_grad(fn):
    return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))


def temp_bytes(fn, seq_len: int) -> int:
    shape = jax.ShapeDtypeStruct((1, seq_len, 1, 64), jnp.float32)
    return jax.jit(fn).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-run", action="store_true", help="skip the S=64k forward+backward run")
    parser.add_argument("--run-seq", type=int, default=65536)
    args = parser.parse_args()

    print("| S | flash fwd temp MiB | flash fwd+bwd temp MiB | naive fwd+bwd temp MiB |")
    print("|---|---|---|---|")
    for seq_len in (4096, 8192, 16384, 32768, 65536):
        naive_temp = temp_bytes(with_grad(naive), seq_len) if seq_len <= 32768 else None
        print(
            f"| {seq_len} | {mib(temp_bytes(flash, seq_len))} | {mib(temp_bytes(with_grad(flash), seq_len))} | "
            f"{mib(naive_temp) if naive_temp is not None else 'n/a (not compiled)'} |",
            flush=True,
        )
    if args.no_run:
        return
    n = args.run_seq
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, n, 1, 64), jnp.float32) for key in keys)
    step = jax.jit(lambda q, k, v: jax.value_and_grad(lambda q, k, v: flash(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v))
    start = time.perf_counter()
    compiled = step.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    value, grads = compiled(q, k, v)
    jax.block_until_ready(grads)
    run_s = time.perf_counter() - start
    finite = all(bool(jnp.isfinite(g).all()) for g in grads)
    print(
        f"\nS={n} forward+backward on {jax.devices()[0].device_kind}: compile {compile_s:.1f}s, run {run_s:.1f}s, "
        f"temp {mib(compiled.memory_analysis().temp_size_in_bytes)} MiB, grads finite: {finite}, "
        f"sum(out) = {float(value):.4f}"
    )


if __name__ == "__main__":
    main()
