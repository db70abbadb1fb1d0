"""XLA ``page_attention`` (semantics: ``docs/ops/page_attention.md``), and the blockwise decode loop the
serving operations share (``attend_over_blocks``).

Decode is memory-bound, so the loop reads each needed KV page once per query row: a ``lax.scan`` over
blocks of pages gathers only that block (never the whole gathered cache), folds it into an online
softmax in float32, and GQA is handled by grouping query heads per kv head instead of repeating KV.
A step whose block no row can see (past every context length, before every window) is skipped with
``lax.cond`` (a select under ``vmap``). The scan body is rematerialized under autodiff, so the backward
pass stores one small carry per step rather than every gathered block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.page_attention import PageAttentionCall
from ejkernel_xla._jitted import JittedImplementation

TOKENS_PER_STEP = 512
"""Default number of cached tokens folded in per scan step (a few pages: big enough to amortize the
loop, small enough that one step's gathered block stays cheap)."""

LoadBlock = Callable[[jax.Array], tuple[jax.Array, jax.Array]]
VisibleBlock = Callable[[jax.Array], jax.Array]


def dequantized_pages(block: jax.Array, scale: jax.Array | None, pages: jax.Array) -> jax.Array:
    """``block`` ``[R, P, page_size, Hkv, D]`` (pages ``pages`` ``[R, P]`` of a cache) times its dequantization
    scale, in float32: ``scale`` per kv head ``[Hkv]`` or per page and kv head ``[num_pages, Hkv]``; None: the
    block as it is (the products convert it)."""
    if scale is None:
        return block
    per_token = scale if scale.ndim == 1 else scale[pages][:, :, None, :]
    return block.astype(jnp.float32) * per_token[..., None]


def attend_over_blocks(
    query: jax.Array,
    num_steps: int,
    load_block: LoadBlock,
    visible_block: VisibleBlock,
    *,
    softmax_scale: float,
    logits_soft_cap: float | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of query rows over keys that arrive block by block.

    ``query``: ``[R, Hkv, G, D]`` (row, kv head, query head within the group). ``load_block(i)`` returns
    step ``i``'s keys ``[R, T, Hkv, D]`` and values ``[R, T, Hkv, Dv]``; ``visible_block(i)`` is bool
    ``[R, T]``. ``sinks``: float ``[Hkv, G, K]`` logits that join the softmax denominator only. Returns
    float32 ``[R, Hkv, G, Dv]``; a row with no visible key is zero.
    """
    rows, kv_heads, group, _ = query.shape
    q = query.astype(jnp.float32) * softmax_scale

    def fold_in(carry, i, visible):
        row_max, row_sum, acc = carry
        keys, values = load_block(i)
        logits = jnp.einsum("rkgd,rtkd->rkgt", q, keys.astype(jnp.float32))
        if logits_soft_cap is not None:
            logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
        logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
        new_max = jnp.maximum(row_max, logits.max(axis=-1))
        # -inf - -inf is NaN: rows that have seen nothing yet keep a finite reference point.
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(logits - safe_max[..., None])
        rescale = jnp.exp(row_max - safe_max)
        row_sum = row_sum * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("rkgt,rtkd->rkgd", probs, values.astype(jnp.float32))
        return new_max, row_sum, acc

    @jax.checkpoint
    def step(carry, i):
        visible = visible_block(i)
        # a block no row can see (past every context, before every window) is neither read nor computed
        return jax.lax.cond(visible.any(), lambda: fold_in(carry, i, visible), lambda: carry), None

    value_dim = jax.eval_shape(load_block, jnp.int32(0))[1].shape[-1]
    init = (
        jnp.full((rows, kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((rows, kv_heads, group), jnp.float32),
        jnp.zeros((rows, kv_heads, group, value_dim), jnp.float32),
    )
    if num_steps == 1:  # no loop: short contexts compile (and run) like one dense block
        (row_max, row_sum, acc), _ = step(init, jnp.int32(0))
    else:
        (row_max, row_sum, acc), _ = jax.lax.scan(step, init, jnp.arange(num_steps, dtype=jnp.int32))
    if sinks is not None:
        sink_logits = sinks.astype(jnp.float32)[None]
        new_max = jnp.maximum(row_max, sink_logits.max(axis=-1))
        rescale = jnp.exp(row_max - new_max)
        row_sum = row_sum * rescale + jnp.exp(sink_logits - new_max[..., None]).sum(axis=-1)
        acc = acc * rescale[..., None]
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)[..., None]


def pages_per_step(page_size: int, pages_needed: int, requested: int | None) -> int:
    """Pages gathered per scan step: the config's choice, else about ``TOKENS_PER_STEP`` tokens."""
    chosen = requested if requested else max(1, TOKENS_PER_STEP // page_size)
    return max(1, min(chosen, pages_needed))


def _pages_needed(call: PageAttentionCall) -> int:
    return max(1, math.ceil(call.max_context_len / call.key_cache.shape[2]))


def padded_tables(block_tables: jax.Array, num_pages: int, width: int) -> jax.Array:
    """``block_tables`` cut/padded to ``width`` columns and clamped into ``[0, num_pages)``: entries that
    are never read semantically may hold anything, and the gather must not fault on them."""
    current = block_tables.shape[1]
    if width > current:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, width - current)))
    return jnp.clip(block_tables[:, :width], 0, num_pages - 1)


@dataclasses.dataclass(frozen=True)
class XlaPageAttentionConfig:
    """Pages gathered per scan step (None: about ``TOKENS_PER_STEP`` tokens); the result does not depend on it."""

    block_pages: int | None = None


class XlaPageAttention(JittedImplementation[PageAttentionCall, XlaPageAttentionConfig]):
    config_type = XlaPageAttentionConfig

    def heuristic_config(self, call: PageAttentionCall) -> XlaPageAttentionConfig:
        """The step ``compute`` takes for a config left at None, spelled out (the config stored is the one run)."""
        block_size = call.key_cache.shape[2]
        return XlaPageAttentionConfig(pages_per_step(block_size, _pages_needed(call), None))

    def compute(self, call: PageAttentionCall, config: XlaPageAttentionConfig) -> jax.Array:
        query, key_cache, value_cache = call.query, call.key_cache, call.value_cache
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        pages_needed = _pages_needed(call)
        step_pages = pages_per_step(block_size, pages_needed, config.block_pages)
        num_steps = math.ceil(pages_needed / step_pages)
        tables = padded_tables(call.block_tables, num_blocks, num_steps * step_pages)
        lengths = jnp.minimum(call.context_lens, call.max_context_len)
        step_tokens = step_pages * block_size

        def load_block(i):
            pages = jax.lax.dynamic_slice_in_dim(tables, i * step_pages, step_pages, axis=1)

            def gather(cache, scale):  # [S, P, Hkv, bs, D] -> [S, P * bs, Hkv, D], dequantized by scale
                block = dequantized_pages(cache[pages].swapaxes(2, 3), scale, pages)
                return block.reshape(num_seqs, step_tokens, num_kv_heads, block.shape[-1])

            return gather(key_cache, call.key_scale), gather(value_cache, call.value_scale)

        def visible_block(i):
            positions = i * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32)
            return positions[None, :] < lengths[:, None]

        grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = attend_over_blocks(
            grouped,
            num_steps,
            load_block,
            visible_block,
            softmax_scale=call.attn_scale,
            logits_soft_cap=call.attn_logits_soft_cap,
        )
        return out.reshape(num_seqs, num_heads, -1).astype(query.dtype)


IMPLEMENTATION = XlaPageAttention()
