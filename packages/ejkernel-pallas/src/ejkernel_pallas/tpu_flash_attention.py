"""Flash attention for TPU in Pallas (Mosaic TPU), forward and backward, semantics of docs/flash_attention.md.

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``FlashAttentionCall`` and a
:class:`TpuFlashBlocks` config; every feature of the call is implemented except segment ids together with
``cum_seqlens`` (refused: ``platform='xla'`` takes them). On CPU it runs only in interpret mode
(:mod:`ejkernel_pallas.interpret`).

Precision: Mosaic lowers a dot's precision to the TPU's contract precision (``DEFAULT`` the MXU's default
passes, ``HIGH`` bf16x3, ``HIGHEST`` full fp32), so float32 calls pass ``call.precision`` to every dot
(HIGHEST unless the caller asked otherwise) and no precision is refused. 16-bit operands multiply exactly
into the float32 accumulators; their dots take no precision.

Layout: the public [B, S, H, D] arrays are moved to [B, H, S, D] so each kernel block is an (S-block, D)
tile; lengths are padded inside the wrapper to whole blocks and the padding is masked in the kernel, so
callers pass any length. Masks are evaluated per block from cheap per-token metadata (positions, segment
ids) instead of a materialized [Sq, Skv] mask; blocks that a static causal/window mask hides entirely
are skipped. Attention sinks seed the online softmax (they are extra logits without a value), so no
extra pass is needed; their gradient is a cheap reduction done outside the kernels.

Backward: two kernels, as in FlashAttention-2: one accumulates dK/dV per KV block, looping over the
query heads of its GQA group and all query blocks; the other accumulates dQ per query block (and writes
dBias blocks when a bias is given). Both recompute the probabilities from the saved log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel.ops.utils import dropout as dropout_hash
from ejkernel.ops.utils.varlen import packed_keys, packed_queries

from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_tiling import LANES, TpuTilingError, check_block, round_up, sublane_multiple

# ---------------------------------------------------------------------------------------------------
# The config: block sizes


@dataclasses.dataclass(frozen=True)
class TpuFlashBlocks:
    """The TPU kernels' config: rows of Q / rows of K,V per grid step of the forward (``fwd_*``), the dK/dV
    pass (``dkv_*``) and the dQ pass (``dq_*``).

    Used as given (lengths are padded to whole blocks); :func:`heuristic_blocks` fits one to a call. Blocks
    a TPU cannot tile for a call raise :class:`TpuTilingError` naming the field (:func:`validate_blocks`).
    """

    fwd_q: int
    fwd_kv: int
    dkv_q: int
    dkv_kv: int
    dq_q: int
    dq_kv: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TpuFlashBlocks.{field.name} must be a positive int, got {value!r}")


# Larger blocks amortize the ~0.35 us per-grid-step overhead of TPU pipelines; 512 rows of bf16 with
# D=128 keep Q, K, V, the f32 logits tile and double buffers well inside the 16-32 MiB of scoped VMEM.
DEFAULT_FWD_BLOCK = 512
DEFAULT_BWD_BLOCK = 256


def block_caps(head_dim: int) -> tuple[int, int]:
    """(forward, backward) row caps. A step holds double-buffered (block, D) tiles of Q, K, V (and dO, plus
    f32 dK/dV accumulators in the backward) beside the (block_q, block_kv) f32 logits: above D = 128 the
    tiles double, so the caps halve to keep the same VMEM footprint (an estimate; not measured on a TPU)."""
    if head_dim <= LANES:
        return DEFAULT_FWD_BLOCK, DEFAULT_BWD_BLOCK
    return DEFAULT_FWD_BLOCK // 2, DEFAULT_BWD_BLOCK // 2


def _default_block(length: int, cap: int, row_multiple: int) -> int:
    """Whole (padded) length when it fits in one block, else ``cap`` (a multiple of 128)."""
    if length <= cap:
        return round_up(length, row_multiple)
    return cap


def _row_multiple(dtype, has_mask: bool) -> int:
    """Rows of q-side blocks also index int8 masks (32-row tiles) and f32 metadata (8-row tiles)."""
    return max(sublane_multiple(dtype), 32 if has_mask else 8)


def heuristic_blocks(
    sq: int, skv: int, dtype=jnp.bfloat16, head_dim: int = LANES, has_mask: bool = False
) -> TpuFlashBlocks:
    """One block over a (padded) length up to the cap of :func:`block_caps`, else blocks of the cap
    (multiples of 128); the dQ pass uses the dK/dV pass's blocks."""
    rows = _row_multiple(dtype, has_mask)
    fwd_cap, bwd_cap = block_caps(head_dim)
    dkv_q, dkv_kv = _default_block(sq, bwd_cap, rows), _default_block(skv, bwd_cap, rows)
    return TpuFlashBlocks(
        fwd_q=_default_block(sq, fwd_cap, rows), fwd_kv=_default_block(skv, fwd_cap, rows),
        dkv_q=dkv_q, dkv_kv=dkv_kv, dq_q=dkv_q, dq_kv=dkv_kv,
    )


def candidate_blocks(
    sq: int, skv: int, dtype=jnp.bfloat16, head_dim: int = LANES, has_mask: bool = False
) -> list[TpuFlashBlocks]:
    """Autotuning candidates, pruned: the heuristic first, then square and 2:1 forward tiles of 128-multiples
    up to the padded lengths (as large as the VMEM caps allow, x2), each with backward blocks half as tall
    (the backward keeps twice the live tiles); at most 8, every one tiling on TPU."""
    heuristic = heuristic_blocks(sq, skv, dtype, head_dim, has_mask)
    fwd_cap, _ = block_caps(head_dim)

    def sizes(length):
        return [b for b in (128, 256, 512, 1024) if b <= min(2 * fwd_cap, round_up(length, LANES))]

    candidates = [heuristic]
    for bq in sizes(sq)[::-1]:
        for bk in sizes(skv)[::-1]:
            if max(bq, bk) <= 2 * min(bq, bk):
                hq, hk = max(bq // 2, LANES), max(bk // 2, LANES)
                candidates.append(TpuFlashBlocks(bq, bk, hq, hk, hq, hk))
    return list(dict.fromkeys(candidates))[:8]


def padded_lengths(blocks: TpuFlashBlocks, sq: int, skv: int) -> tuple[int, int]:
    """Lengths padded to whole blocks of every kernel (what the kernels see)."""
    return (round_up(sq, math.lcm(blocks.fwd_q, blocks.dkv_q, blocks.dq_q)),
            round_up(skv, math.lcm(blocks.fwd_kv, blocks.dkv_kv, blocks.dq_kv)))


def validate_blocks(blocks: TpuFlashBlocks, sq: int, skv: int, *, q_rows: int, kv_rows: int, kv_lanes: bool) -> None:
    """Refuse blocks a TPU cannot tile, naming the config field (before anything is lowered).

    Query-side blocks are rows of Q/O tiles and of per-query metadata: a multiple of ``q_rows``. Key-side
    blocks are rows of K/V tiles (a multiple of ``kv_rows``) and, with ``kv_lanes`` (per-key metadata,
    bias or mask), the lane dim of ``[.., 1, S]`` / ``[.., Sq, Skv]`` tiles: a multiple of 128. Either may
    instead be one block over the whole padded length."""
    sq_pad, skv_pad = padded_lengths(blocks, sq, skv)
    for field in ("fwd_q", "dkv_q", "dq_q"):
        value = getattr(blocks, field)
        if value != sq_pad and value % q_rows:
            raise TpuTilingError(
                f"TpuFlashBlocks.{field}={value}: a query block must be a multiple of {q_rows} rows "
                f"(TPU sublane tiles of the query-side arrays) or one block over the padded length {sq_pad}"
            )
    if kv_lanes:
        need, why = LANES, "the lane dim of per-key metadata / bias / mask tiles"
    else:
        need, why = kv_rows, "sublane rows of the K/V tiles"
    for field in ("fwd_kv", "dkv_kv", "dq_kv"):
        value = getattr(blocks, field)
        if value != skv_pad and value % need:
            raise TpuTilingError(
                f"TpuFlashBlocks.{field}={value}: a key/value block must be a multiple of {need} ({why}) "
                f"or one block over the padded length {skv_pad}"
            )


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


def _pad_axis(x, axis: int, length: int, value=0):
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


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


def _fwd_kernel(*refs, st: _Static, names):
    r = dict(zip(names, refs))
    block_q, block_kv = st.blocks.fwd_q, st.blocks.fwd_kv
    b, h, qi, ki = (pl.program_id(i) for i in range(4))
    m_ref, l_ref, acc_ref = r["m_scratch"], r["l_scratch"], r["acc_scratch"]

    @pl.when(ki == 0)
    def _init():
        if st.num_sinks:
            sinks = r["sinks"][...].astype(jnp.float32)  # (1, K)
            m0 = jnp.max(sinks, axis=-1, keepdims=True)
            m_ref[...] = jnp.broadcast_to(m0, m_ref.shape)
            l_ref[...] = jnp.broadcast_to(jnp.sum(jnp.exp(sinks - m0), axis=-1, keepdims=True), l_ref.shape)
        else:
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(_block_visible(st, qi, ki, block_q, block_kv))
    def _step():
        s, _, mask, rows, cols = _logits_and_mask(st, r, b, h, qi, ki, block_q, block_kv)
        s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
        m_ref[...] = m_new
        if st.dropout_prob > 0.0:
            keep = _dropout_keep(st, r, b, h, rows, cols)
            p = jnp.where(keep, p * (1.0 / (1.0 - st.dropout_prob)), 0.0)
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
        inv_keep = 1.0 / (1.0 - st.dropout_prob)
        p_dropped = jnp.where(keep, p * inv_keep, 0.0)
        dp = jnp.where(keep, dp * inv_keep, 0.0)
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


# ---------------------------------------------------------------------------------------------------
# Custom VJP over the padded, head-major arrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, arrays: dict):
    out, _ = _forward(st, arrays)
    return out


def _attention_fwd(st: _Static, arrays: dict):
    out, lse = _forward(st, arrays)
    return out, (arrays, out, lse)


def _attention_bwd(st: _Static, residuals, d_out):
    arrays, out, lse = residuals
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    bwd_arrays = {**arrays, "do": d_out, "lse": lse, "delta": delta}
    if st.exact_delta:
        bwd_arrays["o"] = out
    bwd_arrays.pop("sinks", None)
    dq, dk, dv, dbias = _backward(st, bwd_arrays)
    grads = {}
    for name, value in arrays.items():
        if name == "q":
            grads[name] = dq
        elif name == "k":
            grads[name] = dk
        elif name == "v":
            grads[name] = dv
        elif name == "bias":
            bb, bh = st.bias_shape
            reduce_axes = tuple(axis for axis, size in ((0, bb), (1, bh)) if size == 1)
            grads[name] = jnp.sum(dbias, axis=reduce_axes, keepdims=True).astype(value.dtype)
        elif name == "sinks":
            grads[name] = sink_gradient(value, lse, delta)
        elif jnp.issubdtype(value.dtype, jnp.floating):
            grads[name] = jnp.zeros_like(value)
        else:
            grads[name] = None
    return (grads,)


_attention.defvjp(_attention_fwd, _attention_bwd)


def sink_gradient(sinks, lse, delta):
    """Gradient of the sinks ``[H, 1, K]`` from the forward's ``lse`` and ``delta = <dO, O>`` ``[B, H, Sq, 1]``:
    d/d sink_k = -sum_i P_sink[i, k] * delta_i with P_sink = exp(sink_k - lse_i) (a cheap reduction outside
    the kernels; also used by the block-sparse kernels)."""
    values = sinks[:, 0, :].astype(jnp.float32)  # [H, K]
    p_sink = jnp.exp(values[None, :, None, :] - lse)  # [B, H, Sq, K]
    return (-jnp.sum(p_sink * delta, axis=(0, 2)))[:, None, :].astype(sinks.dtype)


# ---------------------------------------------------------------------------------------------------
# The implementation: a validated FlashAttentionCall (ejkernel.modules.operations.flash_attention)


def _float32_precision(call: FlashAttentionCall):
    return call.precision if call.query.dtype == jnp.float32 else None


def _flash(call: FlashAttentionCall, blocks: TpuFlashBlocks, interpret) -> jax.Array:
    query, key, value = call.query, call.key, call.value
    batch, sq, heads, d = query.shape
    skv, kv_heads = key.shape[1], key.shape[2]
    varlen = call.cum_seqlens_q is not None
    row_multiple = _row_multiple(query.dtype, call.attention_mask is not None)
    kv_lanes = any(x is not None for x in (call.bias, call.attention_mask, call.q_segment_ids, call.cum_seqlens_q))
    validate_blocks(blocks, sq, skv, q_rows=row_multiple, kv_rows=sublane_multiple(query.dtype), kv_lanes=kv_lanes)
    sq_pad, skv_pad = padded_lengths(blocks, sq, skv)
    arrays = {
        "q": _pad_axis(jnp.swapaxes(query, 1, 2), 2, sq_pad),
        "k": _pad_axis(jnp.swapaxes(key, 1, 2), 2, skv_pad),
        "v": _pad_axis(jnp.swapaxes(value, 1, 2), 2, skv_pad),
    }
    bias_shape = None
    if call.bias is not None:
        bias_shape = (call.bias.shape[0], call.bias.shape[1])
        arrays["bias"] = _pad_axis(_pad_axis(call.bias, 2, sq_pad), 3, skv_pad)
    mask_heads = None
    if call.attention_mask is not None:
        mask_heads = call.attention_mask.shape[1]
        arrays["mask"] = _pad_axis(_pad_axis(call.attention_mask.astype(jnp.int8), 2, sq_pad), 3, skv_pad)
    if varlen:
        q_seq, q_pos, q_exists = packed_queries(call.cum_seqlens_q, call.cum_seqlens_k, sq_pad)
        kv_seq, kv_pos, kv_exists = packed_keys(call.cum_seqlens_k, skv_pad)
        arrays["q_pos"] = q_pos[None, :, None]
        arrays["kv_pos"] = kv_pos[None, None, :]
        # tokens past the packed ends are in no sequence (and distinct ones on the two sides)
        arrays["q_seg"] = jnp.where(q_exists, q_seq, -1)[None, :, None]
        arrays["kv_seg"] = jnp.where(kv_exists, kv_seq, -2)[None, None, :]
    elif call.q_segment_ids is not None:
        arrays["q_seg"] = _pad_axis(call.q_segment_ids, 1, sq_pad)[:, :, None]
        arrays["kv_seg"] = _pad_axis(call.kv_segment_ids, 1, skv_pad)[:, None, :]
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = sinks.shape[1]
        arrays["sinks"] = sinks[:, None, :]
    if call.dropout_prob > 0.0:  # scalar memory holds int32: the seed's 32 bits, reinterpreted
        arrays["seed"] = jax.lax.bitcast_convert_type(dropout_hash.seed_bits(call.dropout_seed), jnp.int32).reshape(1)

    st = _Static(
        scale=call.softmax_scale,
        causal=call.causal,
        window=call.sliding_window,
        soft_cap=call.logits_soft_cap,
        dropout_prob=call.dropout_prob,
        sq=sq,
        skv=skv,
        q_offset=skv - sq,
        groups=heads // kv_heads,
        varlen=varlen,
        has_segments=varlen or call.q_segment_ids is not None,
        bias_shape=bias_shape,
        mask_heads=mask_heads,
        num_sinks=num_sinks,
        blocks=blocks,
        interpret=interpret,
        exact_delta=query.dtype == jnp.float32,
        precision=_float32_precision(call),
    )
    out = _attention(st, arrays)
    return jnp.swapaxes(out[:, :, :sq], 1, 2)


_flash_jit = jax.jit(_flash, static_argnames=("blocks", "interpret"))


def flash_attention(call: FlashAttentionCall, blocks: TpuFlashBlocks, *, interpret=False) -> jax.Array:
    """TPU flash attention of a validated call, tiled by ``blocks``.

    ``interpret``: False (compile with Mosaic), True (Pallas' generic interpreter: fastest on CPU), or a
    ``pltpu.InterpretParams`` (the TPU-faithful interpreter; ``detect_races=True`` checks for data races).
    One compiled program per shapes and static fields: an eager call compiles padding, kernels and
    custom VJP once instead of dispatching them op by op; under a caller's ``jit`` it is inlined.
    """
    if call.dropout_seed is not None:  # an int seed becomes an argument: a new seed does not recompile
        call = dataclasses.replace(call, dropout_seed=dropout_hash.seed_bits(call.dropout_seed))
    return _flash_jit(call, blocks=blocks, interpret=interpret)


def _call_facts(call: FlashAttentionCall) -> tuple[int, int, object, int, bool]:
    """(q_len, kv_len, dtype, head_dim, has_mask): what the heuristic and the candidates depend on."""
    query = call.query
    return query.shape[1], call.key.shape[1], query.dtype, query.shape[3], call.attention_mask is not None


class TpuFlashAttention(Implementation[FlashAttentionCall, TpuFlashBlocks]):
    """The Mosaic TPU kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = TpuFlashBlocks

    def supports(self, call: FlashAttentionCall) -> None:
        tpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead
        if call.cum_seqlens_q is not None and call.q_segment_ids is not None:
            raise UnsupportedFeature(
                "pallas TPU flash_attention: segment ids together with cum_seqlens are not implemented "
                "(platform='xla' takes them)"
            )

    def heuristic_config(self, call: FlashAttentionCall) -> TpuFlashBlocks:
        return heuristic_blocks(*_call_facts(call))

    def candidate_configs(self, call: FlashAttentionCall) -> list[TpuFlashBlocks]:
        return candidate_blocks(*_call_facts(call))

    def __call__(self, call: FlashAttentionCall, config: TpuFlashBlocks) -> jax.Array:
        return flash_attention(call, config, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = TpuFlashAttention()


# ---------------------------------------------------------------------------------------------------
# Ring-attention inner block (docs/ops/ring_attention.md): global positions come in as traced starts


def _block_arrays(query, key, value, q_segment_ids, kv_segment_ids, q_start, kv_start, q_len: int, kv_len: int, blocks):
    batch, sq, _, _ = query.shape
    skv = key.shape[1]
    sq_pad, skv_pad = padded_lengths(blocks, sq, skv)
    q_pos = q_start + jnp.arange(sq_pad, dtype=jnp.int32) + (kv_len - q_len)
    kv_pos = kv_start + jnp.arange(skv_pad, dtype=jnp.int32)
    arrays = {
        "q": _pad_axis(jnp.swapaxes(query, 1, 2), 2, sq_pad),
        "k": _pad_axis(jnp.swapaxes(key, 1, 2), 2, skv_pad),
        "v": _pad_axis(jnp.swapaxes(value, 1, 2), 2, skv_pad),
        "q_pos": jnp.broadcast_to(q_pos[None, :, None], (batch, sq_pad, 1)),
        "kv_pos": jnp.broadcast_to(kv_pos[None, None, :], (batch, 1, skv_pad)),
    }
    if q_segment_ids is not None:
        arrays["q_seg"] = _pad_axis(q_segment_ids.astype(jnp.int32), 1, sq_pad)[:, :, None]
        arrays["kv_seg"] = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, skv_pad)[:, None, :]
    return arrays


def block_static(query, key, value, *, blocks: TpuFlashBlocks, has_segments: bool, softmax_scale, causal,
                 sliding_window, logits_soft_cap, precision=None, interpret=False) -> _Static:
    """The static description of a ring block (positions as arrays, f32 outputs); ``precision`` that of
    float32 dots (None for 16-bit inputs)."""
    sq, heads = query.shape[1], query.shape[2]
    skv, kv_heads = key.shape[1], key.shape[2]
    rows = _row_multiple(query.dtype, False)
    # positions travel as [B, 1, S] per-key metadata: key blocks are lane tiles
    validate_blocks(blocks, sq, skv, q_rows=rows, kv_rows=rows, kv_lanes=True)
    return _Static(
        scale=float(softmax_scale), causal=bool(causal),
        window=None if sliding_window is None else (int(sliding_window[0]), int(sliding_window[1])),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), dropout_prob=0.0, sq=sq, skv=skv,
        q_offset=0, groups=heads // kv_heads, varlen=True, has_segments=has_segments, bias_shape=None,
        mask_heads=None, num_sinks=0, blocks=blocks, interpret=interpret, block_outputs=True, precision=precision,
    )


def block_forward(st: _Static, query, key, value, q_segment_ids, kv_segment_ids, *, q_start, kv_start, q_len, kv_len):
    """(o [B, Sq, H, Dv] f32 normalized within the block, lse [B, H, Sq] f32, -inf where nothing is seen)."""
    arrays = _block_arrays(query, key, value, q_segment_ids, kv_segment_ids, q_start, kv_start, q_len, kv_len, st.blocks)
    out, lse = _forward(st, arrays)
    sq = query.shape[1]
    return jnp.swapaxes(out[:, :, :sq], 1, 2), lse[:, :, :sq, 0]


def block_backward(st: _Static, query, key, value, q_segment_ids, kv_segment_ids, d_out, lse, delta, *, q_start,
                   kv_start, q_len, kv_len):
    """(dq_part [B, Sq, H, D], dk [B, Skv, Hkv, D], dv [B, Skv, Hkv, Dv]) in f32, from the final lse/delta."""
    arrays = _block_arrays(query, key, value, q_segment_ids, kv_segment_ids, q_start, kv_start, q_len, kv_len, st.blocks)
    sq, skv = query.shape[1], key.shape[1]
    sq_pad = arrays["q"].shape[2]
    finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing are masked everywhere
    arrays["do"] = _pad_axis(jnp.swapaxes(d_out, 1, 2), 2, sq_pad)
    arrays["lse"] = _pad_axis(finite_lse, 2, sq_pad)[..., None]
    arrays["delta"] = _pad_axis(delta, 2, sq_pad)[..., None]
    dq, dk, dv, _ = _backward(st, arrays)
    return jnp.swapaxes(dq[:, :, :sq], 1, 2), jnp.swapaxes(dk[:, :, :skv], 1, 2), jnp.swapaxes(dv[:, :, :skv], 1, 2)




# ---------------------------------------------------------------------------------------------------
# Micro-benchmark (on a TPU; `python -m ejkernel_pallas.tpu_flash_attention`)


def _benchmark(batch=4, seq=4096, heads=16, dim=128, causal=True, iters=20):
    import time

    from ejkernel.modules import flash_attention as public_flash_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, dim), jnp.bfloat16) for kk in keys)
    fn = jax.jit(lambda q, k, v: public_flash_attention(q, k, v, causal=causal, platform="pallas"))
    fn(q, k, v).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(q, k, v)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / iters
    flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    print(f"tpu flash fwd B={batch} S={seq} H={heads} D={dim} causal={causal}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    _benchmark()
