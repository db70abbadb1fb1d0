"""Flash attention (forward and backward) as Triton kernels called through jax-triton.

Reads top to bottom: tuning parameters (shipped per-device tables, heuristics, autotuning space, and which
forward kernel a call takes), the Triton kernels (forward, the Hopper TMA + warp-specialized forward, dK/dV,
dQ, and float32's delta), the launch helpers (jax-triton on a GPU, `ejkernel_triton.launch` for the TMA
kernel, Triton's interpreter on the CPU for tests), the custom VJP and vmap rules, the public entry point
with its ``check_supported`` / ``heuristic_cfg`` / ``config_space`` attributes, a small dense reference and
a micro-benchmark.

Semantics are those of docs/flash_attention.md. Layout stays ``[batch, seq, heads, dim]`` throughout:
kernels address q/k/v through strides, so nothing is transposed or copied, and grouped-query attention
reads kv head ``h // group`` directly (no repeated kv). The backward pass writes dK/dV from programs
that own one kv block and loop over every query head of its group, so no atomics are needed.

Supported in forward and backward: causal, sliding window, logits soft cap, GQA/MQA, segment ids,
varlen (``cum_seqlens``), attention sinks (``softmax_aux``), dropout (the index hash of
``ejkernel.ops.utils.dropout``, recomputed bit for bit in every kernel), any sequence length, head_dim
<= 256, bf16/fp16/fp32 (fp32 with IEEE dots). Refused with :class:`ejkernel.UnsupportedFeature` (the
dispatcher then falls back to XLA): ``bias``, ``attention_mask``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel.errors import UnsupportedFeature

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# ----------------------------------------------------------------------------------------------------
# Tuning parameters
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block shapes and launch parameters of the three kernels (all hashable: it keys compilation)."""

    fwd_block_q: int = 128
    fwd_block_kv: int = 64
    fwd_num_warps: int = 8
    fwd_num_stages: int = 3
    # dK/dV kernel: a program owns `dkv_block_kv` keys and walks queries `dkv_block_q` at a time.
    dkv_block_q: int = 64
    dkv_block_kv: int = 128
    # dQ kernel: a program owns `dq_block_q` queries and walks keys `dq_block_kv` at a time.
    dq_block_q: int = 128
    dq_block_kv: int = 64
    bwd_num_warps: int = 8
    bwd_num_stages: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Tuning.{field.name} must be a positive int, got {value!r}")
            if "block" in field.name and (value < 16 or value & (value - 1)):
                raise ValueError(f"Tuning.{field.name} must be a power of two >= 16, got {value}")
        for name in ("fwd_num_warps", "bwd_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"Tuning.{name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)}")


TUNED_FILE_ENV = "EJKERNEL_TRITON_TUNED_FILE"
"""Path of a tuned table (the format of tuned/flash_attention.json, shipped with the package and read
through ejkernel_triton.plugin.tuned_entries) whose entries override the shipped ones (its first device's
entries apply to any GPU kind it does not name)."""


@functools.lru_cache(maxsize=None)
def tuned_table(path: str) -> dict[str, dict[str, dict[str, int]]]:
    """{device kind: {"d<head dim>-<full|causal>": Tuning fields}} from `path`."""
    return json.loads(Path(path).read_text())


def _tuned_entry(device_kind: str, head_dim: int, causal: bool, tma: bool = False) -> Tuning | None:
    if not device_kind:
        return None
    from ejkernel_triton.plugin import tuned_entries

    entries = dict(tuned_entries(device_kind) or {})
    override = os.environ.get(TUNED_FILE_ENV)
    if override and os.path.exists(override):
        table = tuned_table(override)
        entries.update(table.get(device_kind) or next(iter(table.values()), {}))
    if not entries:
        return None
    bucket = next((b for b in (64, 128, 256) if head_dim <= b), None)
    entry = entries.get(f"d{bucket}-{'causal' if causal else 'full'}") or entries.get(f"d{bucket}-full")
    if entry is None:
        return None
    tuned = Tuning(**{f.name: int(entry[f.name]) for f in dataclasses.fields(Tuning)})
    # A "-tma" entry holds the TMA kernel's forward blocks where tuning found it faster than the pointer
    # kernel's; without one the device keeps the pointer kernel's forward.
    tma_entry = entries.get(f"d{bucket}-{'causal' if causal else 'full'}-tma")
    if tma and tma_entry:
        tuned = dataclasses.replace(tuned, **{name: int(tma_entry[name]) for name in _FWD_FIELDS})
    return tuned


def _device_kind() -> str:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return ""
    return device.device_kind if device.platform == "gpu" else ""


def target_compute_capability() -> int:
    """Compute capability the kernels compile for: EJKERNEL_TRITON_COMPUTE_CAPABILITY, else the GPU's; 0 without."""
    cc = os.environ.get(COMPUTE_CAPABILITY_ENV)
    if cc:
        return int(cc)
    if _device_kind():
        from ejkernel_triton.launch import device_compute_capability

        return device_compute_capability()
    return 0


_FWD_FIELDS = ("fwd_block_q", "fwd_block_kv", "fwd_num_warps", "fwd_num_stages")
TMA_FWD_DEFAULT = (128, 128, 4, 2)
"""Forward blocks of the TMA kernel: 128x128 tiles, 4 warps per consumer warpgroup (the loop's warp
specialization adds a producer and splits the rows over two consumers), 2 stages. Measured on an H100,
S=8k, D=128: 2.01 ms, against 2.22-2.27 ms for 256x64 and 128x64 and 2.40 ms for the pointer kernel's
best; 3 stages gave NaNs (Triton 3.6)."""


def tma_forward_applies(head_dim: int, head_dim_v: int, dtype, *, masked: bool = False, varlen: bool = False,
                        dropout: bool = False) -> bool:
    """Whether a call's features admit the TMA + warp-specialized forward (`_fwd_tma_kernel`): a Hopper (or
    newer) target, bf16/fp16, q/v head dim 128 (at 64 it lost to the pointer kernel on an H100: 2.97 ms
    against 2.62 ms at S=8k), dense batches, no mask (causal, window,
    segment ids) and no dropout. It runs when its tuning fits the call too (`_uses_tma_forward`). Triton's
    interpreter runs it when EJKERNEL_TRITON_COMPUTE_CAPABILITY names a Hopper (the CPU tests)."""
    return (not (masked or varlen or dropout)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim == head_dim_v == 128 and target_compute_capability() >= 90 and _launcher_available())


def _launcher_available() -> bool:
    from ejkernel_triton.launch import available

    return available()


def _uses_tma_forward(tuning: Tuning, seq_q: int, seq_kv: int) -> bool:
    # Warp specialization happens at 4 warps only, 3 stages miscompiled (NaNs, Triton 3.6), and the kernel
    # has no masking: whole blocks only.
    return (tuning.fwd_num_warps == 4 and tuning.fwd_num_stages <= 2 and seq_q % tuning.fwd_block_q == 0
            and seq_kv % tuning.fwd_block_kv == 0)


def heuristic_tuning(head_dim: int, head_dim_v: int, dtype, device_kind: str | None = None,
                     causal: bool = False, tma: bool = False) -> Tuning:
    """Tuned blocks for this device kind when shipped (H100/H200), else defaults sized for Hopper's
    228 KB of shared memory per SM. `tma`: the forward blocks are for `_fwd_tma_kernel`."""
    d = max(head_dim, head_dim_v)
    if jnp.dtype(dtype) == jnp.float32:
        # IEEE fp32 dots run on CUDA cores: small tiles keep registers and shared memory in bounds.
        return Tuning(32, 32, 4, 2, 32, 32, 32, 32, 4, 1)
    tuned = _tuned_entry(_device_kind() if device_kind is None else device_kind, d, causal, tma)
    if tuned is not None:
        return tuned
    if d <= 64:
        base = Tuning(128, 64, 4, 3, 64, 64, 64, 64, 4, 2)
    elif d <= 128:
        base = Tuning(128, 64, 8, 3, 64, 64, 64, 64, 4, 2)
    else:
        base = Tuning(64, 64, 4, 2, 32, 64, 64, 32, 4, 1)
    return dataclasses.replace(base, **dict(zip(_FWD_FIELDS, TMA_FWD_DEFAULT))) if tma else base


def tuning_space(head_dim: int, head_dim_v: int, dtype, tma: bool = False) -> list[Tuning]:
    """A pruned autotuning space: block pairs that fit shared memory at this head dim."""
    base = heuristic_tuning(head_dim, head_dim_v, dtype, device_kind="", tma=tma)
    if jnp.dtype(dtype) == jnp.float32:
        return [base]
    d = max(head_dim, head_dim_v)
    if tma:  # 4 warps, <= 2 stages: what selects the TMA kernel (`_uses_tma_forward`)
        fwd = [TMA_FWD_DEFAULT, (128, 64, 4, 2), (256, 64, 4, 2)]
        bwd = [(64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2)]
    elif d <= 128:
        fwd = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3)]
        bwd = [(64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2)]
    else:
        fwd = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]
        bwd = [(32, 64, 64, 32, 4, 1), (32, 32, 32, 32, 4, 1)]
    out = [base]
    for f in fwd:
        for b in bwd:
            t = Tuning(*f, *b[:4], b[4], b[5])
            if t not in out:
                out.append(t)
    return out


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp: exact enough in fp32 and available to both the compiler and the interpreter.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _sequence_bounds(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN: tl.constexpr):
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
def _query_block(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, BLOCK_Q: tl.constexpr, IS_VARLEN: tl.constexpr,
                 REVERSE_BLOCKS: tl.constexpr):
    """First row of this program's query block (grid: query blocks x sequences x heads) and its sequence's
    bounds (`_sequence_bounds`)."""
    if REVERSE_BLOCKS:  # causal: start the long rows first, so the short ones fill the tail
        block = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        block = tl.program_id(0)
    q_start, q_len, k_start, k_len = _sequence_bounds(cu_q, cu_k, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN)
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
def _kv_range(m0, q_len, k_len, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr,
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
def _q_range(n0, q_len, k_len, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr,
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
def _visible(rows, cols, q_len, k_len, k_seg_ptr, q_seg, CAUSAL: tl.constexpr,
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
def _dropout_head_hash(Seed, batch, head):
    """The row hash's prefix shared by one (batch, head): fmix(fmix(fmix(seed ^ golden) ^ batch) ^ head)."""
    seed = tl.load(Seed)
    x = _fmix32(seed ^ 0x9E3779B9)
    x = _fmix32(x ^ batch.to(tl.uint32))
    return _fmix32(x ^ head.to(tl.uint32))


@triton.jit
def _dropout_scale(head_hash, rows, cols, THRESHOLD: tl.constexpr, SCALE: tl.constexpr):
    """keep / (1 - p) for packed query indices `rows` and key indices `cols` (they broadcast)."""
    row_hash = _fmix32(head_hash ^ rows.to(tl.uint32))
    elem = _fmix32(row_hash ^ (cols.to(tl.uint32) * 0x27D4EB2F))
    return tl.where(elem >= THRESHOLD, SCALE, 0.0)


@triton.jit
def _scores(q, k, qk_scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Logits in log2 units (so that exp2 gives the softmax numerator), float32."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        s = softcap * _tanh(s * qk_scale / softcap) * 1.4426950408889634
    else:
        s = s * (qk_scale * 1.4426950408889634)
    return s


@triton.jit
def _softmax_update(s, m_i, l_i, acc):
    """One online-softmax step over logits `s` (log2 units): the block's numerators and the running max,
    sum and accumulator rescaled to the new max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _sink_state(Aux, head, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Initial running max and sum of a query block: attention sinks only add to the denominator."""
    if NUM_SINKS > 0:
        offs_s = tl.arange(0, BLOCK_SINKS)
        aux = tl.load(Aux + head * NUM_SINKS + offs_s, mask=offs_s < NUM_SINKS, other=float("-inf"))
        aux = aux.to(tl.float32) * 1.4426950408889634
        aux_max = tl.max(aux, 0)
        m_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + aux_max
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + tl.sum(tl.math.exp2(aux - aux_max), 0)
    else:
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _store_rows(o_ptrs, lse_ptrs, acc, m_i, l_i, o_mask, row_mask):
    """Normalize and store a query block's output and log-sum-exp (log2 units)."""
    # With no visible key the row's value sum is 0: output zeros, and an infinite lse makes every
    # recomputed probability of the backward pass exactly 0.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(o_ptrs, (acc / safe_l[:, None]).to(o_ptrs.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("inf")), mask=row_mask)


@triton.jit
def _softcap_grad(ds, s, softcap, USE_SOFTCAP: tl.constexpr):
    """Chain rule through the soft cap: s (log2 units) = cap * tanh(x / cap) * log2(e), so dx = ds * (1 - tanh^2)."""
    if USE_SOFTCAP:
        capped = s * (0.6931471805599453 / softcap)  # back to natural units, over the cap: tanh
        ds = ds * (1.0 - capped * capped)
    return ds


@triton.jit
def _fwd_block_loop(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, start, stop,
                    rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
                    head_hash, q_start, k_start,
                    BLOCK_KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                    WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for n0 in range(start, stop, BLOCK_KV):
        cols = n0 + offs_kv
        if MASKED:
            k = tl.load(k_ptrs + n0 * stride_k_seq, mask=(cols[:, None] < k_len) & (offs_d[None, :] < D),
                        other=0.0)
        elif BLOCK_D != D:
            k = tl.load(k_ptrs + n0 * stride_k_seq, mask=offs_d[None, :] < D, other=0.0)
        else:
            k = tl.load(k_ptrs + n0 * stride_k_seq)
        s = _scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        if MASKED:
            ok = _visible(rows[:, None], cols[None, :], q_len, k_len, k_seg_ptr, q_seg[:, None],
                          CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
            s = tl.where(ok, s, float("-inf"))
        p, m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc)
        if MASKED:
            v = tl.load(v_ptrs + n0 * stride_v_seq, mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV),
                        other=0.0)
        elif BLOCK_DV != DV:
            v = tl.load(v_ptrs + n0 * stride_v_seq, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            v = tl.load(v_ptrs + n0 * stride_v_seq)
        if DROPOUT:  # the denominator keeps every probability; only the values see the mask
            p = p * _dropout_scale(head_hash, (q_start + rows)[:, None], (k_start + cols)[None, :],
                                   DROP_THRESHOLD, DROP_SCALE)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, QSeg, KSeg, CuQ, CuK, Aux, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs and scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REVERSE_BLOCKS: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
):
    seq_idx = tl.program_id(1)
    head = tl.program_id(2)
    m0, q_start, q_len, k_start, k_len = _query_block(CuQ, CuK, seq_idx, SEQ_Q, SEQ_KV, BLOCK_Q, IS_VARLEN,
                                                      REVERSE_BLOCKS)
    if m0 >= q_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)  # int64: offsets of large batches overflow int32
    kv_head = head // GROUP
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q

    q_base = Q + batch * SEQ_Q * stride_qs + q_start * stride_qs + head * stride_qh
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :],
                mask=(rows[:, None] < q_len) & (offs_d[None, :] < D), other=0.0)
    k_ptrs = (K + batch * SEQ_KV * stride_ks + k_start * stride_ks + kv_head * stride_kh
              + offs_kv[:, None] * stride_ks + offs_d[None, :])
    v_ptrs = (V + batch * SEQ_KV * stride_vs + k_start * stride_vs + kv_head * stride_vh
              + offs_kv[:, None] * stride_vs + offs_dv[None, :])
    seg_offset = batch * SEQ_Q + q_start
    k_seg_ptr = KSeg + batch * SEQ_KV + k_start
    if HAS_SEGMENTS:
        q_seg = tl.load(QSeg + seg_offset + rows, mask=rows < q_len, other=-2)
    else:
        q_seg = rows

    head_hash = _dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0

    acc = tl.zeros([BLOCK_Q, BLOCK_DV], dtype=tl.float32)
    m_i, l_i = _sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)

    lo, hi, full_lo, full_hi = _kv_range(m0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT, HAS_SEGMENTS)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, full_lo, full_hi, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, lo, full_lo, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    acc, m_i, l_i = _fwd_block_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, full_hi, hi, rows, offs_kv, offs_d,
        offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV, D,
        DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION,
        DROPOUT, DROP_THRESHOLD, DROP_SCALE)

    o_ptrs = (O + batch * SEQ_Q * stride_os + q_start * stride_os + head * stride_oh
              + rows[:, None] * stride_os + offs_dv[None, :])
    _store_rows(o_ptrs, LSE + (batch * NUM_HEADS + head) * SEQ_Q + q_start + rows, acc, m_i, l_i,
                (rows[:, None] < q_len) & (offs_dv[None, :] < DV), rows < q_len)


@triton.jit
def _fwd_tma_kernel(
    Q, K, V, Aux, qk_scale, softcap, SEQ_Q, SEQ_KV,  # inputs and scalars
    O, LSE,  # outputs
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr, USE_SOFTCAP: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
):
    """The forward for Hopper when no logit needs a mask: tiles arrive by TMA (device-side descriptors) and
    the loop over key blocks is warp-specialized, a producer warpgroup issuing the loads while two consumer
    warpgroups, each owning half of the query rows, run the matmuls and the softmax.

    Same results as `_fwd_kernel` for the calls `tma_forward_applies` admits: dense batches whose lengths
    are multiples of the blocks, no causal/window/segment mask, no dropout, q/v head dim 128.
    Triton 3.6 warp-specializes only a loop without run-time branches whose state does not come from another
    loop, so masked (edge) blocks would have to be masked in every iteration: slower than `_fwd_kernel` on
    causal calls (measured), hence the restriction. The descriptors see 2-D [batch * seq, heads * dim]
    matrices (the data partitioning refuses the reshape of a 3-D view)."""
    batch = tl.program_id(1)
    head = tl.program_id(2)
    m0 = tl.program_id(0) * BLOCK_Q
    kv_head = head // GROUP
    kv_width = (NUM_HEADS // GROUP) * D
    q_desc = tl.make_tensor_descriptor(Q, shape=[tl.num_programs(1) * SEQ_Q, NUM_HEADS * D],
                                       strides=[NUM_HEADS * D, 1], block_shape=[BLOCK_Q, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[tl.num_programs(1) * SEQ_KV, kv_width], strides=[kv_width, 1],
                                       block_shape=[BLOCK_KV, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[tl.num_programs(1) * SEQ_KV, kv_width], strides=[kv_width, 1],
                                       block_shape=[BLOCK_KV, D])
    q = q_desc.load([batch * SEQ_Q + m0, head * D])
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    m_i, l_i = _sink_state(Aux, head, NUM_SINKS, BLOCK_SINKS, BLOCK_Q)
    for n0 in tl.range(0, SEQ_KV, BLOCK_KV, warp_specialize=True):
        k = k_desc.load([batch * SEQ_KV + n0, kv_head * D])
        s = _scores(q, k, qk_scale, softcap, USE_SOFTCAP, "tf32")
        p, m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc)
        v = v_desc.load([batch * SEQ_KV + n0, kv_head * D])
        acc = tl.dot(p.to(v.dtype), v, acc)

    rows = m0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    row0 = batch.to(tl.int64) * SEQ_Q  # element offsets of large batches overflow int32
    o_ptrs = O + (row0 + rows[:, None]) * (NUM_HEADS * D) + head * D + offs_d[None, :]
    _store_rows(o_ptrs, LSE + (batch.to(tl.int64) * NUM_HEADS + head) * SEQ_Q + rows, acc, m_i, l_i,
                (rows[:, None] < SEQ_Q) & (offs_d[None, :] < D), rows < SEQ_Q)


@triton.jit
def _dkv_block_loop(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, q_seg_ptr, start, stop,
                    cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_q_seq, stride_do_seq,
                    qk_scale, softcap, head_hash, q_start, k_start,
                    BLOCK_Q: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for m0 in range(start, stop, BLOCK_Q):
        rows = m0 + offs_q
        if MASKED:
            q = tl.load(q_ptrs + m0 * stride_q_seq, mask=(rows[:, None] < q_len) & (offs_d[None, :] < D),
                        other=0.0)
            do = tl.load(do_ptrs + m0 * stride_do_seq,
                         mask=(rows[:, None] < q_len) & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(lse_ptr + rows, mask=rows < q_len, other=float("inf"))
            delta = tl.load(delta_ptr + rows, mask=rows < q_len, other=0.0)
        else:
            if BLOCK_D != D:
                q = tl.load(q_ptrs + m0 * stride_q_seq, mask=offs_d[None, :] < D, other=0.0)
            else:
                q = tl.load(q_ptrs + m0 * stride_q_seq)
            if BLOCK_DV != DV:
                do = tl.load(do_ptrs + m0 * stride_do_seq, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                do = tl.load(do_ptrs + m0 * stride_do_seq)
            lse = tl.load(lse_ptr + rows)
            delta = tl.load(delta_ptr + rows)
        # Transposed scores [keys, queries]: dK and dV then need no transposes of the accumulators.
        st = _scores(k, q, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        pt = tl.math.exp2(st - lse[None, :])
        if MASKED:
            if HAS_SEGMENTS:
                q_seg = tl.load(q_seg_ptr + rows, mask=rows < q_len, other=-2)
            else:
                q_seg = rows
            ok = _visible(rows[None, :], cols[:, None], q_len, k_len, None, q_seg[None, :],
                          CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, False)
            if HAS_SEGMENTS:
                ok = ok & (q_seg[None, :] == k_seg[:, None])
            pt = tl.where(ok, pt, 0.0)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_scale(head_hash, (q_start + rows)[None, :], (k_start + cols)[:, None],
                                  DROP_THRESHOLD, DROP_SCALE)
            dv = tl.dot((pt * keep).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dpt = dpt * keep
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dst = _softcap_grad(pt * (dpt - delta[None, :]), st, softcap, USE_SOFTCAP)
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkv_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, CuQ, CuK, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DKOut, DVOut,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
):
    seq_idx = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start, q_len, k_start, k_len = _sequence_bounds(CuQ, CuK, seq_idx, SEQ_Q, SEQ_KV, IS_VARLEN)
    n0 = tl.program_id(0) * BLOCK_KV
    if n0 >= k_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)  # int64: offsets of large batches overflow int32
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = n0 + offs_kv

    k_base = K + batch * SEQ_KV * stride_ks + k_start * stride_ks + kv_head * stride_kh
    v_base = V + batch * SEQ_KV * stride_vs + k_start * stride_vs + kv_head * stride_vh
    k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :],
                mask=(cols[:, None] < k_len) & (offs_d[None, :] < D), other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :],
                mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV), other=0.0)
    if HAS_SEGMENTS:
        k_seg = tl.load(KSeg + batch * SEQ_KV + k_start + cols, mask=cols < k_len, other=-1)
    else:
        k_seg = cols
    q_seg_ptr = QSeg + batch * SEQ_Q + q_start

    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_DV], dtype=tl.float32)
    lo, hi, full_lo, full_hi = _q_range(n0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                        WINDOW_RIGHT, HAS_SEGMENTS)
    # Every query head of this kv head's group adds to the same dK/dV: no repeated kv, no atomics.
    for g in range(GROUP):
        head = kv_head * GROUP + g
        head_hash = _dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0
        q_ptrs = (Q + batch * SEQ_Q * stride_qs + q_start * stride_qs + head * stride_qh
                  + offs_q[:, None] * stride_qs + offs_d[None, :])
        do_ptrs = (DO + batch * SEQ_Q * stride_os + q_start * stride_os + head * stride_oh
                   + offs_q[:, None] * stride_os + offs_dv[None, :])
        row_offset = (batch * NUM_HEADS + head) * SEQ_Q + q_start
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, full_lo,
            full_hi, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, lo,
            full_lo, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
        dk, dv = _dkv_block_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_offset, Delta + row_offset, q_seg_ptr, full_hi,
            hi, cols, offs_q, offs_d, offs_dv, q_len, k_len, k_seg, stride_qs, stride_os, qk_scale,
            softcap, head_hash, q_start, k_start, BLOCK_Q, D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True, DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)

    dk = dk * qk_scale
    dk_ptrs = (DKOut + batch * SEQ_KV * stride_ks + k_start * stride_ks + kv_head * stride_kh
               + cols[:, None] * stride_ks + offs_d[None, :])
    tl.store(dk_ptrs, dk.to(DKOut.dtype.element_ty), mask=(cols[:, None] < k_len) & (offs_d[None, :] < D))
    dv_ptrs = (DVOut + batch * SEQ_KV * stride_vs + k_start * stride_vs + kv_head * stride_vh
               + cols[:, None] * stride_vs + offs_dv[None, :])
    tl.store(dv_ptrs, dv.to(DVOut.dtype.element_ty), mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV))


@triton.jit
def _dq_block_loop(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_k_seq, stride_v_seq, start, stop,
                   rows, offs_kv, offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap,
                   head_hash, q_start, k_start,
                   BLOCK_KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                   WINDOW_RIGHT: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                   MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                   DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr):
    for n0 in range(start, stop, BLOCK_KV):
        cols = n0 + offs_kv
        if MASKED:
            k = tl.load(k_ptrs + n0 * stride_k_seq, mask=(cols[:, None] < k_len) & (offs_d[None, :] < D),
                        other=0.0)
            v = tl.load(v_ptrs + n0 * stride_v_seq, mask=(cols[:, None] < k_len) & (offs_dv[None, :] < DV),
                        other=0.0)
        else:
            if BLOCK_D != D:
                k = tl.load(k_ptrs + n0 * stride_k_seq, mask=offs_d[None, :] < D, other=0.0)
            else:
                k = tl.load(k_ptrs + n0 * stride_k_seq)
            if BLOCK_DV != DV:
                v = tl.load(v_ptrs + n0 * stride_v_seq, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs + n0 * stride_v_seq)
        s = _scores(q, k, qk_scale, softcap, USE_SOFTCAP, DOT_PRECISION)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            ok = _visible(rows[:, None], cols[None, :], q_len, k_len, k_seg_ptr, q_seg[:, None],
                          CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            dp = dp * _dropout_scale(head_hash, (q_start + rows)[:, None], (k_start + cols)[None, :],
                                     DROP_THRESHOLD, DROP_SCALE)
        ds = _softcap_grad(p * (dp - delta[:, None]), s, softcap, USE_SOFTCAP)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, Delta, QSeg, KSeg, CuQ, CuK, Seed, qk_scale, softcap, SEQ_Q, SEQ_KV,
    DQ,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    stride_qs: tl.constexpr, stride_qh: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vs: tl.constexpr, stride_vh: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, REVERSE_BLOCKS: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_THRESHOLD: tl.constexpr, DROP_SCALE: tl.constexpr,
):
    seq_idx = tl.program_id(1)
    head = tl.program_id(2)
    m0, q_start, q_len, k_start, k_len = _query_block(CuQ, CuK, seq_idx, SEQ_Q, SEQ_KV, BLOCK_Q, IS_VARLEN,
                                                      REVERSE_BLOCKS)
    if m0 >= q_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)  # int64: offsets of large batches overflow int32
    kv_head = head // GROUP
    offs_q = tl.arange(0, BLOCK_Q)
    offs_kv = tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q

    row_ok = rows < q_len
    q = tl.load(Q + batch * SEQ_Q * stride_qs + q_start * stride_qs + head * stride_qh
                + rows[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + batch * SEQ_Q * stride_os + q_start * stride_os + head * stride_oh
                 + rows[:, None] * stride_os + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    row_offset = (batch * NUM_HEADS + head) * SEQ_Q + q_start
    lse = tl.load(LSE + row_offset + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_offset + rows, mask=row_ok, other=0.0)
    k_ptrs = (K + batch * SEQ_KV * stride_ks + k_start * stride_ks + kv_head * stride_kh
              + offs_kv[:, None] * stride_ks + offs_d[None, :])
    v_ptrs = (V + batch * SEQ_KV * stride_vs + k_start * stride_vs + kv_head * stride_vh
              + offs_kv[:, None] * stride_vs + offs_dv[None, :])
    k_seg_ptr = KSeg + batch * SEQ_KV + k_start
    if HAS_SEGMENTS:
        q_seg = tl.load(QSeg + batch * SEQ_Q + q_start + rows, mask=row_ok, other=-2)
    else:
        q_seg = rows

    head_hash = _dropout_head_hash(Seed, seq_idx if not IS_VARLEN else 0 * seq_idx, head) if DROPOUT else 0
    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    lo, hi, full_lo, full_hi = _kv_range(m0, q_len, k_len, BLOCK_Q, BLOCK_KV, CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT, HAS_SEGMENTS)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, full_lo, full_hi, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, False,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, lo, full_lo, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = _dq_block_loop(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, full_hi, hi, rows, offs_kv,
        offs_d, offs_dv, q_len, k_len, k_seg_ptr, q_seg, qk_scale, softcap, head_hash, q_start, k_start, BLOCK_KV,
        D, DV, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS, USE_SOFTCAP, True,
        DOT_PRECISION, DROPOUT, DROP_THRESHOLD, DROP_SCALE)
    dq = dq * qk_scale
    tl.store(DQ + batch * SEQ_Q * stride_qs + q_start * stride_qs + head * stride_qh
             + rows[:, None] * stride_qs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _delta_kernel(
    O, DO, CuQ, SEQ_Q,
    Delta,
    NUM_HEADS: tl.constexpr, stride_os: tl.constexpr, stride_oh: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_Q: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """delta_i = <dO_i, O_i> through the same IEEE dot the backward kernels use for dP (float32 only).

    Taken as the diagonal of dO Oᵀ, delta is summed in the order dP_ij = <dO_i, V_j> is, so a row that sees
    a single key (O_i == V_j bitwise) gets dP_ij - delta_i == 0 exactly, as the exact gradient is."""
    seq_idx = tl.program_id(1)
    head = tl.program_id(2)
    q_start, q_len, _, _ = _sequence_bounds(CuQ, CuQ, seq_idx, SEQ_Q, SEQ_Q, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_Q
    if m0 >= q_len:
        return
    batch = 0 if IS_VARLEN else seq_idx.to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = m0 + offs_q
    ptrs = (batch * SEQ_Q * stride_os + q_start * stride_os + head * stride_oh
            + rows[:, None] * stride_os + offs_dv[None, :])
    mask = (rows[:, None] < q_len) & (offs_dv[None, :] < DV)
    o = tl.load(O + ptrs, mask=mask, other=0.0)
    do = tl.load(DO + ptrs, mask=mask, other=0.0)
    gram = tl.dot(do, tl.trans(o), input_precision="ieee")
    delta = tl.sum(tl.where(offs_q[:, None] == offs_q[None, :], gram, 0.0), 1)
    tl.store(Delta + (batch * NUM_HEADS + head) * SEQ_Q + q_start + rows, delta, mask=rows < q_len)


# ----------------------------------------------------------------------------------------------------
# Launching: jax-triton on a GPU; Triton's interpreter on the host (TRITON_INTERPRET=1; tests, fp32/fp16)
# ----------------------------------------------------------------------------------------------------

COMPUTE_CAPABILITY_ENV = "EJKERNEL_TRITON_COMPUTE_CAPABILITY"
"""Compile for this compute capability instead of the visible GPU's (lowering on a CPU-only machine)."""


def _interpret_requested() -> bool:
    # TRITON_INTERPRET=1 must be set before triton is imported: it turns every @triton.jit function,
    # triton.language's own included, into an interpreted one. The kernels then run on the host.
    return bool(triton.knobs.runtime.interpret)


_INTERPRETER_PATCHED: set = set()
_INTERPRETER_LOCK = threading.Lock()


def _patch_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter, applied only when it runs our kernels.

    It turns 1-element arrays into ints with int(array), which numpy >= 2.5 refuses for arrays that
    are not 0-d (loop bounds computed at run time hit it): take the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ejkernel_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._ejkernel_patched = True
    interpreter._patch_lang_tensor = patched

    # A helper called from a kernel re-patches triton.language on every call, which dominates the
    # interpreter's time: patch once per helper and launch (`_launch` empties the set).
    def call_helper(self, *args, **kwargs):
        if self.fn not in _INTERPRETER_PATCHED:
            interpreter._patch_lang(self.fn)
            _INTERPRETER_PATCHED.add(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call_helper


class _HostDtype:
    # Triton reads a tensor's dtype through its string form ("torch.float16").
    def __init__(self, dtype: np.dtype):
        self.name = np.dtype(dtype).name

    def __str__(self) -> str:
        return "torch." + self.name


class _HostTensor:
    """The few torch.Tensor methods Triton's interpreter calls, over a numpy array in host memory."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = _HostDtype(array.dtype)

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args, **kwargs):
        return _HostTensor(self.array[:0])

    def set_(self, storage, offset, size, stride):
        self.array, self.dtype = storage.array, storage.dtype
        return self

    def copy_(self, other):
        return self


def _launch(kernel, args, out_shapes, grid, *, num_warps, num_stages, zeroed_outputs, interpret, tma=False,
            **meta):
    """Call `kernel` on `args` (arrays and np.float32 scalars, in kernel order); outputs follow inputs.

    Scalars go as np.float32: jax-triton passes a Python float as fp64, which would promote the
    kernel's float32 arithmetic to fp64. `tma`: the kernel makes TMA descriptors (or is warp-specialized),
    which needs ejkernel_triton.launch on a GPU (global scratch, the compiled warp count)."""
    if not interpret and tma:
        from ejkernel_triton.launch import triton_call

        return triton_call(*args, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
                           num_stages=num_stages, zeroed_outputs=zeroed_outputs,
                           compute_capability=target_compute_capability(), **meta)
    if not interpret:
        import jax_triton as jt

        cc = os.environ.get(COMPUTE_CAPABILITY_ENV)
        return jt.triton_call(
            *args, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
            num_stages=num_stages, zeroed_outputs=zeroed_outputs,
            compute_capability=int(cc) if cc else None, **meta)

    _patch_interpreter()
    array_idx = [i for i, a in enumerate(args) if not isinstance(a, (int, float, np.floating))]

    def host(*arrays):
        call_args = [float(a) if isinstance(a, np.floating) else a for a in args]
        for i, a in zip(array_idx, arrays):
            call_args[i] = _HostTensor(np.ascontiguousarray(np.asarray(a)))
        outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
        # XLA may run independent callbacks (the dK/dV and dQ kernels) on two threads at once, and the
        # interpreter patches triton.language globally per launch: one launch at a time.
        with _INTERPRETER_LOCK:
            _INTERPRETER_PATCHED.clear()
            kernel[grid](*call_args, *map(_HostTensor, outs), **meta)
        return tuple(outs)

    return jax.pure_callback(host, tuple(out_shapes), *[args[i] for i in array_idx])


# ----------------------------------------------------------------------------------------------------
# Kernel calls, vmap rules and the custom VJP
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: it keys the custom-VJP and vmap closures)."""

    softmax_scale: float
    causal: bool
    window_left: int  # -1: unbounded
    window_right: int
    softcap: float  # 0.0: none
    tuning: Tuning
    interpret: bool
    dropout_threshold: int = 0  # uint32 threshold of ejkernel.ops.utils.dropout; 0: no dropout
    dropout_scale: float = 1.0  # 1 / (1 - dropout_prob)
    tma_forward: bool = False  # the forward runs `_fwd_tma_kernel`


def _dummy():
    return jnp.zeros((1,), jnp.int32)


def _common_meta(q, k, v, st: _Static, has_segments: bool, varlen: bool) -> dict[str, Any]:
    b, sq, h, d = q.shape
    _, skv, hkv, dv = v.shape
    fp32 = q.dtype == jnp.float32
    return dict(
        NUM_HEADS=h, GROUP=h // hkv,
        stride_qs=h * d, stride_qh=d, stride_ks=hkv * d, stride_kh=d,
        stride_vs=hkv * dv, stride_vh=dv, stride_os=h * dv, stride_oh=dv,
        D=d, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        CAUSAL=st.causal, WINDOW_LEFT=st.window_left, WINDOW_RIGHT=st.window_right,
        USE_SOFTCAP=st.softcap > 0, HAS_SEGMENTS=has_segments, IS_VARLEN=varlen,
        DOT_PRECISION="ieee" if fp32 else "tf32", DROPOUT=st.dropout_threshold > 0,
        DROP_THRESHOLD=st.dropout_threshold, DROP_SCALE=st.dropout_scale,
    )


def _num_sequences(q, cu_q) -> int:
    return cu_q.shape[0] - 1 if cu_q is not None else q.shape[0]


def _seed_arg(seed):
    return seed if seed is not None else jnp.zeros((1,), jnp.uint32)


def _fwd_tma_call(q, k, v, aux, st: _Static):
    b, sq, h, d = q.shape
    skv = k.shape[1]
    t = st.tuning
    num_sinks = aux.shape[-1] if aux is not None else 0
    out_shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    args = (q, k, v, aux if aux is not None else jnp.zeros((1,), jnp.float32), np.float32(st.softmax_scale),
            np.float32(st.softcap or 1.0), sq, skv)
    return _launch(
        _fwd_tma_kernel, args, out_shapes, (triton.cdiv(sq, t.fwd_block_q), b, h), num_warps=t.fwd_num_warps,
        num_stages=t.fwd_num_stages, zeroed_outputs=(), interpret=st.interpret, tma=True,
        NUM_HEADS=h, GROUP=h // k.shape[2], D=d, BLOCK_Q=t.fwd_block_q, BLOCK_KV=t.fwd_block_kv,
        USE_SOFTCAP=st.softcap > 0, NUM_SINKS=num_sinks,
        BLOCK_SINKS=max(2, triton.next_power_of_2(max(num_sinks, 1))))


def _fwd_call(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: _Static):
    if st.tma_forward:
        return _fwd_tma_call(q, k, v, aux, st)
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    t = st.tuning
    varlen = cu_q is not None
    has_seg = q_seg is not None
    num_sinks = aux.shape[-1] if aux is not None else 0
    meta = _common_meta(q, k, v, st, has_seg, varlen)
    grid = (triton.cdiv(sq, t.fwd_block_q), _num_sequences(q, cu_q), h)
    out_shapes = (jax.ShapeDtypeStruct((b, sq, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    args = (q, k, v, q_seg if has_seg else _dummy(), kv_seg if has_seg else _dummy(),
            cu_q if varlen else _dummy(), cu_k if varlen else _dummy(),
            aux if aux is not None else jnp.zeros((1,), jnp.float32), _seed_arg(seed),
            np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, k.shape[1])
    return _launch(
        _fwd_kernel, args, out_shapes, grid, num_warps=t.fwd_num_warps, num_stages=t.fwd_num_stages,
        zeroed_outputs=(0, 1) if varlen else (), interpret=st.interpret, **meta,
        BLOCK_Q=t.fwd_block_q, BLOCK_KV=t.fwd_block_kv, NUM_SINKS=num_sinks,
        BLOCK_SINKS=max(2, triton.next_power_of_2(max(num_sinks, 1))),
        REVERSE_BLOCKS=st.causal and not varlen)


def _delta(out, do, cu_q, st: _Static):
    """delta_i = <dO_i, O_i> in float32, [B, H, Sq]."""
    if out.dtype != jnp.float32:  # one cheap pass, left to XLA
        return jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    b, sq, h, dv = out.shape
    block_q = 32
    varlen = cu_q is not None
    (delta,) = _launch(
        _delta_kernel, (out, do, cu_q if varlen else _dummy(), sq), (jax.ShapeDtypeStruct((b, h, sq), jnp.float32),),
        (triton.cdiv(sq, block_q), _num_sequences(out, cu_q), h), num_warps=4, num_stages=1,
        zeroed_outputs=(0,) if varlen else (), interpret=st.interpret, NUM_HEADS=h, stride_os=h * dv,
        stride_oh=dv, DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_Q=block_q, IS_VARLEN=varlen)
    return delta


def _bwd_call(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed, st: _Static):
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    t = st.tuning
    varlen = cu_q is not None
    has_seg = q_seg is not None
    meta = _common_meta(q, k, v, st, has_seg, varlen)
    n_seq = _num_sequences(q, cu_q)
    delta = _delta(out, do, cu_q, st)
    args = (q, k, v, do, lse, delta, q_seg if has_seg else _dummy(), kv_seg if has_seg else _dummy(),
            cu_q if varlen else _dummy(), cu_k if varlen else _dummy(), _seed_arg(seed),
            np.float32(st.softmax_scale), np.float32(st.softcap or 1.0), sq, skv)
    zeroed = lambda n: tuple(range(n)) if varlen else ()  # noqa: E731  padding rows belong to no program
    dk, dv = _launch(
        _dkv_kernel, args, (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        (triton.cdiv(skv, t.dkv_block_kv), n_seq, hkv), num_warps=t.bwd_num_warps,
        num_stages=t.bwd_num_stages, zeroed_outputs=zeroed(2), interpret=st.interpret, **meta,
        BLOCK_Q=t.dkv_block_q, BLOCK_KV=t.dkv_block_kv)
    (dq,) = _launch(
        _dq_kernel, args, (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        (triton.cdiv(sq, t.dq_block_q), n_seq, h), num_warps=t.bwd_num_warps,
        num_stages=t.bwd_num_stages, zeroed_outputs=zeroed(1), interpret=st.interpret, **meta,
        BLOCK_Q=t.dq_block_q, BLOCK_KV=t.dq_block_kv, REVERSE_BLOCKS=st.causal and not varlen)
    return dq, dk, dv, delta


def _fold_batch_rule(call, batch_like: int, num_out: int, foldable: bool = True):
    """vmap rule: fold the vmapped axis into the batch axis of the first `batch_like` arguments.

    The remaining arguments (cum_seqlens, sinks, seed) must be unbatched for that; otherwise, for varlen
    (one packed sequence per call) and with dropout (its mask hashes the batch index), the rule loops over
    the vmapped axis with `lax.map`.
    """

    def rule(axis_size, in_batched, *args):
        shared_batched = any(bool(x) for x in jax.tree.leaves(in_batched[batch_like:]))
        varlen = any(a is not None for a in args[batch_like:batch_like + 2])
        if shared_batched or varlen or not foldable:
            bcast = [jax.tree.map(lambda a, bt: a if bt else jnp.broadcast_to(a, (axis_size, *a.shape)), x, bx)
                     if x is not None else None for x, bx in zip(args, in_batched)]
            outs = jax.lax.map(lambda xs: call(*xs), bcast)
            return outs, (True,) * num_out
        folded = []
        for x, bx in zip(args[:batch_like], in_batched[:batch_like]):
            if x is None:
                folded.append(None)
                continue
            if not bx:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        outs = call(*folded, *args[batch_like:])
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, (True,) * num_out

    return rule


@functools.lru_cache(maxsize=None)
def _batched_calls(st: _Static):
    """The forward and backward kernel calls for `st`, each with its vmap rule."""

    foldable = st.dropout_threshold == 0

    @jax.custom_batching.custom_vmap
    def fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed):
        return tuple(_fwd_call(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st))

    fwd.def_vmap(_fold_batch_rule(fwd, 5, 2, foldable))

    @jax.custom_batching.custom_vmap
    def bwd(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed):
        return tuple(_bwd_call(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed, st))

    bwd.def_vmap(_fold_batch_rule(bwd, 8, 4, foldable))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: _Static):
    return _attention_fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: _Static):
    fwd, _ = _batched_calls(st)
    out, lse = fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed)
    return out, (q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, out, lse)


def _attention_bwd(st: _Static, res, d_out):
    q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, out, lse = res
    _, bwd = _batched_calls(st)
    d_out = d_out.astype(q.dtype)
    # delta_i = <dO_i, O_i> = sum_j P_ij dP_ij comes back with the gradients (the sinks' need it).
    dq, dk, dv, delta = bwd(q, k, v, d_out, lse, out, q_seg, kv_seg, cu_q, cu_k, seed)
    d_aux = None
    if aux is not None:
        # d aux[h, s] = -sum_i P_sink[i, s] * delta_i, with P_sink = exp(aux - lse) (lse in log2 units).
        p_sink = jnp.exp2(aux[None, :, None, :] * LOG2E - lse[..., None])
        p_sink = jnp.where(delta[..., None] == 0.0, 0.0, p_sink)
        d_aux = -jnp.einsum("bhsk,bhs->hk", p_sink, delta).astype(aux.dtype)
    return dq, dk, dv, None, None, None, None, d_aux, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------------
# Public entry point (the canonical flash_attention signature) and its dispatcher attributes
# ----------------------------------------------------------------------------------------------------


def check_supported(query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None,
                    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None,
                    logits_soft_cap=None, dropout_prob=0.0, dropout_seed=None, cum_seqlens_q=None,
                    cum_seqlens_k=None, softmax_aux=None, cfg=None, **_):
    """Raise UnsupportedFeature for calls these kernels do not take (shapes and dtypes only)."""
    if bias is not None:
        raise UnsupportedFeature("triton flash_attention: bias is not implemented (use the XLA backend)")
    if attention_mask is not None:
        raise UnsupportedFeature("triton flash_attention: attention_mask is not implemented "
                                 "(use segment ids, causal or sliding_window, or the XLA backend)")
    if not 0.0 <= float(dropout_prob) < 1.0:
        raise UnsupportedFeature(f"triton flash_attention: dropout_prob {dropout_prob} outside [0, 1)")
    dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in tuple(map(jnp.dtype, SUPPORTED_DTYPES)):
        raise UnsupportedFeature(f"triton flash_attention: dtypes {sorted(map(str, dtypes))} not supported; "
                                 "query, key and value must share one of bfloat16, float16, float32")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise UnsupportedFeature("triton flash_attention: expects [batch, seq, heads, dim] inputs")
    d, dv = query.shape[-1], value.shape[-1]
    if not (8 <= d <= MAX_HEAD_DIM and 8 <= dv <= MAX_HEAD_DIM):
        raise UnsupportedFeature(f"triton flash_attention: head dims {d}/{dv} outside [8, {MAX_HEAD_DIM}]")
    if query.shape[2] % key.shape[2]:
        raise UnsupportedFeature("triton flash_attention: query heads must be a multiple of kv heads")
    if softmax_aux is not None and softmax_aux.ndim not in (1, 2):
        raise UnsupportedFeature("triton flash_attention: softmax_aux must be [H] or [H, K]")


def _tuning_from_cfg(cfg, query, value, causal: bool = False, tma: bool = False) -> Tuning:
    base = heuristic_tuning(query.shape[-1], value.shape[-1], query.dtype, causal=causal, tma=tma)
    fwd = getattr(cfg, "fwd_params", None)
    bwd = getattr(cfg, "bwd_params", None)
    pick = lambda obj, name, default: default if obj is None or getattr(obj, name, None) is None \
        else getattr(obj, name)  # noqa: E731
    return Tuning(
        fwd_block_q=pick(fwd, "q_blocksize", base.fwd_block_q),
        fwd_block_kv=pick(fwd, "kv_blocksize", base.fwd_block_kv),
        fwd_num_warps=pick(fwd, "num_warps", base.fwd_num_warps),
        fwd_num_stages=pick(fwd, "num_stages", base.fwd_num_stages),
        dkv_block_q=pick(bwd, "q_blocksize", base.dkv_block_q),
        dkv_block_kv=pick(bwd, "kv_blocksize", base.dkv_block_kv),
        dq_block_q=pick(bwd, "blocksize_m", base.dq_block_q),
        dq_block_kv=pick(bwd, "blocksize_n", base.dq_block_kv),
        bwd_num_warps=pick(bwd, "num_warps", base.bwd_num_warps),
        bwd_num_stages=pick(bwd, "num_stages", base.bwd_num_stages),
    )


def tuning_to_cfg(t: Tuning):
    """The FlashAttentionConfig that selects `t` (fwd/bwd params as docs/flash_attention.md defines)."""
    from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

    fwd = FwdParams(q_blocksize=t.fwd_block_q, kv_blocksize=t.fwd_block_kv, num_warps=t.fwd_num_warps,
                    num_stages=t.fwd_num_stages)
    bwd = BwdParams(q_blocksize=t.dkv_block_q, kv_blocksize=t.dkv_block_kv, blocksize_m=t.dq_block_q,
                    blocksize_n=t.dq_block_kv, num_warps=t.bwd_num_warps, num_stages=t.bwd_num_stages)
    from ejkernel.modules.operations.flash_attention import FlashAttentionConfig

    return FlashAttentionConfig(fwd_params=fwd, bwd_params=bwd, platform="triton")


def _invocation_qkv(inv):
    args = getattr(inv, "args", ())
    kwargs = getattr(inv, "kwargs", {}) or {}
    return tuple(args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key", "value")))


def _tma_applies_to_call(query, key, value, *, q_segment_ids=None, kv_segment_ids=None, cum_seqlens_q=None,
                         causal=False, sliding_window=None, dropout_prob=0.0, **_) -> bool:
    masked = bool(causal) or sliding_window is not None or q_segment_ids is not None or kv_segment_ids is not None
    return tma_forward_applies(query.shape[-1], value.shape[-1], query.dtype, masked=masked,
                               varlen=cum_seqlens_q is not None, dropout=bool(dropout_prob))


def _tma_heuristic(query, key, value, **kwargs) -> bool:
    """Whether the heuristic forward blocks are the TMA kernel's: it applies and its blocks tile the lengths."""
    return (_tma_applies_to_call(query, key, value, **kwargs) and query.shape[1] % TMA_FWD_DEFAULT[0] == 0
            and key.shape[1] % TMA_FWD_DEFAULT[1] == 0)


def heuristic_cfg(inv):
    query, key, value = _invocation_qkv(inv)
    kwargs = getattr(inv, "kwargs", {}) or {}
    return tuning_to_cfg(heuristic_tuning(query.shape[-1], value.shape[-1], query.dtype,
                                          causal=bool(kwargs.get("causal", False)),
                                          tma=_tma_heuristic(query, key, value, **kwargs)))


def config_space(inv):
    query, key, value = _invocation_qkv(inv)
    tma = _tma_heuristic(query, key, value, **(getattr(inv, "kwargs", {}) or {}))
    return [tuning_to_cfg(t) for t in tuning_space(query.shape[-1], value.shape[-1], query.dtype, tma=tma)]


def flash_attention(query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None,
                    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None,
                    logits_soft_cap=None, dropout_prob=0.0, dropout_seed=None, cum_seqlens_q=None,
                    cum_seqlens_k=None, softmax_aux=None, cfg=None):
    """Flash attention with the semantics of docs/flash_attention.md (see the module docstring)."""
    check_supported(query, key, value, bias, attention_mask=attention_mask, dropout_prob=dropout_prob or 0.0,
                    softmax_aux=softmax_aux)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    if sliding_window is None:
        left, right = -1, -1
    else:
        if isinstance(sliding_window, int):
            sliding_window = (sliding_window, sliding_window)
        left, right = (-1 if w is None else int(w) for w in sliding_window)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        if query.shape[1] != key.shape[1]:
            raise ValueError("give both q_segment_ids and kv_segment_ids when Sq != Skv")
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    if (cum_seqlens_q is None) != (cum_seqlens_k is None):
        raise ValueError("give both cum_seqlens_q and cum_seqlens_k, or neither")
    if cum_seqlens_q is not None and query.shape[0] != 1:
        raise ValueError("varlen (cum_seqlens) expects packed inputs of batch 1")
    as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
    aux = None
    if softmax_aux is not None:
        aux = jnp.asarray(softmax_aux, jnp.float32)
        aux = aux.reshape(query.shape[2], -1) if aux.ndim == 1 else aux
        if aux.shape[0] != query.shape[2]:
            raise ValueError(f"softmax_aux has {aux.shape[0]} heads, query has {query.shape[2]}")
    seed = None
    drop_threshold, drop_scale = 0, 1.0
    if dropout_prob:
        from ejkernel.ops.utils.dropout import threshold

        drop_threshold, drop_scale = threshold(float(dropout_prob)), 1.0 / (1.0 - float(dropout_prob))
        seed = 0 if dropout_seed is None else dropout_seed
        # The hash takes the seed's low 32 bits, as the shared mask does (wrapping conversion).
        seed = (jnp.uint32(seed & 0xFFFFFFFF) if isinstance(seed, int) else jnp.asarray(seed).astype(jnp.uint32))
        seed = seed.reshape(1)
    features = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, cum_seqlens_q=cum_seqlens_q,
                    causal=causal, sliding_window=sliding_window, dropout_prob=dropout_prob)
    tuning = _tuning_from_cfg(cfg, query, value, bool(causal), _tma_heuristic(query, key, value, **features))
    tma = _tma_applies_to_call(query, key, value, **features)
    st = _Static(
        softmax_scale=float(softmax_scale), causal=bool(causal), window_left=left, window_right=right,
        softcap=float(logits_soft_cap or 0.0), tuning=tuning, interpret=_interpret_requested(),
        dropout_threshold=drop_threshold, dropout_scale=drop_scale,
        tma_forward=tma and _uses_tma_forward(tuning, query.shape[1], key.shape[1]))
    out = _attention(query, key, value, as_i32(q_segment_ids), as_i32(kv_segment_ids), as_i32(cum_seqlens_q),
                     as_i32(cum_seqlens_k), aux, seed, st)
    return out


flash_attention.check_supported = check_supported
flash_attention.heuristic_cfg = heuristic_cfg
flash_attention.config_space = config_space


# ----------------------------------------------------------------------------------------------------
# Reference (float32, dense) and micro-benchmark
# ----------------------------------------------------------------------------------------------------


def _varlen_positions(cu, total):
    """Per packed token: sequence id (N for padding), local index, sequence length."""
    cu = jnp.asarray(cu, jnp.int32)
    t = jnp.arange(total)
    seq = jnp.searchsorted(cu[1:], t, side="right")
    valid = t < cu[-1]
    start = cu[jnp.minimum(seq, cu.shape[0] - 2)]
    length = cu[jnp.minimum(seq, cu.shape[0] - 2) + 1] - start
    return jnp.where(valid, seq, -1), t - start, length


def reference_attention(query, key, value, *, q_segment_ids=None, kv_segment_ids=None, softmax_scale=None,
                        causal=False, sliding_window=None, logits_soft_cap=None, cum_seqlens_q=None,
                        cum_seqlens_k=None, softmax_aux=None, dropout_prob=0.0, dropout_seed=None,
                        dtype=jnp.float32):
    """Dense attention in `dtype` with the same semantics (tests and the micro-benchmark)."""
    q, k, v = (x.astype(dtype) for x in (query, key, value))
    b, sq, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    k = jnp.repeat(k, h // hkv, axis=2)
    v = jnp.repeat(v, h // hkv, axis=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if logits_soft_cap:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if cum_seqlens_q is not None:
        qs, qi, ql = _varlen_positions(cum_seqlens_q, sq)
        ks, kj, kl = _varlen_positions(cum_seqlens_k, skv)
        ok = (qs[:, None] == ks[None, :]) & (qs[:, None] >= 0)
        pos = qi + (jnp.take(jnp.diff(jnp.asarray(cum_seqlens_k)), jnp.maximum(qs, 0)) - ql)
        j = kj
    else:
        ok = jnp.ones((sq, skv), bool)
        pos = jnp.arange(sq) + (skv - sq)
        j = jnp.arange(skv)
    if causal:
        ok &= j[None, :] <= pos[:, None]
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        if left is not None and left >= 0:
            ok &= j[None, :] >= pos[:, None] - left
        if right is not None and right >= 0:
            ok &= j[None, :] <= pos[:, None] + right
    ok = jnp.broadcast_to(ok[None, None], (b, 1, sq, skv))
    if q_segment_ids is not None:
        ok = ok & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if softmax_aux is not None:
        aux = jnp.asarray(softmax_aux, dtype).reshape(h, -1)
        m = jnp.maximum(m, jnp.max(aux, -1)[None, :, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux[None, :, None, :] - m), -1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    if dropout_prob:
        from ejkernel.ops.utils.dropout import keep_mask

        idx = jnp.ix_(jnp.arange(b), jnp.arange(h), jnp.arange(sq), jnp.arange(skv))
        keep = keep_mask(0 if dropout_seed is None else dropout_seed, *idx, dropout_prob)
        p = jnp.where(keep, p / (1.0 - dropout_prob), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(query.dtype)


def _benchmark(batch=8, seq=2048, heads=16, head_dim=128, causal=False, dtype=jnp.bfloat16):
    """Time forward and forward+backward on the visible GPU (wall clock, median of 20)."""
    import time

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, head_dim), dtype) for kk in keys)
    fwd = jax.jit(functools.partial(flash_attention, causal=causal))
    loss = lambda q, k, v: flash_attention(q, k, v, causal=causal).astype(jnp.float32).sum()  # noqa: E731
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    for name, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", bwd, 3.5)):
        jax.block_until_ready(fn(q, k, v))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        print(f"{name:8s} S={seq} causal={causal}: {ms:.3f} ms, {mult * flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    for c in (False, True):
        _benchmark(causal=c)
