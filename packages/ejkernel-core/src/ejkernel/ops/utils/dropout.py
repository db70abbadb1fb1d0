"""The attention-dropout mask every backend draws: a pure integer hash of (seed, batch, head, row, col).

Being a function of indices only, the same mask comes out of any backend, any block size, and the
forward and backward passes, without storing it. All arithmetic is uint32 (wrapping), so Triton,
Pallas and CUDA kernels reproduce it bit for bit:

    fmix(x)    = murmur3 finalizer: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    row_hash   = fmix(fmix(fmix(fmix(seed ^ 0x9E3779B9) ^ batch) ^ head) ^ row)
    elem_hash  = fmix(row_hash ^ (col * 0x27D4EB2F))
    keep       = elem_hash >= threshold(p),  threshold(p) = min(floor(p * 2**32), 2**32 - 1)

``row``/``col`` are indices into the query/key arrays as passed (packed indices for varlen), ``head`` is
the query head, ``seed`` the low 32 bits of ``dropout_seed``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

GOLDEN = 0x9E3779B9
COL_MULTIPLIER = 0x27D4EB2F


def seed_bits(seed):
    """The seed's low 32 bits as uint32, what the hash takes. A Python int (of any size) becomes a numpy
    scalar: handed to a jitted kernel it is an argument, not a constant, so a new seed per step does not
    recompile. An integer array (traced or not) is cast, wrapping."""
    if isinstance(seed, (int, np.integer)):
        return np.uint32(int(seed) & 0xFFFFFFFF)
    return jnp.asarray(seed).astype(jnp.uint32)


def threshold(dropout_prob: float) -> int:
    """The uint32 threshold under which an element is dropped."""
    if not 0.0 <= dropout_prob < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1), got {dropout_prob!r}")
    return min(int(dropout_prob * 2**32), 2**32 - 1)


def fmix32(x):
    """murmur3's 32-bit finalizer on uint32 arrays (wrapping multiply)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def row_hash(seed, batch, head, row):
    """Per-row hash; arguments broadcast and are converted to uint32."""
    u = lambda v: jnp.asarray(v).astype(jnp.uint32)  # noqa: E731
    x = fmix32(u(seed) ^ jnp.uint32(GOLDEN))
    x = fmix32(x ^ u(batch))
    x = fmix32(x ^ u(head))
    return fmix32(x ^ u(row))


def keep_mask(seed, batch, head, row, col, dropout_prob: float):
    """Boolean keep mask (True = kept) broadcast over the index arguments."""
    rows = row_hash(seed, batch, head, row)
    elem = fmix32(rows ^ (jnp.asarray(col).astype(jnp.uint32) * jnp.uint32(COL_MULTIPLIER)))
    return elem >= jnp.uint32(threshold(dropout_prob))


def inverted_dropout(x, keep, dropout_prob: float):
    """``x`` where ``keep``, times ``1 / (1 - dropout_prob)`` (the kept entries carry the dropped ones'
    expectation), 0 where dropped."""
    return jnp.where(keep, x * (1.0 / (1.0 - dropout_prob)), 0.0)
