"""The TPU flash attention's Pallas kernels (forward, dK/dV, dQ) and their launches over padded, head-major
arrays; :class:`_Static` describes one call (hashable: it parameterizes the custom VJP). Shared with the
block-sparse (:mod:`ejkernel_pallas.blocksparse_attention`) and ring kernels."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.ops.utils import dropout as dropout_hash

from ejkernel_pallas.tpu_flash_attention.blocks import TpuFlashBlocks
from ejkernel_pallas.tpu_tiling import check_block


# ---------------------------------------------------------------------------------------------------
# Static description of one call (hashable: it parameterizes the custom VJP)


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    dropout_prob: float
    sq: int  # real lengths
    skv: int
    q_offset: int  # Skv - Sq: bottom-right alignment (unused with varlen: positions come as arrays)
    groups: int  # query heads per KV head
    varlen: bool
    has_segments: bool
    bias_shape: tuple[int, int] | None  # (B or 1, H or 1) of the bias
    mask_heads: int | None  # 1 or H for attention_mask, None without
    num_sinks: int  # 0 = no sinks
    blocks: TpuFlashBlocks
    interpret: object  # False, or pltpu.InterpretParams
    block_outputs: bool = False  # ring inner block: f32 outputs, lse -inf for rows that see nothing
    # float32: delta_i = <dO_i, O_i> is recomputed in-kernel with the same dot as dP_ij = <dO_i, V_j>, so a
    # row that sees one key gets dS = P * (dP - delta) == 0 exactly (its true gradient), not rounding noise.
    exact_delta: bool = False
    precision: jax.lax.Precision | None = None  # of the float32 dots (see the module docstring)


def _struct(shape, dtype, like):
    """An output ShapeDtypeStruct that varies over the same shard_map axes as ``like`` (check_vma)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


# ---------------------------------------------------------------------------------------------------
# Block math shared by the kernels


def _dot(st: _Static, a, b, a_axis: int, b_axis: int):
    """``a`` times ``b`` (2-D tiles) contracting ``a_axis`` with ``b_axis``, accumulated in float32."""
    dims = (((a_axis,), (b_axis,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=st.precision, preferred_element_type=jnp.float32)


def _block_visible(st: _Static, qi, ki, block_q: int, block_kv: int):
    """False when a static causal/window mask hides the whole (qi, ki) block (traced bool)."""
    if st.varlen:
        return True
    q_first = qi * block_q + st.q_offset
    q_last = q_first + block_q - 1
    kv_first = ki * block_kv
    kv_last = kv_first + block_kv - 1
    visible = kv_first < st.skv
    if st.causal:
        visible = jnp.logical_and(visible, kv_first <= q_last)
    if st.window is not None:
        left, right = st.window
        visible = jnp.logical_and(visible, kv_last >= q_first - left)
        visible = jnp.logical_and(visible, kv_first <= q_last + right)
    return visible


def _logits_and_mask(st: _Static, r, b, h, qi, ki, block_q: int, block_kv: int):
    """Logits (after soft cap and bias, f32), the raw capped logits for the cap derivative, and the mask."""
    q = r["q"][...]
    k = r["k"][...]
    s = _dot(st, q, k, 1, 1)
    s = s * st.scale
    if st.soft_cap is not None:
        s = st.soft_cap * jnp.tanh(s / st.soft_cap)
    capped = s
    if st.bias_shape is not None:
        s = s + r["bias"][...].astype(jnp.float32)

    rows = qi * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    cols = ki * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    mask = jnp.broadcast_to(cols < st.skv, (block_q, block_kv))
    if st.varlen:
        q_pos, kv_pos = r["q_pos"][...], r["kv_pos"][...]
    else:
        q_pos, kv_pos = rows + st.q_offset, cols
    if st.causal:
        mask &= kv_pos <= q_pos
    if st.window is not None:
        left, right = st.window
        mask &= (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)
    if st.has_segments:
        mask &= r["q_seg"][...] == r["kv_seg"][...]
    if st.mask_heads is not None:
        mask &= r["mask"][...] != 0
    return s, capped, mask, rows, cols


def _dropout_keep(st: _Static, r, b, h, rows, cols):
    seed = r["seed"][0]
    return dropout_hash.keep_mask(seed, b, h, rows, cols, st.dropout_prob)


# ---------------------------------------------------------------------------------------------------
# Input plumbing: every array input has a block spec derived from the grid's (b, head, q-block, kv-block)


def _specs(st: _Static, names, coords, block_q: int, block_kv: int, d: int, dv: int):
    """BlockSpecs for ``names``; ``coords(*grid) -> (b, q_head, qi, ki)``."""
    g = st.groups

    def spec(block, index):
        return pl.BlockSpec(block, lambda *grid: index(*coords(*grid)))

    table = {
        "q": lambda: spec((None, None, block_q, d), lambda b, h, qi, ki: (b, h, qi, 0)),
        "k": lambda: spec((None, None, block_kv, d), lambda b, h, qi, ki: (b, h // g, ki, 0)),
        "v": lambda: spec((None, None, block_kv, dv), lambda b, h, qi, ki: (b, h // g, ki, 0)),
        "o": lambda: spec((None, None, block_q, dv), lambda b, h, qi, ki: (b, h, qi, 0)),
        "do": lambda: spec((None, None, block_q, dv), lambda b, h, qi, ki: (b, h, qi, 0)),
        "lse": lambda: spec((None, None, block_q, 1), lambda b, h, qi, ki: (b, h, qi, 0)),
        "delta": lambda: spec((None, None, block_q, 1), lambda b, h, qi, ki: (b, h, qi, 0)),
        "q_pos": lambda: spec((None, block_q, 1), lambda b, h, qi, ki: (b, qi, 0)),
        "q_seg": lambda: spec((None, block_q, 1), lambda b, h, qi, ki: (b, qi, 0)),
        "kv_pos": lambda: spec((None, 1, block_kv), lambda b, h, qi, ki: (b, 0, ki)),
        "kv_seg": lambda: spec((None, 1, block_kv), lambda b, h, qi, ki: (b, 0, ki)),
        "sinks": lambda: spec((None, 1, st.num_sinks), lambda b, h, qi, ki: (h, 0, 0)),
        "seed": lambda: pl.BlockSpec(memory_space=pltpu.SMEM),
    }
    if st.bias_shape is not None:
        bb, bh = st.bias_shape
        table["bias"] = lambda: spec(
            (None, None, block_q, block_kv),
            lambda b, h, qi, ki: (b if bb > 1 else 0, h if bh > 1 else 0, qi, ki),
        )
        table["dbias"] = lambda: spec((None, None, block_q, block_kv), lambda b, h, qi, ki: (b, h, qi, ki))
    if st.mask_heads is not None:
        mh = st.mask_heads
        table["mask"] = lambda: spec(
            (None, None, block_q, block_kv), lambda b, h, qi, ki: (b, h if mh > 1 else 0, qi, ki)
        )
    return [table[name]() for name in names]


def _check_tiling(st: _Static, arrays: dict, names, specs):
    for name, spec in zip(names, specs):
        if name == "seed":
            continue
        array = arrays[name]
        check_block(f"flash_attention[{name}]", spec.block_shape, array.shape, array.dtype)


def _compiler_params(num_parallel: int, num_arbitrary: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_parallel + ("arbitrary",) * num_arbitrary)


# ---------------------------------------------------------------------------------------------------
# Forward kernel


def init_softmax_state(sinks, m_ref, l_ref, acc_ref):
    """Seed a query block's online softmax: the running max / sum from the attention sinks (``sinks``: a (1, K)
    ref of extra logits without a value) or empty (-inf / 0) when ``sinks`` is None; a zero accumulator."""
    if sinks is not None:
        values = sinks[...].astype(jnp.float32)
        m0 = jnp.max(values, axis=-1, keepdims=True)
        m_ref[...] = jnp.broadcast_to(m0, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(jnp.sum(jnp.exp(values - m0), axis=-1, keepdims=True), l_ref.shape)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def online_softmax_step(s, m_ref, l_ref):
    """Fold a tile of logits ``s`` (-inf where masked) into the running max / sum refs; returns ``(p, alpha)``:
    the tile's probabilities against the new max, and the factor that rescales what was accumulated before."""
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
    m_ref[...] = m_new
    return p, alpha


def _fwd_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.blocks.fwd_q, st.blocks.fwd_kv
    b, h, qi, ki = (pl.program_id(i) for i in range(4))
    m_ref, l_ref, acc_ref = r["m_scratch"], r["l_scratch"], r["acc_scratch"]

    @pl.when(ki == 0)
    def _init():
        init_softmax_state(r["sinks"] if st.num_sinks else None, m_ref, l_ref, acc_ref)

    @pl.when(_block_visible(st, qi, ki, block_q, block_kv))
    def _step():
        s, _, mask, rows, cols = _logits_and_mask(st, r, b, h, qi, ki, block_q, block_kv)
        s = jnp.where(mask, s, -jnp.inf)
        p, alpha = online_softmax_step(s, m_ref, l_ref)
        if st.dropout_prob > 0.0:
            keep = _dropout_keep(st, r, b, h, rows, cols)
            p = dropout_hash.inverted_dropout(p, keep, st.dropout_prob)
        v = r["v"][...]
        pv = _dot(st, p.astype(v.dtype), v, 1, 0)
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...]
        m = m_ref[...]
        has_mass = l > 0.0
        safe_l = jnp.where(has_mass, l, 1.0)
        r["out"][...] = jnp.where(has_mass, acc_ref[...] / safe_l, 0.0).astype(r["out"].dtype)
        # Rows with no mass never produce probabilities in the backward (they are masked everywhere).
        empty_lse = -jnp.inf if st.block_outputs else 0.0
        r["lse_out"][...] = jnp.where(has_mass, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l), empty_lse)


def _forward(st: _Static, arrays: dict):
    q = arrays["q"]
    batch, heads, sq_pad, d = q.shape
    skv_pad, dv = arrays["v"].shape[2], arrays["v"].shape[3]
    block_q, block_kv = st.blocks.fwd_q, st.blocks.fwd_kv
    names = [n for n in ("q", "k", "v", "bias", "mask", "q_pos", "kv_pos", "q_seg", "kv_seg", "sinks", "seed") if n in arrays]
    coords = lambda b, h, qi, ki: (b, h, qi, ki)  # noqa: E731
    in_specs = _specs(st, names, coords, block_q, block_kv, d, dv)
    _check_tiling(st, arrays, names, in_specs)
    out_specs = _specs(st, ["o", "lse"], coords, block_q, block_kv, d, dv)
    out_shape = [
        _struct((batch, heads, sq_pad, dv), jnp.float32 if st.block_outputs else q.dtype, q),
        _struct((batch, heads, sq_pad, 1), jnp.float32, q),
    ]
    kernel = functools.partial(
        _fwd_kernel, st=st, names=names + ["out", "lse_out", "m_scratch", "l_scratch", "acc_scratch"]
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, sq_pad // block_q, skv_pad // block_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[
            pltpu.VMEM((block_q, 1), jnp.float32),
            pltpu.VMEM((block_q, 1), jnp.float32),
            pltpu.VMEM((block_q, dv), jnp.float32),
        ],
        compiler_params=_compiler_params(3, 1),
        interpret=st.interpret,
        name="ejkernel_tpu_flash_fwd",
    )(*[arrays[n] for n in names])
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Backward kernels


def _probabilities_and_dlogits(st: _Static, r, b, h, qi, ki, block_q, block_kv):
    """Recomputed (dropped-out) probabilities, and the logit gradients before (dS) and after the cap."""
    s, capped, mask, rows, cols = _logits_and_mask(st, r, b, h, qi, ki, block_q, block_kv)
    p = jnp.where(mask, jnp.exp(s - r["lse"][...]), 0.0)
    do = r["do"][...]
    v = r["v"][...]
    dp = _dot(st, do, v, 1, 1)
    p_dropped = p
    if st.dropout_prob > 0.0:
        keep = _dropout_keep(st, r, b, h, rows, cols)
        p_dropped = dropout_hash.inverted_dropout(p, keep, st.dropout_prob)
        dp = dropout_hash.inverted_dropout(dp, keep, st.dropout_prob)
    if st.exact_delta:
        products = _dot(st, do, r["o"][...], 1, 1)
        diagonal = jax.lax.broadcasted_iota(jnp.int32, products.shape, 0) == jax.lax.broadcasted_iota(
            jnp.int32, products.shape, 1
        )
        delta = jnp.sum(jnp.where(diagonal, products, 0.0), axis=1, keepdims=True)
    else:
        delta = r["delta"][...]
    ds = p * (dp - delta)  # gradient of the final logits (what the bias receives)
    ds_raw = ds
    if st.soft_cap is not None:
        ds_raw = ds * (1.0 - jnp.square(capped / st.soft_cap))
    return p_dropped, ds, ds_raw * st.scale


def _dkv_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.blocks.dkv_q, st.blocks.dkv_kv
    b, hk, ki, g, qi = (pl.program_id(i) for i in range(5))
    h = hk * st.groups + g
    dk_acc, dv_acc = r["dk_scratch"], r["dv_scratch"]

    @pl.when(jnp.logical_and(g == 0, qi == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(_block_visible(st, qi, ki, block_q, block_kv))
    def _step():
        p_dropped, _, ds_scaled = _probabilities_and_dlogits(st, r, b, h, qi, ki, block_q, block_kv)
        q, do = r["q"][...], r["do"][...]
        dv_acc[...] += _dot(st, p_dropped.astype(do.dtype), do, 0, 0)
        dk_acc[...] += _dot(st, ds_scaled.astype(q.dtype), q, 0, 0)

    @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, qi == pl.num_programs(4) - 1))
    def _finish():
        r["dk_out"][...] = dk_acc[...].astype(r["dk_out"].dtype)
        r["dv_out"][...] = dv_acc[...].astype(r["dv_out"].dtype)


def _dq_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.blocks.dq_q, st.blocks.dq_kv
    b, h, qi, ki = (pl.program_id(i) for i in range(4))
    dq_acc = r["dq_scratch"]
    visible = _block_visible(st, qi, ki, block_q, block_kv)

    @pl.when(ki == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(visible)
    def _step():
        _, ds, ds_scaled = _probabilities_and_dlogits(st, r, b, h, qi, ki, block_q, block_kv)
        k = r["k"][...]
        dq_acc[...] += _dot(st, ds_scaled.astype(k.dtype), k, 1, 0)
        if st.bias_shape is not None:
            r["dbias_out"][...] = ds

    if st.bias_shape is not None:

        @pl.when(jnp.logical_not(visible))
        def _hidden():
            r["dbias_out"][...] = jnp.zeros(r["dbias_out"].shape, jnp.float32)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        r["dq_out"][...] = dq_acc[...].astype(r["dq_out"].dtype)


_BWD_INPUTS = ("q", "k", "v", "bias", "mask", "q_pos", "kv_pos", "q_seg", "kv_seg", "seed", "do", "o", "lse", "delta")


def _backward(st: _Static, arrays: dict):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    batch, heads, sq_pad, d = q.shape
    kv_heads, skv_pad, dv = k.shape[1], k.shape[2], v.shape[3]
    names = [n for n in _BWD_INPUTS if n in arrays]
    g = st.groups

    # dK, dV: grid (b, kv head, kv block, q head in group, q block); the last two axes reduce.
    bq, bkv = st.blocks.dkv_q, st.blocks.dkv_kv
    coords = lambda b, hk, ki, gi, qi: (b, hk * g + gi, qi, ki)  # noqa: E731
    in_specs = _specs(st, names, coords, bq, bkv, d, dv)
    _check_tiling(st, arrays, names, in_specs)
    kv_out = _specs(st, ["k", "v"], coords, bq, bkv, d, dv)
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, names=names + ["dk_out", "dv_out", "dk_scratch", "dv_scratch"]),
        grid=(batch, kv_heads, skv_pad // bkv, g, sq_pad // bq),
        in_specs=in_specs,
        out_specs=kv_out,
        out_shape=[
            _struct(k.shape, jnp.float32 if st.block_outputs else k.dtype, q),
            _struct(v.shape, jnp.float32 if st.block_outputs else v.dtype, q),
        ],
        scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, dv), jnp.float32)],
        compiler_params=_compiler_params(3, 2),
        interpret=st.interpret,
        name="ejkernel_tpu_flash_dkv",
    )(*[arrays[n] for n in names])

    # dQ (and dBias): grid (b, q head, q block, kv block).
    bq, bkv = st.blocks.dq_q, st.blocks.dq_kv
    coords = lambda b, h, qi, ki: (b, h, qi, ki)  # noqa: E731
    in_specs = _specs(st, names, coords, bq, bkv, d, dv)
    _check_tiling(st, arrays, names, in_specs)
    out_names, out_shape = ["q"], [_struct(q.shape, jnp.float32 if st.block_outputs else q.dtype, q)]
    if st.bias_shape is not None:
        out_names.append("dbias")
        out_shape.append(_struct((batch, heads, sq_pad, skv_pad), jnp.float32, q))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, names=names + ["dq_out", "dbias_out"][: len(out_names)] + ["dq_scratch"]),
        grid=(batch, heads, sq_pad // bq, skv_pad // bkv),
        in_specs=in_specs,
        out_specs=_specs(st, out_names, coords, bq, bkv, d, dv),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=_compiler_params(3, 1),
        interpret=st.interpret,
        name="ejkernel_tpu_flash_dq",
    )(*[arrays[n] for n in names])
    dq = outs[0]
    dbias = outs[1] if st.bias_shape is not None else None
    return dq, dk, dv_, dbias
