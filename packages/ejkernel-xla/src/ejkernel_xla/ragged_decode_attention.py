"""XLA ``ragged_decode_attention``: the shared decode loop (``attend_over_blocks``) over contiguous key
blocks of the dense buffer, masked to each sequence's ``[sequence_start, sequence_end)`` range (and
window). Each key block is read once; GQA groups query heads per kv head instead of repeating KV."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.ragged_decode_attention import RaggedDecodeAttentionCall
from ejkernel_xla._jitted import JittedImplementation
from ejkernel_xla.page_attention import TOKENS_PER_STEP, attend_over_blocks


def _keys_per_step(call: RaggedDecodeAttentionCall, requested: int | None) -> int:
    return max(1, min(call.key.shape[1], requested or TOKENS_PER_STEP))


@dataclasses.dataclass(frozen=True)
class XlaRaggedDecodeAttentionConfig:
    """Keys folded in per scan step (None: ``TOKENS_PER_STEP``); the result does not depend on it."""

    block_keys: int | None = None


class XlaRaggedDecodeAttention(JittedImplementation[RaggedDecodeAttentionCall, XlaRaggedDecodeAttentionConfig]):
    config_type = XlaRaggedDecodeAttentionConfig

    def heuristic_config(self, call: RaggedDecodeAttentionCall) -> XlaRaggedDecodeAttentionConfig:
        """The step ``compute`` takes for a config left at None, spelled out (the config stored is the one run)."""
        return XlaRaggedDecodeAttentionConfig(_keys_per_step(call, None))

    def compute(self, call: RaggedDecodeAttentionCall, config: XlaRaggedDecodeAttentionConfig) -> jax.Array:
        query, key, value = call.query, call.key, call.value
        sequence_start, sequence_end, sliding_window = call.sequence_start, call.sequence_end, call.sliding_window
        batch, num_heads, head_dim = query.shape
        seq_len, num_kv_heads = key.shape[1], key.shape[2]
        block = _keys_per_step(call, config.block_keys)
        num_steps = math.ceil(seq_len / block)
        padded = num_steps * block
        if padded != seq_len:
            key = jnp.pad(key, ((0, 0), (0, padded - seq_len), (0, 0), (0, 0)))
            value = jnp.pad(value, ((0, 0), (0, padded - seq_len), (0, 0), (0, 0)))
        position = sequence_end - 1

        def load_block(i):
            def dequantized(x, scale):  # [B, block, Hkv, D] times a scale per kv head
                x = jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)
                return x if scale is None else x.astype(jnp.float32) * scale[:, None]

            return dequantized(key, call.key_scale), dequantized(value, call.value_scale)

        def visible_block(i):
            keys = (i * block + jnp.arange(block, dtype=jnp.int32))[None, :]
            visible = (keys >= sequence_start[:, None]) & (keys < sequence_end[:, None])
            if sliding_window is not None:
                left, right = sliding_window
                visible &= (keys >= position[:, None] - left) & (keys <= position[:, None] + right)
            return visible

        group = num_heads // num_kv_heads
        sinks = None if call.softmax_aux is None else call.softmax_aux.reshape(num_kv_heads, group, -1)
        out = attend_over_blocks(
            query.reshape(batch, num_kv_heads, group, head_dim),
            num_steps,
            load_block,
            visible_block,
            softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logit_soft_cap,
            sinks=sinks,
        )
        return out.reshape(batch, num_heads, -1).astype(query.dtype)


IMPLEMENTATION = XlaRaggedDecodeAttention()
