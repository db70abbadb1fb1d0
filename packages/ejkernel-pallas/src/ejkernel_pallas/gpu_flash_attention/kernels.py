"""The Pallas kernels of GPU flash attention (forward, dK/dV, dQ) and what they share: the static call
description ``_Static``, which key / query blocks a mask can touch (``_kv_ranges`` / ``_q_ranges``), the
block-sparse schedule rows (``gpu_schedule``, ``_run_schedule``), masks, dots and dropout."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ejkernel.ops.utils import dropout as dropout_hash
from ejkernel.ops.utils.block_sparse import BlockSchedule
from ejkernel.ops.utils.padding import pad_axis

from ejkernel_pallas.gpu_flash_attention.tuning import GpuFlashTuning

LOG2E = math.log2(math.e)


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
    return pad_axis(row.astype(jnp.int32), 3, width)


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
            p = dropout_hash.inverted_dropout(p, keep, st.dropout_prob)
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
            p_dropped = dropout_hash.inverted_dropout(p, keep, st.dropout_prob)
            dp = dropout_hash.inverted_dropout(dp, keep, st.dropout_prob)
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
            dp = dropout_hash.inverted_dropout(dp, keep, st.dropout_prob)
        ds = p * (dp - delta[:, None])
        if cap_grad is not None:
            ds = ds * cap_grad
        return dq + _dot(st, ds.astype(k.dtype), k, 1, 0)

    dq = _loop(r, "sched_q", body, _kv_ranges(st, qi, block_q, block_kv, num_kv), jnp.zeros(q.shape, jnp.float32),
               st.mask_blocks[1] // block_kv)
    r["dq_out"][...] = (dq * st.scale).astype(r["dq_out"].dtype)

