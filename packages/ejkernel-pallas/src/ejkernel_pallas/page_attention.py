"""Decode attention over a paged KV cache, TPU (Mosaic) kernel in Pallas; docs/ops/page_attention.md.

Grid (sequence, kv head, logical page). The block table and the effective lengths are scalar-prefetched,
so each step's key/value block is the sequence's physical page, fetched by the pipeline. Pages past a
sequence's last used page re-point at that last page (the same block index, so no new DMA is issued) and
their step is skipped; block-table entries there may hold anything. All query heads of a GQA group are
one (group, head_dim) tile, so each page is read once per kv head. Forward only (an inference op).

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``PageAttentionCall``; the kernel has
nothing to tune (``NoConfig``). Precision: float32 calls pass ``call.precision`` to both dots (Mosaic lowers
it to the MXU's contract precision), so none is refused; 16-bit operands multiply exactly into float32.

TPU tiling: the query tile is (group, head_dim) and the page tile (page_size, head_dim): both span whole
array dims, so any sizes lower; page_size a multiple of 8 (16 for bf16) and head_dim a multiple of 128
avoid padded vregs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.page_attention import PageAttentionCall

from ejkernel_pallas.forward_only import forward_only
from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_tiling import check_block


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    soft_cap: float | None
    page_size: int
    num_pages: int  # grid extent over logical pages
    interpret: object
    precision: jax.lax.Precision | None = None  # of the float32 dots (see the module docstring)


def _kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref, *, st: _Static):
    seq, page = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[seq]

    @pl.when(page == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(page * st.page_size < length)
    def _step():
        q = q_ref[...]
        k = k_ref[...]
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=st.precision, preferred_element_type=jnp.float32
        ) * st.scale
        if st.soft_cap is not None:
            s = st.soft_cap * jnp.tanh(s / st.soft_cap)
        cols = page * st.page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols < length, s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))  # finite: column 0 of this page is visible
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
        m_ref[...] = m_new
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=st.precision, preferred_element_type=jnp.float32
        )

    @pl.when(page == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...]
        out_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(out_ref.dtype)


def _page_index(seq, kv_head, page, lengths, tables, *, page_size: int, num_blocks: int):
    used = jnp.maximum((lengths[seq] + page_size - 1) // page_size, 1)
    physical = tables[seq, jnp.minimum(page, used - 1)]
    return jnp.clip(physical, 0, num_blocks - 1), kv_head, 0, 0


def _forward(st: _Static, query, key_cache, value_cache, lengths, block_tables):
    num_seqs, heads, dim = query.shape
    num_blocks, kv_heads, page_size, _ = key_cache.shape
    group = heads // kv_heads
    q = query.reshape(num_seqs, kv_heads, group, dim)
    kv_index = functools.partial(_page_index, page_size=page_size, num_blocks=num_blocks)
    q_spec = pl.BlockSpec((None, None, group, dim), lambda s, h, p, *_: (s, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, page_size, dim), kv_index)
    check_block("page_attention[query]", q_spec.block_shape, q.shape, q.dtype)
    check_block("page_attention[key_cache]", kv_spec.block_shape, key_cache.shape, key_cache.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_seqs, kv_heads, st.num_pages),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, query.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=st.interpret,
        name="ejkernel_tpu_page_attention",
    )(lengths, block_tables, q, key_cache, value_cache)
    return out.reshape(num_seqs, heads, dim)


_attend = forward_only(_forward, "page_attention")


def page_attention(call: PageAttentionCall, *, interpret=False) -> jax.Array:
    """The TPU kernel on a validated call. ``interpret``: False (compile with Mosaic), True (Pallas' generic
    interpreter) or a ``pltpu.InterpretParams``."""
    page_size = call.key_cache.shape[2]
    max_blocks = call.block_tables.shape[1]
    num_pages = max(1, min(max_blocks, -(-call.max_context_len // page_size)))
    st = _Static(
        scale=call.attn_scale,
        soft_cap=call.attn_logits_soft_cap,
        page_size=page_size,
        num_pages=num_pages,
        interpret=interpret,
        precision=call.precision if call.query.dtype == jnp.float32 else None,
    )
    lengths = jnp.minimum(call.context_lens, call.max_context_len)
    return _attend(st, call.query, call.key_cache, call.value_cache, lengths, call.block_tables)


class PallasPageAttention(Implementation[PageAttentionCall, NoConfig]):
    """The Mosaic TPU kernel (see the module docstring); on CPU in interpret mode only."""

    config_type = NoConfig

    def supports(self, call: PageAttentionCall) -> None:
        if jax.default_backend() not in ("tpu", "cpu"):
            raise UnsupportedFeature("pallas page_attention is a TPU kernel; on GPUs use platform='xla'")
        tpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead
        if call.key_cache.dtype != call.query.dtype or call.key_scale is not None or call.value_scale is not None:
            raise UnsupportedFeature(
                f"pallas page_attention: quantized or scaled KV caches (key_cache {call.key_cache.dtype}, query "
                f"{call.query.dtype}, key_scale/value_scale) are not implemented; platform='xla' takes them")

    def __call__(self, call: PageAttentionCall, config: NoConfig) -> jax.Array:
        return page_attention(call, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = PallasPageAttention()
