"""Block-sparse flash attention for TPU in Pallas (Mosaic TPU), forward and backward, splash-style; semantics
of ``ejkernel.modules.operations.blocksparse_attention``.

The block mask is compiled once into visiting schedules (``ejkernel.ops.utils.block_sparse.block_schedule``:
per query block the key blocks to visit, per key block the query blocks, and which visits need token
masks). They reach the kernels as scalar prefetch (SMEM: per entry ``2 * block + partial``, and the counts), and the K/V (forward, dQ) or Q/dO (dK/dV) index
maps read the block to load from them: a grid axis walks the ``max_visits`` entries of a row, so a block
the mask leaves empty is never loaded, and the steps past a row's count repeat its last index (the
pipeline sees an unchanged block index and issues no DMA) and do no work (``pl.when``). Visited blocks a
causal / window boundary, a ragged tail or segment ids cross are masked in-kernel with the flash kernels'
token rules; the others (``partial`` False) skip the token mask.

Kernel blocks are the mask's blocks (``q_block_size`` x ``kv_block_size``), so there is nothing to tune
(``NoConfig``). On a TPU those must tile (:func:`tiling_problem`: query blocks a multiple of the dtype's
sublane rows, key blocks of them too, or of 128 lanes with segment ids); others are refused. In interpret
mode (CPU) any block size runs. The block math (logits, masks, probabilities and logit gradients, block
specs) is that of :mod:`ejkernel_pallas.tpu_flash_attention`, imported, not copied. GQA/MQA (the dK/dV
grid walks the query heads of a group), soft cap, sinks (seeding the online softmax; their gradient a
reduction outside the kernels), segment ids; rows with no visible key give zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttentionCall
from ejkernel.ops.utils.block_sparse import BlockSchedule, block_schedule
from ejkernel.ops.utils.padding import pad_axis

from ejkernel_pallas.call_fields import attention_fields
from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_flash_attention import TpuFlashBlocks, sink_gradient
from ejkernel_pallas.tpu_flash_attention.kernels import (
    _check_tiling,
    _dot,
    _logits_and_mask,
    _probabilities_and_dlogits,
    _specs,
    _Static,
    _struct,
    init_softmax_state,
    online_softmax_step,
)
from ejkernel_pallas.tpu_tiling import LANES, sublane_multiple


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static shape of the schedules: the flash ``_Static`` of the token rules, the same with the token
    rules off (full blocks), and the schedule dims."""

    st: _Static
    full: _Static  # for blocks with partial False: no causal/window/segment/tail mask
    mask_batch: int
    mask_heads: int
    q_blocks: int
    kv_blocks: int
    count_visits: bool = False  # debug output: per row block, how many grid steps did work


def _flat(layout: _Layout, rows: int, visits: int, b, h, row, step=None):
    """Flat offset of ``[mask_batch, mask_heads, rows(, visits)]`` entries (size-1 mask dims: stride 0)."""
    mb = b if layout.mask_batch > 1 else 0
    mh = h if layout.mask_heads > 1 else 0
    base = (mb * layout.mask_heads + mh) * rows + row
    return base if step is None else base * visits + step


class _Schedule:
    """A ``BlockSchedule`` flattened for SMEM (scalar memory is small): int32 1-D ``visits`` (``2 * block +
    partial`` per entry) and ``counts``, and its dims."""

    def __init__(self, layout: _Layout, schedule: BlockSchedule, rows: int):
        self.rows = rows
        self.visits = schedule.indices.shape[3]
        entries = 2 * schedule.indices.astype(jnp.int32) + schedule.partial.astype(jnp.int32)
        self.arrays = [entries.reshape(-1), schedule.counts.reshape(-1).astype(jnp.int32)]
        self.layout = layout

    def _entry(self, refs, b, h, row, step):
        return refs[0][_flat(self.layout, self.rows, self.visits, b, h, row, step)]

    def column(self, refs, b, h, row, step):
        return self._entry(refs, b, h, row, step) // 2

    def count(self, refs, b, h, row):
        return refs[1][_flat(self.layout, self.rows, self.visits, b, h, row)]

    def partial(self, refs, b, h, row, step):
        return self._entry(refs, b, h, row, step) % 2 == 1


def _visit(step, count, partial, body):
    """Run ``body(static)`` on a real visit: with the token rules when ``partial``, without otherwise."""

    @pl.when(jnp.logical_and(step < count, partial))
    def _masked():
        body(True)

    @pl.when(jnp.logical_and(step < count, jnp.logical_not(partial)))
    def _full():
        body(False)


# ---------------------------------------------------------------------------------------------------
# Forward: grid (batch, head, q block, visit)


def _fwd_kernel(*refs, layout: _Layout, sched: _Schedule, names):
    prefetch, refs = refs[:2], refs[2:]
    r = dict(zip(names, refs))
    st = layout.st
    bq, bkv = st.blocks.fwd_q, st.blocks.fwd_kv
    b, h, qi, step = (pl.program_id(i) for i in range(4))
    ki = sched.column(prefetch, b, h, qi, step)
    m_ref, l_ref, acc_ref = r["m_scratch"], r["l_scratch"], r["acc_scratch"]

    @pl.when(step == 0)
    def _init():
        init_softmax_state(r["sinks"] if st.num_sinks else None, m_ref, l_ref, acc_ref)
        if layout.count_visits:
            r["visits_out"][...] = jnp.zeros(r["visits_out"].shape, jnp.int32)

    def body(masked: bool):
        s, _, mask, _, _ = _logits_and_mask(st if masked else layout.full, r, b, h, qi, ki, bq, bkv)
        if masked:
            s = jnp.where(mask, s, -jnp.inf)
        p, alpha = online_softmax_step(s, m_ref, l_ref)
        v = r["v"][...]
        acc_ref[...] = alpha * acc_ref[...] + _dot(st, p.astype(v.dtype), v, 1, 0)
        if layout.count_visits:
            r["visits_out"][...] += 1

    _visit(step, sched.count(prefetch, b, h, qi), sched.partial(prefetch, b, h, qi, step), body)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        l, m = l_ref[...], m_ref[...]
        has_mass = l > 0.0
        safe_l = jnp.where(has_mass, l, 1.0)
        r["out"][...] = jnp.where(has_mass, acc_ref[...] / safe_l, 0.0).astype(r["out"].dtype)
        # a row with no mass is masked wherever the backward visits it: any finite lse does
        r["lse_out"][...] = jnp.where(has_mass, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l), 0.0)


def _grid_spec(sched: _Schedule, grid, in_specs, out_specs, scratch):
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
    )


def _compiler_params(num_parallel: int, num_arbitrary: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_parallel + ("arbitrary",) * num_arbitrary)


def _forward(layout: _Layout, arrays: dict, schedule_q: BlockSchedule):
    st = layout.st
    q, v = arrays["q"], arrays["v"]
    batch, heads, sq_pad, d = q.shape
    dv = v.shape[3]
    bq, bkv = st.blocks.fwd_q, st.blocks.fwd_kv
    sched = _Schedule(layout, schedule_q, layout.q_blocks)
    names = [n for n in ("q", "k", "v", "q_seg", "kv_seg", "sinks") if n in arrays]

    def coords(b, h, qi, step, *prefetch):
        return b, h, qi, sched.column(prefetch, b, h, qi, step)

    in_specs = _specs(st, names, coords, bq, bkv, d, dv)
    if st.interpret is False:
        _check_tiling(st, arrays, names, in_specs)
    out_names = ["o", "lse"] + (["lse"] if layout.count_visits else [])
    out_shape = [
        _struct((batch, heads, sq_pad, dv), q.dtype, q),
        _struct((batch, heads, sq_pad, 1), jnp.float32, q),
    ]
    if layout.count_visits:
        out_shape.append(_struct((batch, heads, sq_pad, 1), jnp.int32, q))
    kernel = functools.partial(
        _fwd_kernel, layout=layout, sched=sched,
        names=names + ["out", "lse_out", "visits_out"][: len(out_shape)] + ["m_scratch", "l_scratch", "acc_scratch"],
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=_grid_spec(
            sched, (batch, heads, layout.q_blocks, sched.visits), in_specs,
            _specs(st, out_names, coords, bq, bkv, d, dv),
            [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, dv), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=_compiler_params(3, 1),
        interpret=st.interpret,
        name="ejkernel_tpu_blocksparse_fwd",
    )(*sched.arrays, *[arrays[n] for n in names])
    return outs


# ---------------------------------------------------------------------------------------------------
# Backward: dK/dV over the key blocks' schedule, dQ over the query blocks'


def _dkv_kernel(*refs, layout: _Layout, sched: _Schedule, names):
    prefetch, refs = refs[:2], refs[2:]
    r = dict(zip(names, refs))
    st = layout.st
    bq, bkv = st.blocks.dkv_q, st.blocks.dkv_kv
    b, hk, ki, g, step = (pl.program_id(i) for i in range(5))
    h = hk * st.groups + g
    qi = sched.column(prefetch, b, h, ki, step)
    dk_acc, dv_acc = r["dk_scratch"], r["dv_scratch"]

    @pl.when(jnp.logical_and(g == 0, step == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
        if layout.count_visits:
            r["visits_out"][...] = jnp.zeros(r["visits_out"].shape, jnp.int32)

    def body(masked: bool):
        p, _, ds_scaled = _probabilities_and_dlogits(st if masked else layout.full, r, b, h, qi, ki, bq, bkv)
        q, do = r["q"][...], r["do"][...]
        dv_acc[...] += _dot(st, p.astype(do.dtype), do, 0, 0)
        dk_acc[...] += _dot(st, ds_scaled.astype(q.dtype), q, 0, 0)
        if layout.count_visits:
            r["visits_out"][...] += 1

    _visit(step, sched.count(prefetch, b, h, ki), sched.partial(prefetch, b, h, ki, step), body)

    @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, step == pl.num_programs(4) - 1))
    def _finish():
        r["dk_out"][...] = dk_acc[...].astype(r["dk_out"].dtype)
        r["dv_out"][...] = dv_acc[...].astype(r["dv_out"].dtype)


def _dq_kernel(*refs, layout: _Layout, sched: _Schedule, names):
    prefetch, refs = refs[:2], refs[2:]
    r = dict(zip(names, refs))
    st = layout.st
    bq, bkv = st.blocks.dq_q, st.blocks.dq_kv
    b, h, qi, step = (pl.program_id(i) for i in range(4))
    ki = sched.column(prefetch, b, h, qi, step)
    dq_acc = r["dq_scratch"]

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
        if layout.count_visits:
            r["visits_out"][...] = jnp.zeros(r["visits_out"].shape, jnp.int32)

    def body(masked: bool):
        _, _, ds_scaled = _probabilities_and_dlogits(st if masked else layout.full, r, b, h, qi, ki, bq, bkv)
        k = r["k"][...]
        dq_acc[...] += _dot(st, ds_scaled.astype(k.dtype), k, 1, 0)
        if layout.count_visits:
            r["visits_out"][...] += 1

    _visit(step, sched.count(prefetch, b, h, qi), sched.partial(prefetch, b, h, qi, step), body)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        r["dq_out"][...] = dq_acc[...].astype(r["dq_out"].dtype)


_BWD_INPUTS = ("q", "k", "v", "q_seg", "kv_seg", "do", "o", "lse", "delta")


def _backward(layout: _Layout, arrays: dict, schedule_q: BlockSchedule, schedule_kv: BlockSchedule):
    """(dq, dk, dv) and, with ``count_visits``, the per-row-block work counts of the dK/dV and dQ passes."""
    st = layout.st
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    batch, heads, sq_pad, d = q.shape
    kv_heads, skv_pad, dv = k.shape[1], k.shape[2], v.shape[3]
    names = [n for n in _BWD_INPUTS if n in arrays]
    g = st.groups
    bq, bkv = st.blocks.dkv_q, st.blocks.dkv_kv
    count_out = [_struct((batch, kv_heads, skv_pad, 1), jnp.int32, q)] if layout.count_visits else []

    # dK, dV: grid (b, kv head, kv block, q head of the group, visit); the last two reduce
    sched = _Schedule(layout, schedule_kv, layout.kv_blocks)

    def kv_coords(b, hk, ki, gi, step, *prefetch):
        return b, hk * g + gi, sched.column(prefetch, b, hk * g + gi, ki, step), ki

    in_specs = _specs(st, names, kv_coords, bq, bkv, d, dv)
    if st.interpret is False:
        _check_tiling(st, arrays, names, in_specs)
    out_specs = _specs(st, ["k", "v"], kv_coords, bq, bkv, d, dv)
    if layout.count_visits:
        out_specs.append(pl.BlockSpec((None, None, bkv, 1), lambda b, hk, ki, gi, step, *_: (b, hk, ki, 0)))
    dkv_outs = pl.pallas_call(
        functools.partial(
            _dkv_kernel, layout=layout, sched=sched,
            names=names + ["dk_out", "dv_out", "visits_out"][: 2 + len(count_out)] + ["dk_scratch", "dv_scratch"],
        ),
        grid_spec=_grid_spec(
            sched, (batch, kv_heads, layout.kv_blocks, g, sched.visits), in_specs, out_specs,
            [pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, dv), jnp.float32)],
        ),
        out_shape=[_struct(k.shape, k.dtype, q), _struct(v.shape, v.dtype, q), *count_out],
        compiler_params=_compiler_params(3, 2),
        interpret=st.interpret,
        name="ejkernel_tpu_blocksparse_dkv",
    )(*sched.arrays, *[arrays[n] for n in names])

    # dQ: grid (b, q head, q block, visit)
    sched_q = _Schedule(layout, schedule_q, layout.q_blocks)

    def q_coords(b, h, qi, step, *prefetch):
        return b, h, qi, sched_q.column(prefetch, b, h, qi, step)

    in_specs = _specs(st, names, q_coords, bq, bkv, d, dv)
    out_names = ["q"] + (["lse"] if layout.count_visits else [])
    out_shape = [_struct(q.shape, q.dtype, q)]
    if layout.count_visits:
        out_shape.append(_struct((batch, heads, sq_pad, 1), jnp.int32, q))
    dq_outs = pl.pallas_call(
        functools.partial(
            _dq_kernel, layout=layout, sched=sched_q,
            names=names + ["dq_out", "visits_out"][: len(out_shape)] + ["dq_scratch"],
        ),
        grid_spec=_grid_spec(
            sched_q, (batch, heads, layout.q_blocks, sched_q.visits), in_specs,
            _specs(st, out_names, q_coords, bq, bkv, d, dv), [pltpu.VMEM((bq, d), jnp.float32)],
        ),
        out_shape=out_shape,
        compiler_params=_compiler_params(3, 1),
        interpret=st.interpret,
        name="ejkernel_tpu_blocksparse_dq",
    )(*sched_q.arrays, *[arrays[n] for n in names])
    return dq_outs[0], dkv_outs[0], dkv_outs[1], (dkv_outs[2:], dq_outs[1:])


# ---------------------------------------------------------------------------------------------------
# Custom VJP over the padded, head-major arrays (schedules: integer inputs without gradients)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(layout: _Layout, arrays: dict, schedules: tuple):
    return _forward(layout, arrays, schedules[0])[0]


def _attention_fwd(layout: _Layout, arrays: dict, schedules: tuple):
    out, lse = _forward(layout, arrays, schedules[0])[:2]
    return out, (arrays, schedules, out, lse)


def _attention_bwd(layout: _Layout, residuals, d_out):
    arrays, schedules, out, lse = residuals
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    bwd_arrays = {n: a for n, a in arrays.items() if n != "sinks"}
    bwd_arrays.update(do=d_out, lse=lse, delta=delta)
    if layout.st.exact_delta:
        bwd_arrays["o"] = out
    dq, dk, dv, _ = _backward(layout, bwd_arrays, *schedules)
    grads = {}
    for name, value in arrays.items():
        if name in ("q", "k", "v"):
            grads[name] = {"q": dq, "k": dk, "v": dv}[name]
        elif name == "sinks":
            grads[name] = sink_gradient(value, lse, delta)
        else:
            grads[name] = None
    return grads, jax.tree.map(lambda _: None, schedules)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------------
# The implementation: a validated BlockSparseAttentionCall


def _prepare(call: BlockSparseAttentionCall, interpret, count_visits: bool = False):
    """(layout, padded head-major arrays) of a call."""
    query, key, value = call.query, call.key, call.value
    batch, sq, heads, _ = query.shape
    skv, kv_heads = key.shape[1], key.shape[2]
    bq, bkv = call.q_block_size, call.kv_block_size
    mask_batch, mask_heads, q_blocks, kv_blocks = call.block_mask.shape
    sq_pad, skv_pad = q_blocks * bq, kv_blocks * bkv
    arrays = {
        "q": pad_axis(jnp.swapaxes(query, 1, 2), 2, sq_pad),
        "k": pad_axis(jnp.swapaxes(key, 1, 2), 2, skv_pad),
        "v": pad_axis(jnp.swapaxes(value, 1, 2), 2, skv_pad),
    }
    if call.q_segment_ids is not None:
        arrays["q_seg"] = pad_axis(call.q_segment_ids.astype(jnp.int32), 1, sq_pad)[:, :, None]
        arrays["kv_seg"] = pad_axis(call.kv_segment_ids.astype(jnp.int32), 1, skv_pad)[:, None, :]
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = sinks.shape[1]
        arrays["sinks"] = sinks[:, None, :]
    st = _Static(
        **attention_fields(call, sq=sq, skv=skv, groups=heads // kv_heads), dropout_prob=0.0, varlen=False,
        has_segments=call.q_segment_ids is not None, bias_shape=None, mask_heads=None, num_sinks=num_sinks,
        blocks=TpuFlashBlocks(bq, bkv, bq, bkv, bq, bkv), interpret=interpret,
        precision=call.precision if query.dtype == jnp.float32 else None,
    )
    full = dataclasses.replace(st, causal=False, window=None, has_segments=False, skv=skv_pad)
    layout = _Layout(st, full, mask_batch, mask_heads, q_blocks, kv_blocks, count_visits)
    return layout, arrays


def _run(call: BlockSparseAttentionCall, schedules: tuple, interpret) -> jax.Array:
    layout, arrays = _prepare(call, interpret)
    out = _attention(layout, arrays, schedules)
    return jnp.swapaxes(out[:, :, : call.query.shape[1]], 1, 2)


_run_jit = jax.jit(_run, static_argnames=("interpret",))


def schedules(call: BlockSparseAttentionCall) -> tuple[BlockSchedule, BlockSchedule]:
    """The (by query block, by key block) schedules of a call (numpy for a concrete mask: ``max_visits``
    is then the busiest row's count, so the grid has no idle tail beyond it)."""
    return block_schedule(call, by="q"), block_schedule(call, by="kv")


def blocksparse_attention(call: BlockSparseAttentionCall, *, interpret=False) -> jax.Array:
    """TPU block-sparse attention of a validated call (``interpret`` as in ``tpu_flash_attention``).

    The schedules are built before the jitted program, so a concrete mask sizes the grid by its busiest
    row; one program per shapes, static fields and ``max_visits``."""
    return _run_jit(call, schedules(call), interpret=interpret)


def visited_blocks(call: BlockSparseAttentionCall, *, interpret=True) -> dict[str, np.ndarray]:
    """Debug (tests): how many grid steps did work, per row block, in each kernel: ``"forward"`` and ``"dq"``
    ``[batch, heads, q_blocks]``, ``"dkv"`` ``[batch, kv_heads, kv_blocks]`` (summed over the group)."""
    layout, arrays = _prepare(call, interpret, count_visits=True)
    schedule_q, schedule_kv = schedules(call)
    out, lse, fwd_visits = _forward(layout, arrays, schedule_q)
    d_out = jnp.ones_like(out)
    bwd = {**arrays, "do": d_out, "lse": lse, "delta": jnp.zeros_like(lse), "o": out}
    bwd.pop("sinks", None)
    _, _, _, (dkv_visits, dq_visits) = _backward(layout, bwd, schedule_q, schedule_kv)
    bq, bkv = call.q_block_size, call.kv_block_size
    return {
        "forward": np.asarray(fwd_visits[..., ::bq, 0]),
        "dq": np.asarray(dq_visits[0][..., ::bq, 0]),
        "dkv": np.asarray(dkv_visits[0][..., ::bkv, 0]),
    }


def tiling_problem(call: BlockSparseAttentionCall) -> str | None:
    """Why the call's blocks cannot tile on a TPU (kernel blocks are the mask's), or None."""
    rows = sublane_multiple(call.query.dtype)
    q_blocks, kv_blocks = call.block_mask.shape[2:]
    bq, bkv = call.q_block_size, call.kv_block_size
    if q_blocks > 1 and bq % max(rows, 8):
        return f"q_block_size={bq} is not a multiple of {max(rows, 8)} rows (TPU sublane tiles)"
    need, why = (LANES, "lanes of the per-key segment ids") if call.q_segment_ids is not None else (rows, "sublane rows")
    if kv_blocks > 1 and bkv % need:
        return f"kv_block_size={bkv} is not a multiple of {need} ({why})"
    return None


class TpuBlockSparseAttention(Implementation[BlockSparseAttentionCall, NoConfig]):
    """The Mosaic TPU block-sparse kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = NoConfig

    def supports(self, call: BlockSparseAttentionCall) -> None:
        interpret = tpu_interpret_or_refuse()
        problem = tiling_problem(call)
        if interpret is False and problem is not None:
            raise UnsupportedFeature(f"pallas TPU blocksparse_attention: {problem}; kernel blocks are the mask's blocks")

    def __call__(self, call: BlockSparseAttentionCall, config: NoConfig) -> jax.Array:
        return blocksparse_attention(call, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = TpuBlockSparseAttention()
