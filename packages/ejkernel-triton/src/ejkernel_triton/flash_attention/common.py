"""What the forward and backward kernels share: the per-call static parameters and their constexprs
(host side), and the Triton helpers for sequence bounds, block ranges, visibility, the dropout hash and
the logits.

Layout stays ``[batch, seq, heads, dim]`` throughout: kernels address q/k/v through strides, so nothing
is transposed or copied, and grouped-query attention reads kv head ``h // group`` directly. Programs run
over (blocks, sequences, heads); with varlen (``cum_seqlens``) a "sequence" is one packed sequence of
the batch-1 inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import triton
import triton.language as tl

from ejkernel_triton.flash_attention.tuning import TritonFlashConfig

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class StaticParams:
    """Everything static about one call (hashable: it keys the custom-VJP and vmap closures)."""

    softmax_scale: float
    causal: bool
    window_left: int  # -1: unbounded
    window_right: int
    softcap: float  # 0.0: none
    config: TritonFlashConfig
    interpret: bool
    dropout_threshold: int = 0  # uint32 threshold of ejkernel.ops.utils.dropout; 0: no dropout
    dropout_scale: float = 1.0  # 1 / (1 - dropout_prob)
    tma_forward: bool = False  # the forward runs `forward._fwd_tma_kernel`


def placeholder():
    """The argument passed for an absent optional array (segment ids, cum_seqlens): never read."""
    return jnp.zeros((1,), jnp.int32)


def padded_dim(d: int) -> int:
    """Head dim rounded up to a power of two >= 16 (tl.arange and tl.dot need one)."""
    return max(16, triton.next_power_of_2(d))


def kernel_meta(q, k, v, st: StaticParams, has_segments: bool, varlen: bool) -> dict[str, Any]:
    """Constexprs the forward, dK/dV and dQ kernels share."""
    b, sq, h, d = q.shape
    _, skv, hkv, dv = v.shape
    fp32 = q.dtype == jnp.float32
    return dict(
        NUM_HEADS=h, GROUP=h // hkv,
        stride_qs=h * d, stride_qh=d, stride_ks=hkv * d, stride_kh=d,
        stride_vs=hkv * dv, stride_vh=dv, stride_os=h * dv, stride_oh=dv,
        D=d, DV=dv, BLOCK_D=padded_dim(d), BLOCK_DV=padded_dim(dv),
        CAUSAL=st.causal, WINDOW_LEFT=st.window_left, WINDOW_RIGHT=st.window_right,
        USE_SOFTCAP=st.softcap > 0, HAS_SEGMENTS=has_segments, IS_VARLEN=varlen,
        DOT_PRECISION="ieee" if fp32 else "tf32", DROPOUT=st.dropout_threshold > 0,
        DROP_THRESHOLD=st.dropout_threshold, DROP_SCALE=st.dropout_scale,
    )


def num_sequences(q, cu_q) -> int:
    return cu_q.shape[0] - 1 if cu_q is not None else q.shape[0]


def seed_arg(seed):
    return seed if seed is not None else jnp.zeros((1,), jnp.uint32)


# ---- Triton helpers ----------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp: exact enough in fp32 and available to both the compiler and the interpreter.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def sequence_bounds(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN: tl.constexpr):
    """(first packed q row, q length, first packed kv row, kv length) of sequence `seq_idx`."""
    if IS_VARLEN:
        q_start = tl.load(cu_q + seq_idx)
        q_len = tl.load(cu_q + seq_idx + 1) - q_start
        k_start = tl.load(cu_k + seq_idx)
        k_len = tl.load(cu_k + seq_idx + 1) - k_start
        # Element offsets start * heads * dim overflow int32 past ~2**31 / (H * D) packed tokens.
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    else:
        q_start = 0
        q_len = SEQ_Q
        k_start = 0
        k_len = SEQ_KV
    return q_start, q_len, k_start, k_len


@triton.jit
def query_block(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, BLOCK_Q: tl.constexpr, IS_VARLEN: tl.constexpr,
                 REVERSE_BLOCKS: tl.constexpr):
    """First row of this program's query block (grid: query blocks x sequences x heads) and its sequence's
    bounds (`sequence_bounds`)."""
    if REVERSE_BLOCKS:  # causal: start the long rows first, so the short ones fill the tail
        block = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        block = tl.program_id(0)
    q_start, q_len, k_start, k_len = sequence_bounds(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN)
    return block * BLOCK_Q, q_start, q_len, k_start, k_len


@triton.jit
def _whole_blocks(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr, partial_owner, ALWAYS_MASK: tl.constexpr):
    """Round a visible range [lo, hi) out, and its mask-free part [full_lo, full_hi) in, to whole blocks;
    the mask-free part is clamped inside [lo, hi) and empty (at hi) when it does not exist, when masking is
    forced, or when the program's own block runs past its sequence (`partial_owner`)."""
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(tl.maximum(lo, 0), hi) // BLOCK * BLOCK
    full_lo = tl.maximum((tl.maximum(full_lo, 0) + BLOCK - 1) // BLOCK * BLOCK, lo)
    full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK * BLOCK, hi)
    if ALWAYS_MASK:
        full_lo = hi
        full_hi = hi
    if partial_owner | (full_hi <= full_lo):
        full_lo = hi
        full_hi = hi
    return lo, hi, full_lo, full_hi


@triton.jit
def kv_range(m0, q_len, k_len, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, ALWAYS_MASK: tl.constexpr):
    """Key range a query block [m0, m0 + BLOCK_Q) must visit, and its mask-free middle part."""
    shift = k_len - q_len  # query i sits at key position i + shift (bottom-right alignment)
    first_pos = m0 + shift
    last_pos = m0 + BLOCK_Q - 1 + shift
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, last_pos + 1)
        full_hi = tl.minimum(full_hi, first_pos + 1)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(hi, last_pos + WINDOW_RIGHT + 1)
        full_hi = tl.minimum(full_hi, first_pos + WINDOW_RIGHT + 1)
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(lo, first_pos - WINDOW_LEFT)
        full_lo = tl.maximum(full_lo, last_pos - WINDOW_LEFT)
    # Rows past the sequence's end make every key block of this query block a masked one.
    return _whole_blocks(lo, hi, full_lo, full_hi, BLOCK_KV, m0 + BLOCK_Q > q_len, ALWAYS_MASK)


@triton.jit
def q_range(n0, q_len, k_len, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr,
             WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, ALWAYS_MASK: tl.constexpr):
    """Query range a key block [n0, n0 + BLOCK_KV) is seen by, and its mask-free middle part."""
    shift = k_len - q_len
    last_key = n0 + BLOCK_KV - 1
    lo = 0
    hi = q_len
    full_lo = 0
    full_hi = q_len
    if CAUSAL:  # key j is seen by rows with i + shift >= j
        lo = tl.maximum(lo, n0 - shift)
        full_lo = tl.maximum(full_lo, last_key - shift)
    if WINDOW_RIGHT >= 0:  # j <= i + shift + right
        lo = tl.maximum(lo, n0 - shift - WINDOW_RIGHT)
        full_lo = tl.maximum(full_lo, last_key - shift - WINDOW_RIGHT)
    if WINDOW_LEFT >= 0:  # i + shift - left <= j
        hi = tl.minimum(hi, last_key + WINDOW_LEFT - shift + 1)
        full_hi = tl.minimum(full_hi, n0 + WINDOW_LEFT - shift + 1)
    return _whole_blocks(lo, hi, full_lo, full_hi, BLOCK_Q, n0 + BLOCK_KV > k_len, ALWAYS_MASK)


@triton.jit
def visible(rows, cols, q_len, k_len, k_seg_ptr, q_seg, CAUSAL: tl.constexpr,
             WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr):
    """Visibility of keys `cols` (local) to queries `rows` (local); broadcasting [R, 1] x [1, C]."""
    pos = rows + (k_len - q_len)
    ok = (rows < q_len) & (cols < k_len)
    if CAUSAL:
        ok = ok & (cols <= pos)
    if WINDOW_RIGHT >= 0:
        ok = ok & (cols <= pos + WINDOW_RIGHT)
    if WINDOW_LEFT >= 0:
        ok = ok & (cols >= pos - WINDOW_LEFT)
    if HAS_SEGMENTS:
        k_seg = tl.load(k_seg_ptr + cols, mask=cols < k_len, other=-1)
        ok = ok & (q_seg == k_seg)
    return ok


@triton.jit
def _fmix32(x):
    """murmur3's finalizer on uint32 (ejkernel.ops.utils.dropout, bit for bit)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def dropout_head_hash(Seed, batch, head):
    """The row hash's prefix shared by one (batch, head): fmix(fmix(fmix(seed ^ golden) ^ batch) ^ head)."""
    seed = tl.load(Seed)
    x = _fmix32(seed ^ 0x9E3779B9)
    x = _fmix32(x ^ batch.to(tl.uint32))
    return _fmix32(x ^ head.to(tl.uint32))


@triton.jit
def dropout_scale(head_hash, rows, cols, THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    """keep / (1 - p) for packed query indices `rows` and key indices `cols` (they broadcast)."""
    row_hash = _fmix32(head_hash ^ rows.to(tl.uint32))
    elem = _fmix32(row_hash ^ (cols.to(tl.uint32) * 0x27D4EB2F))
    return tl.where(elem >= THRESHOLD, SCALE, 0.0)


@triton.jit
def scores(q, k, qk_scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Logits in log2 units (so that exp2 gives the softmax numerator), float32."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        s = softcap * _tanh(s * qk_scale / softcap) * 1.4426950408889634
    else:
        s = s * (qk_scale * 1.4426950408889634)
    return s


