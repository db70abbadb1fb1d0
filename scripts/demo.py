"""The demo: one flash_attention call on this machine, what ran, and its error against a float64 reference."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from ejkernel.modules import FlashAttention, flash_attention
from ejkernel.testing._attention_reference import reference_flash_attention
from ejkernel.testing.numerics import jax_float64, relative_error

batch, seq_len, heads, kv_heads, head_dim = 2, 1024, 8, 2, 64
keys = jax.random.split(jax.random.key(2026), 3)
query = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32)
key = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)
value = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
options = dict(causal=True, sliding_window=256, logits_soft_cap=30.0)

print(f"\nflash_attention on {jax.default_backend()}: query {query.dtype}{list(query.shape)}, "
      f"GQA {heads}/{kv_heads} heads, {options}")
print("ran:", FlashAttention().explain(query, key, value, **options).describe())

attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, **options))
output = attend(query, key, value).block_until_ready()
start = time.perf_counter()
output = attend(query, key, value).block_until_ready()
elapsed = time.perf_counter() - start

with jax.enable_x64(True):
    expected = reference_flash_attention(*jax_float64((query, key, value)), **options)
print(f"output {output.dtype}{list(output.shape)} in {elapsed * 1000:.1f} ms (jit, warm); "
      f"relative L2 error vs float64 reference: {relative_error(output, expected):.2e}")
