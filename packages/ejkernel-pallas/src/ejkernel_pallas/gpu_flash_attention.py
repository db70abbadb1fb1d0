"""Flash attention for NVIDIA GPUs in Pallas (Triton lowering; Mosaic GPU on Hopper), forward and backward.

On a Hopper GPU the calls the Mosaic GPU kernels of :mod:`ejkernel_pallas.mosaic_attention` take
(bf16/fp16, head_dim 64 or 128, no dropout, varlen only with one ``cum_seqlens`` array) run through them over
the dense block schedules (every block of 128 x 128 the causal / window rules reach;
``GpuFlashTuning.mosaic_forward`` / ``mosaic_backward``, set by the heuristic there, and ``priority_for`` ranks
this implementation above the Triton backend's for those calls). Everything below describes the
Triton-lowered kernels, which serve every other call.

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``FlashAttentionCall`` and a
:class:`GpuFlashTuning` config. Semantics of docs/flash_attention.md for: causal, sliding window, soft cap,
GQA/MQA, segment ids, varlen (packed sequences through cum_seqlens), attention sinks, dropout (the shared
index-hash mask, recomputed in the backward). Bias, attention_mask, segment ids together with cum_seqlens
and head dims above 256 are refused with ``UnsupportedFeature`` (the dispatcher falls back; platform='xla'
takes them). On CPU it runs only in interpret mode ``gpu`` (:mod:`ejkernel_pallas.interpret`).

Precision: the Triton lowering runs a float32 dot as TF32 for ``DEFAULT`` (and, in jax 0.11, also for
``HIGH``, below the bf16x3-class accuracy ``HIGH`` promises) and as IEEE float32 for ``HIGHEST``. Float32
calls therefore run their dots at TF32 when the caller asked for ``precision="default"`` and at IEEE
float32 otherwise (``HIGHEST``, the float32 default, and ``HIGH``: more precise than asked, which the
policy allows); no precision is refused. 16-bit operands multiply exactly into float32 accumulators.

Arrays stay in the public [B, S, H, D] layout (blocks are strided row loads); lengths are padded to whole
blocks and head dims to powers of two inside the wrapper. Each program owns one query block (forward, dQ)
or one KV block (dK/dV) and loops over the other axis in three ranges: blocks before and after the ones a
mask can touch run the mask-free body, which keeps the common causal case at one masked diagonal band.
The forward works in base 2 (exp2 with log2(e) folded into the scale) when there is no soft cap.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel.ops.utils import dropout as dropout_hash
from ejkernel.ops.utils.block_sparse import BlockSchedule, schedule_blocks
from ejkernel.ops.utils.varlen import packed_keys, packed_queries

from ejkernel_pallas import mosaic_attention
from ejkernel_pallas.interpret import gpu_interpret_or_refuse, interpret_mode

LOG2E = math.log2(math.e)
MOSAIC_BLOCK = 128  # the Mosaic GPU kernels' blocks when they run dense attention


# ---------------------------------------------------------------------------------------------------
# Tuning


@dataclasses.dataclass(frozen=True)
class GpuFlashTuning:
    """The GPU kernels' config: blocks (powers of two, >= 16) and Triton launch parameters of the forward
    (``fwd_*``), the dK/dV pass (``dkv_*``) and the dQ pass (``dq_*``; both backward kernels share warps and
    stages). Used as given (lengths are padded to whole blocks); :func:`heuristic_tuning` fits the
    defaults to a call. ``mosaic_forward`` / ``mosaic_backward``: run the forward / the backward as the Mosaic
    GPU kernels of :mod:`ejkernel_pallas.mosaic_attention` wherever they can take the call (a
    Hopper GPU; their own tiles: 128 query rows per program, key blocks of 128 (block-sparse: the mask's),
    ``mosaic_stages`` K/V slots), the Triton-lowered kernels elsewhere; either takes the other's output (same
    LSE)."""

    # Measured on an H200 (bf16, D=128, S=8k; benchmarks/gpu_flash_h200_run2.json): forward 128x64 with
    # 4 warps and 2 stages was the fastest of five tilings; in the backward 64x64 blocks with 4 warps beat
    # 128-wide ones by 1.3-2x (the f32 dK/dV accumulators of wider blocks spill) and 2 stages beat 3.
    fwd_q: int = 128
    fwd_kv: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 2
    dkv_q: int = 64
    dkv_kv: int = 64
    dq_q: int = 64
    dq_kv: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 2
    mosaic_forward: bool = False
    mosaic_stages: int = 2
    mosaic_backward: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("mosaic_forward", "mosaic_backward"):
                if not isinstance(value, bool):
                    raise ValueError(f"GpuFlashTuning.{field.name} must be a bool, got {value!r}")
                continue
            if field.name == "mosaic_stages" and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ValueError(f"GpuFlashTuning.mosaic_stages must be an int >= 2, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GpuFlashTuning.{field.name} must be a positive int, got {value!r}")
            if field.name.endswith(("_q", "_kv")) and (value & (value - 1) or value < 16):
                raise ValueError(f"GpuFlashTuning.{field.name}={value}: Triton blocks are powers of two >= 16")
            if field.name.endswith("_warps") and value & (value - 1):
                raise ValueError(f"GpuFlashTuning.{field.name}={value}: num_warps must be a power of two")


def _fit(block: int, length: int) -> int:
    """Shrink a block to the smallest power of two >= 16 covering ``length`` (short sequences)."""
    return max(16, min(block, pl.next_power_of_2(length)))


def fitted(tuning: GpuFlashTuning, sq: int, skv: int) -> GpuFlashTuning:
    """``tuning`` with its blocks shrunk to short sequences (a block never exceeds its padded length)."""
    return dataclasses.replace(
        tuning, fwd_q=_fit(tuning.fwd_q, sq), fwd_kv=_fit(tuning.fwd_kv, skv), dkv_q=_fit(tuning.dkv_q, sq),
        dkv_kv=_fit(tuning.dkv_kv, skv), dq_q=_fit(tuning.dq_q, sq), dq_kv=_fit(tuning.dq_kv, skv),
    )


def heuristic_tuning(sq: int, skv: int) -> GpuFlashTuning:
    """The H200 defaults (:class:`GpuFlashTuning`), fitted to the lengths."""
    return fitted(GpuFlashTuning(), sq, skv)


# Autotuning candidates: the tilings of the H200 sweep (NOTES.md, runs 1-2) that came within ~30% of the
# best, fastest first; fitted to the call's lengths (duplicates dropped).
_SWEEP = (
    GpuFlashTuning(),  # fwd 128x64 w4 s2, bwd 64x64 w4 s2 (the defaults)
    GpuFlashTuning(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3),
    GpuFlashTuning(bwd_stages=3),
    GpuFlashTuning(fwd_q=64, fwd_kv=64, fwd_stages=3, bwd_stages=3),
    GpuFlashTuning(dkv_q=64, dkv_kv=128, dq_q=128, dq_kv=64, bwd_warps=8),
)


def candidate_tunings(sq: int, skv: int) -> list[GpuFlashTuning]:
    """Pruned autotuning candidates for this call's lengths (see ``_SWEEP``), the heuristic first."""
    return list(dict.fromkeys(fitted(t, sq, skv) for t in _SWEEP))


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    sq: int
    skv: int
    q_offset: int
    groups: int
    varlen: bool
    has_segments: bool
    num_sinks: int  # padded count (power of two), 0 = none
    tuning: GpuFlashTuning
    interpret: bool
    # float32: delta_i = <dO_i, O_i> is recomputed in-kernel with the same dot as dP_ij = <dO_i, V_j>, so
    # a row that sees one key gets dS = P * (dP - delta) == 0 exactly (its true gradient), not rounding noise.
    exact_delta: bool = False
    dropout_prob: float = 0.0
    precision: lax.Precision | None = None  # of the float32 dots (see the module docstring)
    # block-sparse attention (ejkernel_pallas.blocksparse_attention): the (mask_batch, mask_heads) of the
    # schedules "sched_q" / "sched_kv" that drive the block loops instead of the causal/window ranges
    schedule_dims: tuple[int, int] | None = None
    schedule_width: int = 0  # entries per schedule row (a power of two)
    mask_blocks: tuple[int, int] = (0, 0)  # (q, kv) mask blocks: multiples of the kernel's blocks
    # the Mosaic GPU forward (ejkernel_pallas.mosaic_attention) with this many K/V slots (0: the
    # Triton-lowered forward), and its backward kernels; both walk the schedules "sched_q" / "sched_kv"
    mosaic_stages: int = 0
    mosaic_backward: bool = False

    @property
    def statically_masked(self) -> bool:
        return self.varlen or self.has_segments


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, length: int, value=0):
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


# ---------------------------------------------------------------------------------------------------
# Which blocks a mask can touch


def _kv_ranges(st: _Static, qi, block_q: int, block_kv: int, num_kv: int):
    """(lo, full_lo, full_hi, hi): KV blocks [lo, hi) are visible to query block ``qi``; those in
    [full_lo, full_hi) are visible to every row of it (no mask needed)."""
    if st.varlen:
        return 0, 0, 0, num_kv
    q_first = qi * block_q + st.q_offset
    q_last = q_first + block_q - 1
    lo, hi = 0, num_kv
    last_allowed = st.skv - 1  # the last KV column every row may see
    if st.causal:
        hi = jnp.minimum(hi, (q_last + block_kv) // block_kv)
        last_allowed = jnp.minimum(last_allowed, q_first)
    if st.window is not None:
        left, right = st.window
        hi = jnp.minimum(hi, (q_last + right + block_kv) // block_kv)
        lo = jnp.maximum(lo, (q_first - left) // block_kv)
        last_allowed = jnp.minimum(last_allowed, q_first + right)
    hi = jnp.maximum(hi, 0)
    lo = jnp.clip(lo, 0, hi)
    if st.has_segments:
        return lo, lo, lo, hi
    full_lo = lo
    if st.window is not None:
        full_lo = jnp.maximum(lo, -(-(q_last - st.window[0]) // block_kv))
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip((last_allowed + 1) // block_kv, full_lo, hi)
    return lo, full_lo, full_hi, hi


def _q_ranges(st: _Static, ki, block_q: int, block_kv: int, num_q: int):
    """(lo, full_lo, full_hi, hi) over query blocks for KV block ``ki`` (the transpose of _kv_ranges)."""
    if st.varlen:
        return 0, 0, 0, num_q
    kv_first = ki * block_kv
    kv_last = kv_first + block_kv - 1
    off = st.q_offset
    lo, hi = 0, num_q
    full_lo, full_hi = 0, num_q
    if st.causal:
        lo = jnp.maximum(lo, (kv_first - off) // block_q)
        full_lo = jnp.maximum(full_lo, -(-(kv_last - off) // block_q))
    if st.window is not None:
        left, right = st.window
        lo = jnp.maximum(lo, (kv_first - off - right) // block_q)
        full_lo = jnp.maximum(full_lo, -(-(kv_last - off - right) // block_q))
        hi = jnp.minimum(hi, (kv_last - off + left) // block_q + 1)
        full_hi = jnp.minimum(full_hi, (kv_first - block_q + 1 - off + left) // block_q + 1)
    hi = jnp.maximum(hi, 0)
    lo = jnp.clip(lo, 0, hi)
    if st.has_segments:
        return lo, lo, lo, hi
    padded_block = kv_first + block_kv > st.skv
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    full_hi = jnp.where(padded_block, full_lo, full_hi)
    return lo, full_lo, full_hi, hi


def _mask(st: _Static, q_rows, kv_cols, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility of a (rows, cols) block; positions/segments are None unless the call has them."""
    mask = kv_cols[None, :] < st.skv
    if q_pos is None:
        q_pos, kv_pos = q_rows + st.q_offset, kv_cols
    if st.causal:
        mask &= kv_pos[None, :] <= q_pos[:, None]
    if st.window is not None:
        left, right = st.window
        mask &= (kv_pos[None, :] >= q_pos[:, None] - left) & (kv_pos[None, :] <= q_pos[:, None] + right)
    if q_seg is not None:
        mask &= q_seg[:, None] == kv_seg[None, :]
    return mask


def _run_ranges(body, ranges, carry):
    lo, full_lo, full_hi, hi = ranges
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(body, True), carry)


def gpu_schedule(schedule: BlockSchedule, width: int) -> jax.Array:
    """int32 ``[mask_batch, mask_heads, rows, width]``: per row the number of partial visits, the number of
    full ones, then their column blocks (partial ones first, each group ascending; zeros after). ``width``
    (a power of two: Triton blocks) >= 2 + max_visits. ``schedule``: ``block_schedule(..., order="partial_first")``
    (the helper's one sort puts each row's partial blocks first)."""
    visits = schedule.indices.shape[3]
    real = jnp.arange(visits, dtype=jnp.int32) < schedule.counts[..., None]
    columns = jnp.where(real, schedule.indices, 0)
    partial = jnp.sum(real & schedule.partial, axis=3, dtype=jnp.int32)
    row = jnp.concatenate([partial[..., None], (schedule.counts - partial)[..., None], columns], axis=3)
    return _pad_axis(row.astype(jnp.int32), 3, width)


def _run_schedule(row, body, carry, sub: int):
    """``body(masked, block, carry)`` over one row of a block-sparse schedule
    (:func:`gpu_schedule`): ``row[0]`` partial visits then ``row[1]``
    full ones, their mask blocks from ``row[2]`` on; each mask block is ``sub`` kernel blocks. Two plain
    loops over kernel tiles (masked, then mask-free; no branch inside). The mask block of the next tile is
    read one iteration ahead into the carry: loaded in the iteration that uses it, Triton 3.6's pipeliner
    gives that load a stage of its own and the K/V tiles arrive one stage ahead only (the Triton backend's
    finding, ``ejkernel_triton.blocksparse_attention``)."""
    last = row.shape[0] - 3  # the last visit slot of the row

    def visit_of(tile):  # tiles are non-negative: truncating division and remainder are the floored ones
        return tile if sub == 1 else lax.div(tile, jnp.int32(sub))

    def block_of(tile):
        return row[2 + jnp.minimum(visit_of(tile), last)]

    def tiles(masked):
        def step(tile, state):
            c, block = state
            kernel_block = block if sub == 1 else block * sub + lax.rem(tile, jnp.int32(sub))
            c = body(masked, kernel_block, c)
            return c, block_of(tile + 1)

        return step

    partial, total = row[0] * sub, (row[0] + row[1]) * sub
    carry, _ = lax.fori_loop(0, partial, tiles(True), (carry, block_of(0)))
    carry, _ = lax.fori_loop(partial, total, tiles(False), (carry, block_of(partial)))
    return carry


def _loop(r, schedule: str, body, ranges, carry, sub: int = 1):
    """The block loop of a kernel: the schedule's row when the call is block-sparse, else ``ranges``."""
    if schedule in r:
        return _run_schedule(r[schedule], body, carry, sub)
    return _run_ranges(body, ranges, carry)


def _dot(st: _Static, a, b, a_axis: int, b_axis: int):
    """``a`` times ``b`` (2-D tiles) contracting ``a_axis`` with ``b_axis``, accumulated in float32."""
    dims = (((a_axis,), (b_axis,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=st.precision, preferred_element_type=jnp.float32)


def _dropout_keep(st: _Static, r, batch, head, q_rows, kv_cols):
    """The shared dropout mask (ejkernel.ops.utils.dropout) of a (rows, cols) block of this (batch, head).

    ``batch``/``head`` are read at the kernel's top level (program ids cannot be read inside loops in
    interpret mode)."""
    seed = r["seed"][0]
    return dropout_hash.keep_mask(seed, batch, head, q_rows[:, None], kv_cols[None, :], st.dropout_prob)


def _row_dot(st: _Static, a, b):
    """Row-wise <a_i, b_i> through the same tiled dot as the (rows, cols) products."""
    products = _dot(st, a, b, 1, 1)
    rows = lax.broadcasted_iota(jnp.int32, products.shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, products.shape, 1)
    return jnp.sum(jnp.where(rows == cols, products, 0.0), axis=1)


def _optional(r, name, index=...):
    return r[name][index] if name in r else None


# ---------------------------------------------------------------------------------------------------
# Forward kernel: one program per (query block, batch, head)


def _fwd_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.tuning.fwd_q, st.tuning.fwd_kv
    qi, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_kv = r["k"].shape[0] // block_kv
    q = r["q"][...]
    q_rows = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    q_pos, q_seg = _optional(r, "q_pos"), _optional(r, "q_seg")
    base2 = st.soft_cap is None
    # Logits in base 2 when possible: exp2(x * log2e) == exp(x), one multiply saved per element.
    logit_scale = st.scale * LOG2E if base2 else st.scale

    if st.num_sinks:
        sinks = r["sinks"][...].astype(jnp.float32) * (LOG2E if base2 else 1.0)
        m0 = jnp.max(sinks)
        l0 = jnp.sum(jnp.exp2(sinks - m0) if base2 else jnp.exp(sinks - m0))
        m_init = jnp.full((block_q,), m0, jnp.float32)
        l_init = jnp.full((block_q,), l0, jnp.float32)
    else:
        m_init = jnp.full((block_q,), -jnp.inf, jnp.float32)
        l_init = jnp.zeros((block_q,), jnp.float32)
    acc_init = jnp.zeros((block_q, r["v"].shape[-1]), jnp.float32)

    def body(masked, kj, carry):
        m_prev, l_prev, acc = carry
        cols = pl.ds(kj * block_kv, block_kv)
        k = r["k"][cols, :]
        s = _dot(st, q, k, 1, 1) * logit_scale
        if st.soft_cap is not None:
            s = st.soft_cap * jnp.tanh(s / st.soft_cap)
        if masked:
            kv_cols = kj * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            mask = _mask(st, q_rows, kv_cols, q_pos, _optional(r, "kv_pos", cols), q_seg, _optional(r, "kv_seg", cols))
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new  # unmasked rows see finite logits
        if base2:
            p = jnp.exp2(s - m_safe[:, None])
            alpha = jnp.exp2(m_prev - m_safe)
        else:
            p = jnp.exp(s - m_safe[:, None])
            alpha = jnp.exp(m_prev - m_safe)
        v = r["v"][cols, :]
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        if st.dropout_prob > 0.0:
            kv_cols = kj * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            keep = _dropout_keep(st, r, batch, head, q_rows, kv_cols)
            p = jnp.where(keep, p * (1.0 / (1.0 - st.dropout_prob)), 0.0)
        acc = acc * alpha[:, None] + _dot(st, p.astype(v.dtype), v, 1, 0)
        return m_new, l_new, acc

    ranges = _kv_ranges(st, qi, block_q, block_kv, num_kv)
    m, l, acc = _loop(r, "sched_q", body, ranges, (m_init, l_init, acc_init), st.mask_blocks[1] // block_kv)
    has_mass = l > 0.0
    safe_l = jnp.where(has_mass, l, 1.0)
    r["out"][...] = jnp.where(has_mass[:, None], acc / safe_l[:, None], 0.0).astype(r["out"].dtype)
    m_nat = jnp.where(m == -jnp.inf, 0.0, m) * ((1.0 / LOG2E) if base2 else 1.0)
    r["lse_out"][...] = jnp.where(has_mass, m_nat + jnp.log(safe_l), 0.0)


# ---------------------------------------------------------------------------------------------------
# Backward kernels


def _recompute(st: _Static, q, k, lse, masked, q_rows, kv_cols, q_pos, kv_pos, q_seg, kv_seg):
    """Probabilities of a (q block, kv block), and the soft-cap derivative factor (or None)."""
    s = _dot(st, q, k, 1, 1) * st.scale
    cap_grad = None
    if st.soft_cap is not None:
        t = jnp.tanh(s / st.soft_cap)
        s = st.soft_cap * t
        cap_grad = 1.0 - t * t
    p = jnp.exp(s - lse[:, None])
    if masked:
        p = jnp.where(_mask(st, q_rows, kv_cols, q_pos, kv_pos, q_seg, kv_seg), p, 0.0)
    return p, cap_grad


def _dkv_kernel(*refs, st: _Static, names):
    """One program per (KV block, batch, query head): dK, dV contributions of that query head."""
    r = dict(zip(names, refs))
    block_q, block_kv = st.tuning.dkv_q, st.tuning.dkv_kv
    kj, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_q = r["q"].shape[0] // block_q
    k, v = r["k"][...], r["v"][...]
    kv_cols = kj * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    kv_pos, kv_seg = _optional(r, "kv_pos"), _optional(r, "kv_seg")

    def body(masked, qi, carry):
        dk, dv = carry
        rows = pl.ds(qi * block_q, block_q)
        q, do = r["q"][rows, :], r["do"][rows, :]
        q_rows = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        p, cap_grad = _recompute(
            st, q, k, r["lse"][rows], masked, q_rows, kv_cols,
            _optional(r, "q_pos", rows), kv_pos, _optional(r, "q_seg", rows), kv_seg,
        )
        dp = _dot(st, do, v, 1, 1)
        p_dropped = p
        if st.dropout_prob > 0.0:
            keep = _dropout_keep(st, r, batch, head, q_rows, kv_cols)
            scale = 1.0 / (1.0 - st.dropout_prob)
            p_dropped = jnp.where(keep, p * scale, 0.0)
            dp = jnp.where(keep, dp * scale, 0.0)
        dv = dv + _dot(st, p_dropped.astype(do.dtype), do, 0, 0)
        delta = _row_dot(st, do, r["o"][rows, :]) if st.exact_delta else r["delta"][rows]
        ds = p * (dp - delta[:, None])
        if cap_grad is not None:
            ds = ds * cap_grad
        dk = dk + _dot(st, ds.astype(q.dtype), q, 0, 0)
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = _loop(r, "sched_kv", body, _q_ranges(st, kj, block_q, block_kv, num_q), init, st.mask_blocks[0] // block_q)
    r["dk_out"][...] = (dk * st.scale).astype(r["dk_out"].dtype)
    r["dv_out"][...] = dv.astype(r["dv_out"].dtype)


def _dq_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.tuning.dq_q, st.tuning.dq_kv
    qi, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_kv = r["k"].shape[0] // block_kv
    q, do, lse = r["q"][...], r["do"][...], r["lse"][...]
    delta = _row_dot(st, do, r["o"][...]) if st.exact_delta else r["delta"][...]
    q_rows = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    q_pos, q_seg = _optional(r, "q_pos"), _optional(r, "q_seg")

    def body(masked, kj, dq):
        cols = pl.ds(kj * block_kv, block_kv)
        k, v = r["k"][cols, :], r["v"][cols, :]
        kv_cols = kj * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        p, cap_grad = _recompute(
            st, q, k, lse, masked, q_rows, kv_cols, q_pos, _optional(r, "kv_pos", cols), q_seg,
            _optional(r, "kv_seg", cols),
        )
        dp = _dot(st, do, v, 1, 1)
        if st.dropout_prob > 0.0:
            keep = _dropout_keep(st, r, batch, head, q_rows, kv_cols)
            dp = jnp.where(keep, dp * (1.0 / (1.0 - st.dropout_prob)), 0.0)
        ds = p * (dp - delta[:, None])
        if cap_grad is not None:
            ds = ds * cap_grad
        return dq + _dot(st, ds.astype(k.dtype), k, 1, 0)

    dq = _loop(r, "sched_q", body, _kv_ranges(st, qi, block_q, block_kv, num_kv), jnp.zeros(q.shape, jnp.float32),
               st.mask_blocks[1] // block_kv)
    r["dq_out"][...] = (dq * st.scale).astype(r["dq_out"].dtype)


# ---------------------------------------------------------------------------------------------------
# pallas_call plumbing


def _spec_table(st: _Static, bq: int, whole_q: int, whole_kv: int, d: int, dv: int, q_whole: bool, kv_whole: bool, bkv: int):
    """BlockSpecs over grid (block, b, h): the per-program block on one side, whole rows on the other."""
    g = st.groups
    q_rows = whole_q if q_whole else bq
    kv_rows = whole_kv if kv_whole else bkv
    q_index = (lambda i, b, h: (b, 0, h, 0)) if q_whole else (lambda i, b, h: (b, i, h, 0))
    kv_index = (lambda i, b, h: (b, 0, h // g, 0)) if kv_whole else (lambda i, b, h: (b, i, h // g, 0))
    q_vec = (lambda i, b, h: (b, 0)) if q_whole else (lambda i, b, h: (b, i))
    kv_vec = (lambda i, b, h: (b, 0)) if kv_whole else (lambda i, b, h: (b, i))
    lse_index = (lambda i, b, h: (b, h, 0)) if q_whole else (lambda i, b, h: (b, h, i))
    table = {}
    if st.schedule_dims is not None:  # one schedule row per program: (b, h, its mask block) of [B', H', rows, W]
        mb, mh = st.schedule_dims
        ratio = st.mask_blocks[0] // bq if not q_whole else st.mask_blocks[1] // bkv  # kernel blocks per mask block
        row = lambda i, b, h: (b if mb > 1 else 0, h if mh > 1 else 0, i // ratio, 0)  # noqa: E731
        table["sched_q"] = table["sched_kv"] = pl.BlockSpec((None, None, None, st.schedule_width), row)
    return table | {
        "q": pl.BlockSpec((None, q_rows, None, d), q_index),
        "do": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "out": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "o": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "k": pl.BlockSpec((None, kv_rows, None, d), kv_index),
        "v": pl.BlockSpec((None, kv_rows, None, dv), kv_index),
        # dK/dV are produced per query head and summed over the GQA group outside.
        "dk": pl.BlockSpec((None, kv_rows, None, d), lambda i, b, h: (b, i, h, 0)),
        "dv": pl.BlockSpec((None, kv_rows, None, dv), lambda i, b, h: (b, i, h, 0)),
        "lse": pl.BlockSpec((None, None, q_rows), lse_index),
        "delta": pl.BlockSpec((None, None, q_rows), lse_index),
        "q_pos": pl.BlockSpec((None, q_rows), q_vec),
        "q_seg": pl.BlockSpec((None, q_rows), q_vec),
        "kv_pos": pl.BlockSpec((None, kv_rows), kv_vec),
        "kv_seg": pl.BlockSpec((None, kv_rows), kv_vec),
        "sinks": pl.BlockSpec((None, st.num_sinks), lambda i, b, h: (h, 0)),
        "seed": pl.BlockSpec((1,), lambda i, b, h: (0,)),
    }


_META = ("q_pos", "kv_pos", "q_seg", "kv_seg", "seed")
_SCHEDULES = ("sched_q", "sched_kv")  # block-sparse: the forward and dQ use sched_q, the dK/dV pass sched_kv


def _forward(st: _Static, arrays: dict):
    if st.mosaic_stages:
        sinks = arrays.get("sinks")
        return mosaic_attention.forward(
            arrays["q"], arrays["k"], arrays["v"], arrays["sched_q"], _mosaic_segments(arrays),
            None if sinks is None else mosaic_attention.sink_statistics(sinks),
            **_mosaic_static(st, st.mosaic_stages),
        )
    q, v = arrays["q"], arrays["v"]
    batch, sq_pad, heads, d = q.shape
    skv_pad, dv = v.shape[1], v.shape[3]
    t = st.tuning
    table = _spec_table(st, t.fwd_q, sq_pad, skv_pad, d, dv, q_whole=False, kv_whole=True, bkv=t.fwd_kv)
    names = [n for n in ("q", "k", "v", *_META, "sinks", "sched_q") if n in arrays]
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, names=names + ["out", "lse_out"]),
        grid=(sq_pad // t.fwd_q, batch, heads),
        in_specs=[table[n] for n in names],
        out_specs=[table["out"], table["lse"]],
        out_shape=[
            jax.ShapeDtypeStruct((batch, sq_pad, heads, dv), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=t.fwd_warps, num_stages=t.fwd_stages),
        interpret=st.interpret,
        name="ejkernel_gpu_flash_fwd",
    )(*[arrays[n] for n in names])
    return out, lse


def _mosaic_static(st: _Static, stages: int) -> dict:
    """The static arguments of the Mosaic GPU block-sparse kernels."""
    return dict(scale=st.scale, causal=st.causal, window=st.window, soft_cap=st.soft_cap, q_len=st.sq,
                kv_len=st.skv, kv_block=st.mask_blocks[1], schedule_dims=st.schedule_dims, stages=stages)


def _mosaic_segments(arrays: dict):
    return (arrays["q_seg"], arrays["kv_seg"]) if "q_seg" in arrays else None


def _delta(out, d_out):
    """delta [B, H, S] = <dO_i, O_i>, elementwise in float32 (an einsum could run as a TF32 matmul on a GPU)."""
    return jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)


def _backward(st: _Static, arrays: dict, out, lse, d_out):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    batch, sq_pad, heads, d = q.shape
    skv_pad, kv_heads, dv = k.shape[1], k.shape[2], v.shape[3]
    t = st.tuning
    delta = _delta(out, d_out)
    if st.mosaic_backward:
        return mosaic_attention.backward(
            q, k, v, d_out, lse, delta, arrays["sched_q"], arrays["sched_kv"], _mosaic_segments(arrays),
            **_mosaic_static(st, 2),
        )
    inputs = {**arrays, "do": d_out, "lse": lse, "delta": delta}
    if st.exact_delta:
        inputs["o"] = out
    names = [n for n in ("q", "k", "v", "do", "o", "lse", "delta", *_META) if n in inputs]
    dkv_names = names + [n for n in ("sched_kv",) if n in inputs]
    dq_names = names + [n for n in ("sched_q",) if n in inputs]
    params = pltriton.CompilerParams(num_warps=t.bwd_warps, num_stages=t.bwd_stages)

    table = _spec_table(st, t.dkv_q, sq_pad, skv_pad, d, dv, q_whole=True, kv_whole=False, bkv=t.dkv_kv)
    grad_dtype = k.dtype if st.groups == 1 else jnp.float32
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, names=dkv_names + ["dk_out", "dv_out"]),
        grid=(skv_pad // t.dkv_kv, batch, heads),
        in_specs=[table[n] for n in dkv_names],
        out_specs=[table["dk"], table["dv"]],
        out_shape=[
            jax.ShapeDtypeStruct((batch, skv_pad, heads, d), grad_dtype),
            jax.ShapeDtypeStruct((batch, skv_pad, heads, dv), grad_dtype),
        ],
        compiler_params=params,
        interpret=st.interpret,
        name="ejkernel_gpu_flash_dkv",
    )(*[inputs[n] for n in dkv_names])
    if st.groups > 1:
        dk = dk.reshape(batch, skv_pad, kv_heads, st.groups, d).sum(axis=3).astype(k.dtype)
        dv_ = dv_.reshape(batch, skv_pad, kv_heads, st.groups, dv).sum(axis=3).astype(v.dtype)

    table = _spec_table(st, t.dq_q, sq_pad, skv_pad, d, dv, q_whole=False, kv_whole=True, bkv=t.dq_kv)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, names=dq_names + ["dq_out"]),
        grid=(sq_pad // t.dq_q, batch, heads),
        in_specs=[table[n] for n in dq_names],
        out_specs=table["q"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=st.interpret,
        name="ejkernel_gpu_flash_dq",
    )(*[inputs[n] for n in dq_names])
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, arrays: dict):
    return _forward(st, arrays)[0]


def _attention_fwd(st, arrays):
    out, lse = _forward(st, arrays)
    return out, (arrays, out, lse)


def _attention_bwd(st, residuals, d_out):
    arrays, out, lse = residuals
    dq, dk, dv = _backward(st, arrays, out, lse, d_out)
    grads = {}
    for name, value in arrays.items():
        if name in ("q", "k", "v"):
            grads[name] = {"q": dq, "k": dk, "v": dv}[name]
        elif name == "sinks":
            # d/d sink = -sum_i exp(sink - lse_i) * delta_i (padded sinks are -inf: zero gradient).
            delta = _delta(out, d_out)
            p_sink = jnp.exp(value.astype(jnp.float32)[None, :, None, :] - lse[..., None])
            grads[name] = (-jnp.sum(p_sink * delta[..., None], axis=(0, 2))).astype(value.dtype)
        else:
            grads[name] = None
    return (grads,)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------------
# The implementation: a validated FlashAttentionCall (ejkernel.modules.operations.flash_attention)


def _float32_precision(call: FlashAttentionCall):
    """The precision of a float32 call's dots (see the module docstring); None for 16-bit inputs."""
    if call.query.dtype != jnp.float32:
        return None
    return lax.Precision.DEFAULT if call.precision == lax.Precision.DEFAULT else lax.Precision.HIGHEST


def _flash(call: FlashAttentionCall, tuning: GpuFlashTuning, interpret: bool) -> jax.Array:
    query, key, value = call.query, call.key, call.value
    batch, sq, heads, d = query.shape
    skv, kv_heads, dv = key.shape[1], key.shape[2], value.shape[3]
    mosaic = tuning.mosaic_forward or tuning.mosaic_backward  # run as every block of MOSAIC_BLOCK x MOSAIC_BLOCK
    floor = MOSAIC_BLOCK if mosaic else 16
    sq_pad = _round_up(sq, max(tuning.fwd_q, tuning.dkv_q, tuning.dq_q, floor))
    skv_pad = _round_up(skv, max(tuning.fwd_kv, tuning.dkv_kv, tuning.dq_kv, floor))
    d_pad, dv_pad = max(16, pl.next_power_of_2(d)), max(16, pl.next_power_of_2(dv))
    arrays = {
        "q": _pad_axis(_pad_axis(query, 1, sq_pad), 3, d_pad),
        "k": _pad_axis(_pad_axis(key, 1, skv_pad), 3, d_pad),
        "v": _pad_axis(_pad_axis(value, 1, skv_pad), 3, dv_pad),
    }
    varlen = call.cum_seqlens_q is not None
    if varlen:
        q_seq, q_pos, q_exists = packed_queries(call.cum_seqlens_q, call.cum_seqlens_k, sq_pad)
        kv_seq, kv_pos, kv_exists = packed_keys(call.cum_seqlens_k, skv_pad)
        # tokens past the packed ends are in no sequence (and distinct ones on the two sides)
        arrays.update(q_pos=q_pos[None], kv_pos=kv_pos[None], q_seg=jnp.where(q_exists, q_seq, -1)[None],
                      kv_seg=jnp.where(kv_exists, kv_seq, -2)[None])
    elif call.q_segment_ids is not None:
        arrays["q_seg"] = _pad_axis(call.q_segment_ids, 1, sq_pad)
        arrays["kv_seg"] = _pad_axis(call.kv_segment_ids, 1, skv_pad)
    if call.dropout_prob > 0.0:  # int32 in the kernel: the seed's 32 bits, reinterpreted
        arrays["seed"] = lax.bitcast_convert_type(dropout_hash.seed_bits(call.dropout_seed), jnp.int32).reshape(1)
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = max(16, pl.next_power_of_2(sinks.shape[1]))
        arrays["sinks"] = _pad_axis(sinks, 1, num_sinks, value=-jnp.inf)
    schedule = {}
    if mosaic:  # the dense block schedules (built with numpy at trace time): the kernels' loops walk them
        rows = [schedule_blocks(None, sq, skv, MOSAIC_BLOCK, MOSAIC_BLOCK, causal=call.causal,
                                sliding_window=call.sliding_window, segments="q_seg" in arrays,
                                by=by, order="partial_first") for by in ("q", "kv")]
        width = pl.next_power_of_2(2 + max(r.indices.shape[3] for r in rows))
        arrays.update(sched_q=gpu_schedule(rows[0], width), sched_kv=gpu_schedule(rows[1], width))
        schedule = dict(schedule_dims=(1, 1), schedule_width=width, mask_blocks=(MOSAIC_BLOCK, MOSAIC_BLOCK),
                        mosaic_stages=tuning.mosaic_stages if tuning.mosaic_forward else 0,
                        mosaic_backward=tuning.mosaic_backward)
    st = _Static(
        scale=call.softmax_scale,
        causal=call.causal,
        window=call.sliding_window,
        soft_cap=call.logits_soft_cap,
        sq=sq,
        skv=skv,
        q_offset=skv - sq,
        groups=heads // kv_heads,
        varlen=varlen,
        has_segments=varlen or call.q_segment_ids is not None,
        num_sinks=num_sinks,
        tuning=tuning,
        interpret=interpret,
        exact_delta=query.dtype == jnp.float32,
        dropout_prob=call.dropout_prob,
        precision=_float32_precision(call),
        **schedule,
    )
    out = _attention(st, arrays)
    return out[:, :sq, :, :dv]


_flash_jit = jax.jit(_flash, static_argnames=("tuning", "interpret"))


def flash_attention(call: FlashAttentionCall, tuning: GpuFlashTuning, *, interpret: bool = False) -> jax.Array:
    """GPU flash attention of a validated call with ``tuning`` (Triton-lowered kernels, or the Mosaic GPU ones
    its ``mosaic_*`` fields ask for); ``interpret=True`` runs Pallas' interpreter (CPU). One compiled program
    per shapes and static fields (an eager call compiles once); under a caller's ``jit`` it is inlined."""
    tuning = mosaic_attention.applied(tuning, call, interpret=interpret)
    if call.dropout_seed is not None:  # an int seed becomes an argument: a new seed does not recompile
        call = dataclasses.replace(call, dropout_seed=dropout_hash.seed_bits(call.dropout_seed))
    return _flash_jit(call, tuning=tuning, interpret=interpret)


class GpuFlashAttention(Implementation[FlashAttentionCall, GpuFlashTuning]):
    """The Triton-lowered Pallas kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = GpuFlashTuning

    def supports(self, call: FlashAttentionCall) -> None:
        gpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead
        head_dims = (call.query.shape[-1], call.value.shape[-1])
        for refused, what in (
            (call.bias is not None, "bias"),
            (call.attention_mask is not None, "attention_mask"),
            (call.cum_seqlens_q is not None and call.q_segment_ids is not None,
             "segment ids together with cum_seqlens"),
            (max(head_dims) > 256, f"head_dim > 256 (query, value: {head_dims})"),
        ):
            if refused:
                raise UnsupportedFeature(
                    f"pallas GPU flash_attention: {what} is not implemented (platform='xla' takes it)"
                )

    def priority_for(self, call: FlashAttentionCall) -> int | None:
        return mosaic_attention.priority_for(call)

    def heuristic_config(self, call: FlashAttentionCall) -> GpuFlashTuning:
        """The H200 tiles fitted to the call; the Mosaic GPU kernels wherever they can take it (Hopper)."""
        tuning = heuristic_tuning(call.query.shape[1], call.key.shape[1])
        return mosaic_attention.with_mosaic(tuning, call, interpret=interpret_mode() is not None)

    def candidate_configs(self, call: FlashAttentionCall) -> list[GpuFlashTuning]:
        tilings = candidate_tunings(call.query.shape[1], call.key.shape[1])
        mosaic = mosaic_attention.with_mosaic(tilings[0], call, interpret=interpret_mode() is not None)
        return [mosaic, *tilings] if mosaic != tilings[0] else tilings

    def __call__(self, call: FlashAttentionCall, config: GpuFlashTuning) -> jax.Array:
        return flash_attention(call, config, interpret=gpu_interpret_or_refuse())


IMPLEMENTATION = GpuFlashAttention()


# ---------------------------------------------------------------------------------------------------
# Micro-benchmark (on a GPU; `python -m ejkernel_pallas.gpu_flash_attention`)


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
