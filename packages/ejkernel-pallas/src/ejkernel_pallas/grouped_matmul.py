"""Grouped (MoE) matmul for TPU in Pallas (Mosaic TPU), forward and backward; docs/ops/grouped_matmul.md.

Rows of ``lhs`` come in consecutive groups; a row tile may straddle group boundaries. The grid walks a
list of *visits* -- (row tile, group) pairs, ordered by group then tile, so row tiles come in
non-decreasing order -- built from ``group_sizes`` outside the kernel and handed to it through scalar
prefetch. A tile visited by several groups accumulates their masked products in VMEM and is written
once, when the next visit moves to another tile. The visit count has a static bound (row tiles + groups
- 1); unused trailing visits repeat the last real one and do nothing.

Backward: ``d_lhs`` is the same kernel with the weights transposed; ``d_rhs`` is a transposed grouped
matmul (``lhs[rows of g]^T @ d_out[rows of g]``) over the same visits, one output block per group.
Rows no computed group owns are handled outside the kernels (``existing_out`` or zeros).

Every dot, forward and backward, runs at the call's ``precision`` (Mosaic: DEFAULT = bf16 passes, HIGH =
bf16x3, HIGHEST = fp32), so float32 inputs get float32 products by default; nothing is refused for it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.grouped_matmul import GroupedMatmulCall
from ejkernel.ops.utils.padding import round_up

from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_tiling import LANES, TpuTilingError, check_block, sublane_multiple
from ejkernel_pallas.visits import segment_tile_visits

# ---------------------------------------------------------------------------------------------------
# Tuning


@dataclasses.dataclass(frozen=True)
class PallasGroupedMatmulConfig:
    """Tiles of the TPU kernel (None: the heuristic of :func:`choose_tiles`); none changes the result.

    ``block_m`` rows of lhs per tile (a group boundary may fall inside it), a multiple of the dtype's
    sublanes (8 for float32, 16 for 16-bit); ``block_k`` / ``block_n`` multiples of 128, or the whole
    (padded) dim. A tile the TPU cannot take is refused (``TpuTilingError``) naming the field.

    A user's config may leave tiles at None; :meth:`resolved` fills them in (and checks the given ones),
    once, where the call runs (:func:`run_grouped_matmul`). The heuristic and candidate configs the executor
    stores are resolved: every tile the forward runs. (The backward's ``block_k``/``block_n`` are the
    heuristic's for its own dims, whatever the config: it keeps ``block_m`` only.)
    """

    block_m: int | None = None
    block_k: int | None = None
    block_n: int | None = None

    def resolved(self, call: GroupedMatmulCall) -> PallasGroupedMatmulConfig:
        """Every tile for ``call``: this config's, else the heuristic's (:func:`choose_tiles`)."""
        return choose_tiles(self, *_dims(call))


def _lane_block(size: int, want: int | None, cap: int) -> int:
    """A lane-dim block: the whole (padded-to-8) dim when small, else a multiple of 128."""
    if want is not None:
        return want
    return round_up(size, 8) if size <= cap else cap


def choose_tiles(config: PallasGroupedMatmulConfig, m: int, k: int, n: int, dtype) -> PallasGroupedMatmulConfig:
    """Every tile resolved: ``config``'s, else the TPU heuristic (rows: up to 512, a multiple of the dtype's
    sublanes; k and n: the whole dim up to 512, else 512). A tile the TPU cannot take raises
    :class:`TpuTilingError` naming the config field, before anything is traced."""
    rows = sublane_multiple(dtype)
    checks = {"block_m": (m, rows, "rows of the lhs/out tiles"), "block_k": (k, LANES, "lanes of the lhs tile"),
              "block_n": (n, LANES, "lanes of the rhs/out tiles")}

    def get(name):
        value = getattr(config, name)
        if value is None:
            return None
        size, multiple, what = checks[name]
        where = f"{type(config).__name__}.{name}={value!r}"
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TpuTilingError(f"{where}: a tile size must be a positive int")
        if value < size and value % multiple:  # value >= size: one tile over the whole (padded) dim
            raise TpuTilingError(f"{where}: must be a multiple of {multiple} ({what}) or cover the whole dim {size}")
        return value

    return PallasGroupedMatmulConfig(
        block_m=get("block_m") or min(512, round_up(m, rows)),
        block_k=_lane_block(k, get("block_k"), 512),
        block_n=_lane_block(n, get("block_n"), 512),
    )


def _dims(call: GroupedMatmulCall) -> tuple[int, int, int, object]:
    m, k = call.lhs.shape
    n = call.rhs.shape[1] if call.transpose_rhs else call.rhs.shape[2]
    return m, k, n, call.lhs.dtype


# ---------------------------------------------------------------------------------------------------
# Visit metadata (plain XLA on int32; works with traced group sizes)


def _visits(group_sizes, group_offset, num_groups: int, block_m: int, num_tiles: int):
    """(visit_group, visit_tile, visit_valid, group_start, group_end) for the computed groups."""
    sizes = group_sizes.astype(jnp.int32)
    ends_all = jnp.cumsum(sizes)
    offset = jnp.zeros((), jnp.int32) if group_offset is None else group_offset.reshape(()).astype(jnp.int32)
    local = offset + jnp.arange(num_groups, dtype=jnp.int32)
    end = ends_all[local]
    start = end - sizes[local]
    group, tile, valid = segment_tile_visits(start, end, end > start, block_m, num_tiles)
    return group, tile, valid, start, end


# ---------------------------------------------------------------------------------------------------
# Kernels


def _gmm_kernel(group_ref, tile_ref, valid_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                block_m, transpose_rhs, precision, num_visits):
    v, kk = pl.program_id(1), pl.program_id(2)
    tile = tile_ref[v]
    first_of_tile = jnp.logical_or(v == 0, tile_ref[jnp.maximum(v - 1, 0)] != tile)
    last_of_tile = jnp.logical_or(v == num_visits - 1, tile_ref[jnp.minimum(v + 1, num_visits - 1)] != tile)

    @pl.when(jnp.logical_and(kk == 0, first_of_tile))
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(valid_ref[v] == 1)
    def _accumulate():
        g = group_ref[v]
        rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        owned = (rows >= start_ref[g]) & (rows < end_ref[g])
        lhs = lhs_ref[...]
        lhs = jnp.where(owned, lhs, jnp.zeros_like(lhs))
        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += jax.lax.dot_general(lhs, rhs_ref[...], dims, precision=precision, preferred_element_type=jnp.float32)

    @pl.when(jnp.logical_and(kk == pl.num_programs(2) - 1, last_of_tile))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tgmm_kernel(group_ref, tile_ref, valid_ref, start_ref, end_ref, lhs_ref, dout_ref, out_ref, acc_ref, *,
                 block_m, precision, num_visits):
    v = pl.program_id(2)
    g = group_ref[v]
    first_of_group = jnp.logical_or(v == 0, group_ref[jnp.maximum(v - 1, 0)] != g)
    last_of_group = jnp.logical_or(v == num_visits - 1, group_ref[jnp.minimum(v + 1, num_visits - 1)] != g)

    @pl.when(first_of_group)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(valid_ref[v] == 1)
    def _accumulate():
        rows = tile_ref[v] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        owned = (rows >= start_ref[g]) & (rows < end_ref[g])
        lhs = lhs_ref[...]
        lhs = jnp.where(owned, lhs, jnp.zeros_like(lhs))
        acc_ref[...] += jax.lax.dot_general(
            lhs, dout_ref[...], (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    @pl.when(last_of_group)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _pad2(x, rows: int, cols: int):
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _gmm(lhs, rhs, meta, *, tiles: PallasGroupedMatmulConfig, transpose_rhs: bool, out_dtype, precision, interpret):
    """Computed rows of ``lhs @ W[group]``; other rows zero or unspecified (masked by the caller)."""
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bk, bn = tiles.block_m, tiles.block_k, tiles.block_n
    m_pad, k_pad, n_pad = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    lhs_p = _pad2(lhs, m_pad, k_pad)
    rhs_p = jnp.pad(rhs, ((0, 0), (0, n_pad - n), (0, k_pad - k)) if transpose_rhs else ((0, 0), (0, k_pad - k), (0, n_pad - n)))
    num_visits = meta[0].shape[0]
    lhs_spec = pl.BlockSpec((bm, bk), lambda ni, v, kk, grp, tile, *_: (tile[v], kk))
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((None, bn, bk), lambda ni, v, kk, grp, *_: (grp[v], ni, kk))
    else:
        rhs_spec = pl.BlockSpec((None, bk, bn), lambda ni, v, kk, grp, *_: (grp[v], kk, ni))
    out_spec = pl.BlockSpec((bm, bn), lambda ni, v, kk, grp, tile, *_: (tile[v], ni))
    check_block("grouped_matmul[lhs]", lhs_spec.block_shape, lhs_p.shape, lhs.dtype)
    check_block("grouped_matmul[rhs]", rhs_spec.block_shape, rhs_p.shape, rhs.dtype)
    check_block("grouped_matmul[out]", out_spec.block_shape, (m_pad, n_pad), out_dtype)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, block_m=bm, transpose_rhs=transpose_rhs, precision=precision, num_visits=num_visits),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(n_pad // bn, num_visits, k_pad // bk),
            in_specs=[lhs_spec, rhs_spec],
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="ejkernel_tpu_gmm",
    )(*meta, lhs_p, rhs_p)
    del groups
    return out[:m, :n]


def _tgmm(lhs, d_out, meta, num_groups: int, *, tiles: PallasGroupedMatmulConfig, out_dtype, precision, interpret):
    """``[G, K, N]``: per computed group, ``lhs[rows]^T @ d_out[rows]`` (empty groups: unspecified)."""
    m, k = lhs.shape
    n = d_out.shape[1]
    bm, bk, bn = tiles.block_m, tiles.block_k, tiles.block_n
    m_pad, k_pad, n_pad = round_up(m, bm), round_up(k, bk), round_up(n, bn)
    lhs_p = _pad2(lhs, m_pad, k_pad)
    dout_p = _pad2(d_out, m_pad, n_pad)
    num_visits = meta[0].shape[0]
    lhs_spec = pl.BlockSpec((bm, bk), lambda kk, ni, v, grp, tile, *_: (tile[v], kk))
    dout_spec = pl.BlockSpec((bm, bn), lambda kk, ni, v, grp, tile, *_: (tile[v], ni))
    out_spec = pl.BlockSpec((None, bk, bn), lambda kk, ni, v, grp, *_: (grp[v], kk, ni))
    check_block("grouped_matmul[tgmm lhs]", lhs_spec.block_shape, lhs_p.shape, lhs.dtype)
    check_block("grouped_matmul[tgmm d_out]", dout_spec.block_shape, dout_p.shape, d_out.dtype)
    check_block("grouped_matmul[d_rhs]", out_spec.block_shape, (num_groups, k_pad, n_pad), out_dtype)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=bm, precision=precision, num_visits=num_visits),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(k_pad // bk, n_pad // bn, num_visits),
            in_specs=[lhs_spec, dout_spec],
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_groups, k_pad, n_pad), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ejkernel_tpu_tgmm",
    )(*meta, lhs_p, dout_p)
    return out[:, :k, :n]


# ---------------------------------------------------------------------------------------------------
# Custom VJP


@dataclasses.dataclass(frozen=True)
class _Static:
    tiles: PallasGroupedMatmulConfig
    transpose_rhs: bool
    out_dtype: object
    precision: object
    interpret: object


def _row_mask(m: int, start, end):
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    return jnp.any((rows >= start[None, :]) & (rows < end[None, :]), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(st: _Static, lhs, rhs, existing_out, meta):
    return _grouped_fwd(st, lhs, rhs, existing_out, meta)[0]


def _grouped_fwd(st: _Static, lhs, rhs, existing_out, meta):
    out = _gmm(lhs, rhs, meta, tiles=st.tiles, transpose_rhs=st.transpose_rhs, out_dtype=st.out_dtype,
               precision=st.precision, interpret=st.interpret)
    computed = _row_mask(lhs.shape[0], meta[3], meta[4])[:, None]
    fill = jnp.zeros_like(out) if existing_out is None else existing_out.astype(out.dtype)
    return jnp.where(computed, out, fill), (lhs, rhs, existing_out, meta)


def _grouped_bwd(st: _Static, residuals, d_out):
    lhs, rhs, existing_out, meta = residuals
    computed = _row_mask(lhs.shape[0], meta[3], meta[4])[:, None]
    d_comp = jnp.where(computed, d_out, jnp.zeros_like(d_out))
    # d_lhs = d_out @ W^T: the same kernel with the weights read the other way round.
    d_tiles = dataclasses.replace(st.tiles, block_k=_lane_block(d_out.shape[1], None, 512),
                                  block_n=_lane_block(lhs.shape[1], None, 512))
    d_lhs = _gmm(d_comp.astype(lhs.dtype), rhs, meta, tiles=d_tiles, transpose_rhs=not st.transpose_rhs,
                 out_dtype=jnp.float32, precision=st.precision, interpret=st.interpret)
    d_lhs = jnp.where(computed, d_lhs, 0.0).astype(lhs.dtype)
    groups = rhs.shape[0]
    k = lhs.shape[1]
    n = d_out.shape[1]
    w_tiles = PallasGroupedMatmulConfig(
        block_m=st.tiles.block_m, block_k=_lane_block(k, None, 512), block_n=_lane_block(n, None, 512)
    )
    d_w = _tgmm(lhs, d_comp.astype(lhs.dtype), meta, groups, tiles=w_tiles, out_dtype=jnp.float32,
                precision=st.precision, interpret=st.interpret)
    nonempty = (meta[4] > meta[3])[:, None, None]
    d_w = jnp.where(nonempty, d_w, 0.0)
    d_rhs = (jnp.swapaxes(d_w, 1, 2) if st.transpose_rhs else d_w).astype(rhs.dtype)
    d_existing = None
    if existing_out is not None:
        d_existing = jnp.where(computed, jnp.zeros_like(d_out), d_out).astype(existing_out.dtype)
    return d_lhs, d_rhs, d_existing, tuple(None for _ in meta)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# ---------------------------------------------------------------------------------------------------
# The implementation


def run_grouped_matmul(call: GroupedMatmulCall, config: PallasGroupedMatmulConfig, *, interpret):
    """The kernels on ``call`` with ``config``'s tiles; ``interpret`` as in ``pallas_call`` (tests pass
    their own; the implementation reads it from the machine and ``EJKERNEL_PALLAS_INTERPRET``)."""
    tiles = config.resolved(call)  # a user's config may leave tiles at None; the executor's are resolved
    num_tiles = round_up(call.lhs.shape[0], tiles.block_m) // tiles.block_m
    meta = _visits(call.group_sizes, call.group_offset, call.rhs.shape[0], tiles.block_m, num_tiles)
    st = _Static(tiles=tiles, transpose_rhs=call.transpose_rhs, out_dtype=call.preferred_element_type,
                 precision=call.precision, interpret=interpret)
    return _grouped(st, call.lhs, call.rhs, call.existing_out, meta)


class PallasGroupedMatmul(Implementation[GroupedMatmulCall, PallasGroupedMatmulConfig]):
    config_type = PallasGroupedMatmulConfig

    def supports(self, call: GroupedMatmulCall) -> None:
        if jax.default_backend() not in ("tpu", "cpu"):
            raise UnsupportedFeature(
                "pallas grouped_matmul is a TPU kernel (no GPU version); use platform='xla' or 'triton'"
            )
        tpu_interpret_or_refuse()

    def heuristic_config(self, call: GroupedMatmulCall) -> PallasGroupedMatmulConfig:
        return PallasGroupedMatmulConfig().resolved(call)

    def candidate_configs(self, call: GroupedMatmulCall) -> list[PallasGroupedMatmulConfig]:
        """Pruned autotuning candidates: the heuristic, then smaller 128-multiple tiles (at most 8)."""
        m, k, n, _ = _dims(call)
        h = self.heuristic_config(call)
        smaller = lambda size, first: [first] + [b for b in (128, 256) if b < min(first, size)]  # noqa: E731
        candidates = [PallasGroupedMatmulConfig(bm, bk, bn) for bm in smaller(m, h.block_m)
                      for bn in smaller(n, h.block_n) for bk in smaller(k, h.block_k)]
        return candidates[:8]

    def __call__(self, call: GroupedMatmulCall, config: PallasGroupedMatmulConfig) -> jax.Array:
        return run_grouped_matmul(call, config, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = PallasGroupedMatmul()
