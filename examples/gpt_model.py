"""A small GPT-style decoder in flax ``nnx`` whose attention is a pluggable function.

Pre-norm blocks (RMSNorm -> grouped-query self-attention with rotary positions -> RMSNorm -> SwiGLU MLP),
byte-level vocabulary. The model never calls an attention kernel itself: ``GPT.__call__`` takes an
``attend(q, k, v, cache) -> (out, cache)`` function, so the same weights run with
``ejkernel.modules.flash_attention``, ``jax.nn.dot_product_attention`` or a paged KV cache
(``paged_generation.py``). Every layer works on any leading shape (``[batch, seq, ...]`` for training,
``[tokens, ...]`` for packed sequences, ``[batch, ...]`` for one decode step).

Also here: the text the examples train on (the Python standard library's own source, bytes as tokens).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# attend(q [..., H, D], k [..., Hkv, D], v [..., Hkv, D], cache) -> (out [..., H, D], new cache)
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA: num_heads // num_kv_heads query heads share a key/value head
    mlp_hidden: int = 128
    dtype: str = "float32"  # compute dtype (parameters are always float32)
    rope_base: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding of ``x [..., heads, head_dim]`` at integer ``positions [...]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None, None] * freqs  # [..., 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dense = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32, rngs=rngs)
        self.cfg = cfg
        self.query = nnx.Linear(cfg.d_model, cfg.num_heads * cfg.head_dim, **dense)
        self.key_value = nnx.Linear(cfg.d_model, 2 * cfg.num_kv_heads * cfg.head_dim, **dense)
        self.out = nnx.Linear(cfg.num_heads * cfg.head_dim, cfg.d_model, **dense)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend, cache: Any) -> tuple[jax.Array, Any]:
        cfg, lead = self.cfg, x.shape[:-1]
        q = self.query(x).reshape(*lead, cfg.num_heads, cfg.head_dim)
        k, v = jnp.split(self.key_value(x).reshape(*lead, 2 * cfg.num_kv_heads, cfg.head_dim), 2, axis=-2)
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        out, cache = attend(q, k, v, cache)
        return self.out(out.reshape(*lead, cfg.num_heads * cfg.head_dim)), cache


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dense = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32, rngs=rngs)
        self.attention_norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.gate_up = nnx.Linear(cfg.d_model, 2 * cfg.mlp_hidden, **dense)
        self.down = nnx.Linear(cfg.mlp_hidden, cfg.d_model, **dense)

    def __call__(self, x, positions, attend, cache):
        h, cache = self.attention(self.attention_norm(x), positions, attend, cache)
        x = x + h
        gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        return x + self.down(jax.nn.silu(gate) * up), cache


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
                               rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                                  param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, attend: Attend,
                 caches: list | None = None) -> tuple[jax.Array, list]:
        """Float32 logits ``[..., vocab]`` of ``tokens [...]`` at ``positions [...]``, and each layer's cache."""
        x = self.embed(tokens)
        new_caches = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, positions, attend, None if caches is None else caches[i])
            new_caches.append(cache)
        return self.lm_head(self.norm(x)).astype(jnp.float32), new_caches


def num_params(model: nnx.Module) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def training_text(num_bytes: int) -> np.ndarray:
    """``num_bytes`` bytes (uint8 tokens) of the Python standard library's own source in a fixed order
    (repeated if it is shorter); a synthetic stream of random words where no source ships with Python."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")) if "site-packages" not in p.parts]
    chunks, total = [], 0
    for path in paths:
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= num_bytes:
            break
    text = b"".join(chunks)
    if not text:
        rng = np.random.default_rng(0)
        words = [bytes(rng.integers(97, 123, rng.integers(2, 8)).astype(np.uint8)) + b" " for _ in range(512)]
        text = b"".join(words[i] for i in rng.integers(0, len(words), 4096))
    return np.frombuffer((text * (num_bytes // len(text) + 1))[:num_bytes], np.uint8)
