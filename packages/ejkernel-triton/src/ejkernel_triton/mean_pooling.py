"""``mean_pooling`` (fixed length and varlen) as Triton kernels: a bandwidth-bound sum and a broadcast.

Forward: one program per (sequence, feature block, split) sums its slice of the sequence's tokens in
float32, accumulating whole ``[block_tokens, block_features]`` tiles (one reduction at the end); the
splits' partial sums (``[splits, sequences, features]`` float32, small) are added and divided by the
lengths in XLA. Splits cut long sequences so that few sequences still fill the GPU. Backward: the same
programs write ``dout[n] / len(n)`` to every token of their slice (tokens past ``cu_seqlens[-1]`` stay zero).
Features (everything after the token axis) are flattened; ``x`` is read in place, contiguous rows.
Under ``jax.vmap`` a fixed-length call folds the vmapped axis into the batch; a varlen one loops.
Nothing is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.mean_pooling import MeanPoolingCall
from ejkernel_triton.flash_attention.common import placeholder
from ejkernel_triton.flash_attention.vjp import fold_batch_rule
from ejkernel_triton.interpret import interpreting
from ejkernel_triton.launch import launch

__all__ = ["IMPLEMENTATION", "TritonMeanPooling", "TritonMeanPoolingConfig"]

TARGET_PROGRAMS = 4 * 132
"""Programs that keep an H100/H200 (132 SMs) busy enough for a streaming kernel: splits aim at it."""
MIN_TILES_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class TritonMeanPoolingConfig:
    """Tile of one program step (``block_tokens`` x ``block_features``, powers of two) and its warps."""

    block_tokens: int = 32
    block_features: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_tokens", "block_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"TritonMeanPoolingConfig.{name} must be a positive power of two, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TritonMeanPoolingConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")


@triton.jit
def _slice_bounds(Cu, seq, SEQ, NUM_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first packed row of the sequence, first and end token of this program's split, both local)."""
    if IS_VARLEN:
        start = tl.load(Cu + seq)
        length = tl.load(Cu + seq + 1) - start
        start = start.to(tl.int64)
    else:
        start = seq.to(tl.int64) * SEQ
        length = SEQ
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_T) * BLOCK_T
    lo = tl.program_id(2) * chunk
    return start, lo, tl.minimum(lo + chunk, length)


@triton.jit
def _sum_kernel(X, Cu, SEQ, Sums, NUM_SEQS: tl.constexpr, F: tl.constexpr, NUM_SPLITS: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, IS_VARLEN: tl.constexpr):
    seq = tl.program_id(0)
    start, lo, hi = _slice_bounds(Cu, seq, SEQ, NUM_SPLITS, BLOCK_T, IS_VARLEN)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + offs_t
        tile = tl.load(X + (start + rows)[:, None] * F + offs_f[None, :],
                       mask=(rows[:, None] < hi) & (offs_f[None, :] < F), other=0.0)
        acc += tile.to(tl.float32)
    out = Sums + (tl.program_id(2) * NUM_SEQS + seq).to(tl.int64) * F + offs_f
    tl.store(out, tl.sum(acc, 0), mask=offs_f < F)


@triton.jit
def _spread_kernel(G, Cu, SEQ, DX, F: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_F: tl.constexpr, IS_VARLEN: tl.constexpr):
    seq = tl.program_id(0)
    start, lo, hi = _slice_bounds(Cu, seq, SEQ, NUM_SPLITS, BLOCK_T, IS_VARLEN)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_t = tl.arange(0, BLOCK_T)
    g = tl.load(G + seq.to(tl.int64) * F + offs_f, mask=offs_f < F, other=0.0)
    tile = (tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32) + g[None, :]).to(DX.dtype.element_ty)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + offs_t
        tl.store(DX + (start + rows)[:, None] * F + offs_f[None, :], tile,
                 mask=(rows[:, None] < hi) & (offs_f[None, :] < F))


@dataclasses.dataclass(frozen=True)
class _Static:
    config: TritonMeanPoolingConfig
    block_features: int
    splits: int
    seq_len: int  # fixed length: tokens per sequence; varlen: 0
    interpret: bool


def _num_splits(num_seqs: int, tokens: int, feature_blocks: int, block_tokens: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, each with a few tiles of tokens."""
    tiles = math.ceil(tokens / max(num_seqs, 1) / block_tokens)
    wanted = math.ceil(TARGET_PROGRAMS / max(num_seqs * feature_blocks, 1))
    return max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))


def _launch_params(st: _Static, num_seqs: int, features: int):
    grid = (num_seqs, triton.cdiv(features, st.block_features), st.splits)
    return grid, dict(num_warps=st.config.num_warps, num_stages=2, interpret=st.interpret)


def _sequence_sums(x2, cu, st: _Static):
    """[num_seqs, F] float32 sums of packed rows x2 [T, F] (or fixed: T = num_seqs * seq_len)."""
    features = x2.shape[1]
    num_seqs = cu.shape[0] - 1 if cu is not None else x2.shape[0] // st.seq_len
    grid, params = _launch_params(st, num_seqs, features)
    (partial,) = launch(
        _sum_kernel, (x2, cu if cu is not None else placeholder(), st.seq_len),
        (jax.ShapeDtypeStruct((st.splits, num_seqs, features), jnp.float32),), grid, zeroed_outputs=(), **params,
        NUM_SEQS=num_seqs, F=features, NUM_SPLITS=st.splits, BLOCK_T=st.config.block_tokens,
        BLOCK_F=st.block_features, IS_VARLEN=cu is not None)
    return jnp.sum(partial, axis=0)


def _spread(g, cu, tokens: int, dtype, st: _Static):
    """dx [tokens, F]: g[n] (float32 [num_seqs, F]) on every token of sequence n, zeros elsewhere."""
    num_seqs, features = g.shape
    grid, params = _launch_params(st, num_seqs, features)
    (dx,) = launch(
        _spread_kernel, (g, cu if cu is not None else placeholder(), st.seq_len),
        (jax.ShapeDtypeStruct((tokens, features), dtype),), grid, zeroed_outputs=(0,) if cu is not None else (),
        **params, F=features, NUM_SPLITS=st.splits, BLOCK_T=st.config.block_tokens, BLOCK_F=st.block_features,
        IS_VARLEN=cu is not None)
    return dx


@functools.lru_cache(maxsize=None)
def _batched_calls(st: _Static, tokens_per_batch: int, dtype):
    """The sum and spread kernels on batch-like first arguments (x [B, S, F] / g [B, F]), with vmap rules."""

    @jax.custom_batching.custom_vmap
    def sums(x, cu):
        x2 = x.reshape(-1, x.shape[-1]) if cu is None else x
        return (_sequence_sums(x2, cu, st),)

    sums.def_vmap(fold_batch_rule(sums, 1, 1, varlen_args=1))

    @jax.custom_batching.custom_vmap
    def spread(g, cu):
        tokens = g.shape[0] * tokens_per_batch if cu is None else tokens_per_batch
        dx = _spread(g, cu, tokens, dtype, st)
        return (dx.reshape(g.shape[0], tokens_per_batch, -1) if cu is None else dx,)

    spread.def_vmap(fold_batch_rule(spread, 1, 1, varlen_args=1))
    return sums, spread


def _lengths(x, cu, st: _Static):
    if cu is None:
        return jnp.full((x.shape[0], 1), float(st.seq_len), jnp.float32)
    return jnp.maximum(cu[1:] - cu[:-1], 1).astype(jnp.float32)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pool(x, cu, st: _Static):
    """x [B, S, F] (cu None) or [T, F]: [num_seqs, F] in x's dtype."""
    return _pool_fwd(x, cu, st)[0]


def _pool_fwd(x, cu, st: _Static):
    tokens = x.shape[1] if cu is None else x.shape[0]
    sums, _ = _batched_calls(st, tokens, jnp.dtype(x.dtype))
    (total,) = sums(x, cu)
    # The residual `shape_of` is empty: its shape carries the token count, its dtype x's.
    return (total / _lengths(total, cu, st)).astype(x.dtype), (cu, jnp.zeros((tokens, 0), x.dtype))


def _pool_bwd(st: _Static, res, d_out):
    cu, shape_of = res
    _, spread = _batched_calls(st, shape_of.shape[0], jnp.dtype(shape_of.dtype))
    g = d_out.astype(jnp.float32) / _lengths(d_out, cu, st)
    (dx,) = spread(g, cu)
    return dx, None


_pool.defvjp(_pool_fwd, _pool_bwd)


class TritonMeanPooling(Implementation[MeanPoolingCall, TritonMeanPoolingConfig]):
    """Triton kernels through jax-triton (see the module docstring). No matmul, so no precision to honour."""

    config_type = TritonMeanPoolingConfig

    def heuristic_config(self, call: MeanPoolingCall) -> TritonMeanPoolingConfig:
        features = math.prod(call.x.shape[1 if call.cu_seqlens is not None else 2:])
        block_features = min(512, triton.next_power_of_2(features))
        # ~8K elements per tile: 32 KB of float32 accumulator over 4 warps, 16-32 KB of loads in flight.
        return TritonMeanPoolingConfig(block_tokens=max(1, 8192 // block_features), block_features=block_features,
                                       num_warps=4)

    def candidate_configs(self, call: MeanPoolingCall):
        base = self.heuristic_config(call)
        return [base, dataclasses.replace(base, block_tokens=max(1, base.block_tokens // 2)),
                dataclasses.replace(base, num_warps=8)]

    def __call__(self, call: MeanPoolingCall, config: TritonMeanPoolingConfig) -> jax.Array:
        x, cu = call.x, call.cu_seqlens
        varlen = cu is not None
        lead = 1 if varlen else 2
        features = x.shape[lead:]
        flat = x.reshape(*x.shape[:lead], math.prod(features))
        width = flat.shape[-1]
        num_seqs = cu.shape[0] - 1 if varlen else x.shape[0]
        tokens = x.shape[0] if varlen else x.shape[0] * x.shape[1]
        block_features = min(config.block_features, triton.next_power_of_2(width))
        splits = _num_splits(num_seqs, tokens, triton.cdiv(width, block_features), config.block_tokens)
        st = _Static(config=config, block_features=block_features, splits=splits,
                     seq_len=0 if varlen else x.shape[1], interpret=interpreting())
        if num_seqs == 0 or (varlen and tokens == 0):  # nothing to launch: empty sequences give zeros
            return jnp.zeros((num_seqs, *features), x.dtype) + 0 * jnp.sum(x)
        return _pool(flat, cu, st).reshape(num_seqs, *features)


IMPLEMENTATION = TritonMeanPooling()
