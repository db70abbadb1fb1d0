"""Ragged (packed prefill + decode) attention over a paged KV cache, TPU kernel in Pallas;
docs/ops/ragged_page_attention.md.

Packed query rows are cut into tiles of ``block_q`` rows; a tile may hold rows of several sequences. The
grid walks *visits* -- (query tile, sequence) pairs ordered by sequence, so tiles come in non-decreasing
order -- and, inside a visit, the sequence's logical pages (block table scalar-prefetched; pages past the
last used one re-point at it, so no DMA is issued, and are skipped). Consecutive visits of one tile share
the online-softmax state in VMEM (rows of other sequences are fully masked and keep theirs) and the tile
is written once, when the next visit moves on. Sinks seed the softmax state.

K and V stay interleaved in ``kv_pages``: viewed as ``[pages, page_size, 2 * kv_heads * head_dim]``, the
key of kv head ``k`` is lane block ``2k`` and its value lane block ``2k + 1`` -- a (page_size, head_dim)
tile, which on a TPU needs ``head_dim % 128 == 0`` (checked when compiling for a TPU; interpret mode takes
any head dim). Forward only (an inference op): a gradient raises.

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``RaggedPageAttentionCall`` and a
:class:`TpuRaggedPageBlocks` config (query rows per tile). Precision: float32 calls pass ``call.precision`` to
both dots (Mosaic lowers it to the MXU's contract precision), so none is refused.
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
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttentionCall
from ejkernel.ops.utils.padding import round_up

from ejkernel_pallas.forward_only import forward_only
from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_flash_attention.kernels import init_softmax_state, online_softmax_step
from ejkernel_pallas.tpu_tiling import LANES, TpuTilingError, check_block, sublane_multiple
from ejkernel_pallas.visits import segment_tile_visits


@dataclasses.dataclass(frozen=True)
class TpuRaggedPageBlocks:
    """The kernel's config: packed query rows per tile (a multiple of the dtype's sublanes, or all rows)."""

    block_q: int

    def __post_init__(self):
        if isinstance(self.block_q, bool) or not isinstance(self.block_q, int) or self.block_q <= 0:
            raise ValueError(f"TpuRaggedPageBlocks.block_q must be a positive int, got {self.block_q!r}")


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    soft_cap: float | None
    window: int | None
    block_q: int
    page_size: int
    pages_per_seq: int
    groups: int
    num_sinks: int
    num_visits: int
    interpret: object
    precision: jax.lax.Precision | None = None  # of the float32 dots (see the module docstring)


def _visits(query_start_loc, num_seqs, block_q: int, num_tiles: int, max_num_seqs: int):
    starts = query_start_loc.astype(jnp.int32)
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    active = seq_ids < num_seqs.reshape(()).astype(jnp.int32)
    begin, end = starts[:-1], starts[1:]
    return segment_tile_visits(begin, end, active & (end > begin), block_q, num_tiles)


def _kernel(seq_ref, tile_ref, valid_ref, starts_ref, lens_ref, tables_ref, *refs, st: _Static):
    if st.num_sinks:
        q_ref, k_ref, v_ref, sinks_ref, out_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref = refs
    v_id, page = pl.program_id(1), pl.program_id(2)
    last_visit = st.num_visits - 1
    tile = tile_ref[v_id]
    first_of_tile = jnp.logical_or(v_id == 0, tile_ref[jnp.maximum(v_id - 1, 0)] != tile)
    last_of_tile = jnp.logical_or(v_id == last_visit, tile_ref[jnp.minimum(v_id + 1, last_visit)] != tile)
    seq = seq_ref[v_id]
    kv_len = lens_ref[seq]

    @pl.when(jnp.logical_and(page == 0, first_of_tile))
    def _init():
        init_softmax_state(sinks_ref if st.num_sinks else None, m_ref, l_ref, acc_ref)

    @pl.when(jnp.logical_and(valid_ref[v_id] == 1, page * st.page_size < kv_len))
    def _step():
        q_begin, q_end = starts_ref[seq], starts_ref[seq + 1]
        rows = tile * st.block_q + jax.lax.broadcasted_iota(jnp.int32, (st.block_q, 1), 0)
        position = kv_len - (q_end - q_begin) + rows - q_begin
        cols = page * st.page_size + jax.lax.broadcasted_iota(jnp.int32, (1, st.page_size), 1)
        mask = (rows >= q_begin) & (rows < q_end) & (cols < kv_len) & (cols <= position)
        if st.window is not None:
            mask &= position - cols < st.window
        q = q_ref[...]
        s = jax.lax.dot_general(
            q, k_ref[...], (((1,), (1,)), ((), ())), precision=st.precision, preferred_element_type=jnp.float32
        ) * st.scale
        if st.soft_cap is not None:
            s = st.soft_cap * jnp.tanh(s / st.soft_cap)
        s = jnp.where(mask, s, -jnp.inf)
        p, alpha = online_softmax_step(s, m_ref, l_ref)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=st.precision, preferred_element_type=jnp.float32
        )

    @pl.when(jnp.logical_and(page == pl.num_programs(2) - 1, last_of_tile))
    def _finish():
        l = l_ref[...]
        out_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(out_ref.dtype)


def _forward(st: _Static, queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, softmax_aux):
    total, heads, dim = queries.shape
    num_pages, page_size, two_kv_heads, _ = kv_pages.shape
    max_num_seqs = context_lens.shape[0]
    t_pad = round_up(max(total, 1), st.block_q)
    q = jnp.pad(jnp.swapaxes(queries, 0, 1), ((0, 0), (0, t_pad - total), (0, 0)))  # [H, T, D]
    kv = kv_pages.reshape(num_pages, page_size, two_kv_heads * dim)
    seq, tile, valid = _visits(query_start_loc, num_seqs, st.block_q, t_pad // st.block_q, max_num_seqs)
    lens = context_lens.astype(jnp.int32)
    g = st.groups

    def kv_index(lane_offset):
        def index(h, v, page, seq_r, tile_r, valid_r, starts_r, lens_r, tables_r):
            s = seq_r[v]
            used = jnp.maximum((lens_r[s] + page_size - 1) // page_size, 1)
            physical = jnp.clip(tables_r[s, jnp.minimum(page, used - 1)], 0, num_pages - 1)
            return physical, 0, 2 * (h // g) + lane_offset

        return index

    q_spec = pl.BlockSpec((None, st.block_q, dim), lambda h, v, page, seq_r, tile_r, *_: (h, tile_r[v], 0))
    k_spec = pl.BlockSpec((None, page_size, dim), kv_index(0))
    v_spec = pl.BlockSpec((None, page_size, dim), kv_index(1))
    in_specs = [q_spec, k_spec, v_spec]
    inputs = [q, kv, kv]
    if st.num_sinks:
        in_specs.append(pl.BlockSpec((None, 1, st.num_sinks), lambda h, *_: (h, 0, 0)))
        inputs.append(softmax_aux.reshape(heads, 1, -1))
    if st.interpret is False:  # Mosaic needs lane-dense (page_size, head_dim) tiles of the interleaved cache
        check_block("ragged_page_attention[queries]", q_spec.block_shape, q.shape, q.dtype)
        check_block("ragged_page_attention[kv_pages]", k_spec.block_shape, kv.shape, kv.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(heads, st.num_visits, st.pages_per_seq),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((st.block_q, 1), jnp.float32),
                pltpu.VMEM((st.block_q, 1), jnp.float32),
                pltpu.VMEM((st.block_q, dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, queries.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=st.interpret,
        name="ejkernel_tpu_ragged_page_attention",
    )(seq, tile, valid, query_start_loc.astype(jnp.int32), lens, block_tables.astype(jnp.int32), *inputs)
    out = jnp.swapaxes(out[:, :total], 0, 1)
    live = jnp.arange(total) < query_start_loc[num_seqs.reshape(()).astype(jnp.int32)]
    return jnp.where(live[:, None, None], out, jnp.zeros_like(out))


_attend = forward_only(_forward, "ragged_page_attention")


def heuristic_blocks(total: int, dtype) -> TpuRaggedPageBlocks:
    """Up to 128 query rows per tile, a multiple of the dtype's sublanes."""
    return TpuRaggedPageBlocks(block_q=min(128, round_up(max(total, 1), sublane_multiple(dtype))))


def candidate_blocks(total: int, dtype) -> list[TpuRaggedPageBlocks]:
    """The heuristic, then smaller tiles (fewer wasted rows when prefill and decode mix)."""
    first = heuristic_blocks(total, dtype).block_q
    rows = sublane_multiple(dtype)
    return [TpuRaggedPageBlocks(b) for b in (first, *(b for b in (64, 32, 16) if b < first and b % rows == 0))]


def validate_blocks(blocks: TpuRaggedPageBlocks, total: int, dtype) -> None:
    """Refuse a tile a TPU cannot lay out, naming the config field (before anything is lowered)."""
    rows = sublane_multiple(dtype)
    if blocks.block_q % rows and blocks.block_q < total:
        raise TpuTilingError(
            f"TpuRaggedPageBlocks.block_q={blocks.block_q}: must be a multiple of {rows} (sublanes of the query "
            f"tile) or cover all {total} rows"
        )


def ragged_page_attention(call: RaggedPageAttentionCall, blocks: TpuRaggedPageBlocks, *, interpret=False) -> jax.Array:
    """The TPU kernel on a validated call, ``blocks.block_q`` query rows per tile. ``interpret``: False
    (compile with Mosaic), True (Pallas' generic interpreter) or a ``pltpu.InterpretParams``."""
    queries, kv_pages, softmax_aux = call.queries, call.kv_pages, call.softmax_aux
    total, heads, _ = queries.shape
    two_kv_heads = kv_pages.shape[2]
    validate_blocks(blocks, total, queries.dtype)
    num_tiles = round_up(max(total, 1), blocks.block_q) // blocks.block_q
    sinks = None
    num_sinks = 0
    if softmax_aux is not None:
        sinks = softmax_aux.reshape(heads, -1).astype(jnp.float32)
        num_sinks = sinks.shape[1]
    st = _Static(
        scale=call.softmax_scale,
        soft_cap=call.logits_soft_cap,
        window=call.sliding_window,
        block_q=blocks.block_q,
        page_size=kv_pages.shape[1],
        pages_per_seq=call.block_tables.shape[1],
        groups=heads // (two_kv_heads // 2),
        num_sinks=num_sinks,
        num_visits=num_tiles + call.context_lens.shape[0] - 1,
        interpret=interpret,
        precision=call.precision if queries.dtype == jnp.float32 else None,
    )
    return _attend(
        st, queries, kv_pages, call.context_lens, call.block_tables, call.query_start_loc, call.num_seqs, sinks
    )


class TpuRaggedPageAttention(Implementation[RaggedPageAttentionCall, TpuRaggedPageBlocks]):
    """The Mosaic TPU kernel (see the module docstring); on CPU in interpret mode only."""

    config_type = TpuRaggedPageBlocks

    def supports(self, call: RaggedPageAttentionCall) -> None:
        if jax.default_backend() not in ("tpu", "cpu"):
            raise UnsupportedFeature("pallas ragged_page_attention is a TPU kernel; on GPUs use platform='xla'")
        interpret = tpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead
        if call.kv_pages.dtype != call.queries.dtype or call.key_scale is not None or call.value_scale is not None:
            raise UnsupportedFeature(
                f"pallas ragged_page_attention: quantized or scaled KV caches (kv_pages {call.kv_pages.dtype}, "
                f"queries {call.queries.dtype}, key_scale/value_scale) are not implemented; platform='xla' takes them")
        head_dim = call.queries.shape[-1]
        if interpret is False and head_dim % LANES:
            raise UnsupportedFeature(
                f"pallas ragged_page_attention on TPU needs head_dim % {LANES} == 0 (got {head_dim}): K and V are "
                "lane blocks of the interleaved cache"
            )

    def heuristic_config(self, call: RaggedPageAttentionCall) -> TpuRaggedPageBlocks:
        return heuristic_blocks(call.queries.shape[0], call.queries.dtype)

    def candidate_configs(self, call: RaggedPageAttentionCall) -> list[TpuRaggedPageBlocks]:
        return candidate_blocks(call.queries.shape[0], call.queries.dtype)

    def __call__(self, call: RaggedPageAttentionCall, config: TpuRaggedPageBlocks) -> jax.Array:
        return ragged_page_attention(call, config, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = TpuRaggedPageAttention()
