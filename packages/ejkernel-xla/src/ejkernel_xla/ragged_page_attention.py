"""XLA ``ragged_page_attention`` (semantics: ``docs/ops/ragged_page_attention.md``).

Query rows are processed in blocks (``lax.map``); for each block the shared decode loop
(``attend_over_blocks``) scans the page table a few pages at a time, gathering for every row only the
pages of its own sequence. Each page is therefore read once per query row that needs it: optimal for
decode rows (one per sequence); prefill rows re-read their sequence's pages, which is the price of a
gather-based fallback with no dynamic shapes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttentionCall
from ejkernel_xla._jitted import JittedImplementation
from ejkernel_xla.page_attention import (
    TOKENS_PER_STEP,
    attend_over_blocks,
    dequantized_pages,
    padded_tables,
    pages_per_step,
)

GATHERED_TOKENS_PER_STEP = 32 * TOKENS_PER_STEP
"""Default bound on query rows x cached tokens gathered per step (keeps one step's gather small)."""


def row_metadata(query_start_loc, context_lens, num_seqs, total_tokens):
    """For every packed row: its sequence, its position in that sequence, the sequence's kv length,
    and whether the row belongs to an active sequence."""
    rows = jnp.arange(total_tokens, dtype=jnp.int32)
    max_num_seqs = context_lens.shape[0]
    sequence = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, max_num_seqs - 1).astype(
        jnp.int32
    )
    start = query_start_loc[sequence]
    q_len = query_start_loc[sequence + 1] - start
    kv_len = context_lens[sequence]
    position = kv_len - q_len + (rows - start)
    active = rows < query_start_loc[num_seqs[0]]
    return sequence, position, kv_len, active


@dataclasses.dataclass(frozen=True)
class XlaRaggedPageAttentionConfig:
    """Loop sizes; the result does not depend on them."""

    block_pages: int | None = None
    """Pages gathered per scan step (None: about ``TOKENS_PER_STEP`` tokens)."""
    block_rows: int | None = None
    """Query rows per block of the outer loop (None: ``GATHERED_TOKENS_PER_STEP`` rows x tokens per step)."""


class XlaRaggedPageAttention(JittedImplementation[RaggedPageAttentionCall, XlaRaggedPageAttentionConfig]):
    config_type = XlaRaggedPageAttentionConfig

    def heuristic_config(self, call: RaggedPageAttentionCall) -> XlaRaggedPageAttentionConfig:
        """The loop sizes ``compute`` takes for a config left at None, spelled out (the config stored is the one
        run)."""
        return XlaRaggedPageAttentionConfig(*_loop_sizes(call, XlaRaggedPageAttentionConfig()))

    def compute(self, call: RaggedPageAttentionCall, config: XlaRaggedPageAttentionConfig) -> jax.Array:
        return _ragged_page_attention(call, config)


def _loop_sizes(call: RaggedPageAttentionCall, config: XlaRaggedPageAttentionConfig) -> tuple[int, int]:
    """(pages per scan step, query rows per block) of ``config``, its None fields resolved."""
    total_tokens = call.queries.shape[0]
    page_size = call.kv_pages.shape[1]
    step_pages = pages_per_step(page_size, call.block_tables.shape[1], config.block_pages)
    rows = max(1, min(total_tokens, config.block_rows or GATHERED_TOKENS_PER_STEP // (step_pages * page_size)))
    return step_pages, rows


def _ragged_page_attention(call: RaggedPageAttentionCall, config: XlaRaggedPageAttentionConfig) -> jax.Array:
    queries, kv_pages, block_tables = call.queries, call.kv_pages, call.block_tables
    sliding_window = call.sliding_window
    total_tokens, num_heads, head_dim = queries.shape
    num_pages, page_size, combined_heads, _ = kv_pages.shape
    num_kv_heads = combined_heads // 2
    group = num_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]

    step_pages, block_rows = _loop_sizes(call, config)
    num_steps = math.ceil(pages_per_seq / step_pages)
    step_tokens = step_pages * page_size
    tables = padded_tables(block_tables, num_pages, num_steps * step_pages)

    num_row_blocks = math.ceil(total_tokens / block_rows)
    padded_rows = num_row_blocks * block_rows

    sequence, position, kv_len, active = row_metadata(
        call.query_start_loc, call.context_lens, call.num_seqs, total_tokens
    )
    pad = padded_rows - total_tokens

    def blocked(x, fill=0):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(num_row_blocks, block_rows, *x.shape[1:])

    grouped = queries.reshape(total_tokens, num_kv_heads, group, head_dim)
    sinks = None
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(num_kv_heads, group, -1)

    def attend_row_block(block):
        q, seq, pos, length, live = block
        row_tables = tables[seq]  # [rows, pages]

        def load_block(i):
            pages = jax.lax.dynamic_slice_in_dim(row_tables, i * step_pages, step_pages, axis=1)
            kv = kv_pages[pages]  # [rows, P, page_size, 2 * Hkv, D]

            def part(first, scale):  # keys (first = 0) or values (1), dequantized -> [rows, T, Hkv, D]
                block = dequantized_pages(kv[:, :, :, first::2], scale, pages)
                return block.reshape(block_rows, step_tokens, num_kv_heads, head_dim)

            return part(0, call.key_scale), part(1, call.value_scale)

        def visible_block(i):
            keys = (i * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32))[None, :]
            visible = (keys < length[:, None]) & (keys <= pos[:, None]) & live[:, None]
            if sliding_window is not None:
                visible &= pos[:, None] - keys < sliding_window
            return visible

        return attend_over_blocks(
            q,
            num_steps,
            load_block,
            visible_block,
            softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap,
            sinks=sinks,
        )

    blocks = (blocked(grouped), blocked(sequence), blocked(position), blocked(kv_len), blocked(active, False))
    if num_row_blocks == 1:  # no loop for a single block of rows (decode batches, short prefills)
        out = attend_row_block(jax.tree.map(lambda x: x[0], blocks))[None]
    else:
        out = jax.lax.map(attend_row_block, blocks)
    return out.reshape(padded_rows, num_heads, head_dim)[:total_tokens].astype(queries.dtype)


IMPLEMENTATION = XlaRaggedPageAttention()
