"""Ring attention's inner block on the TPU kernels (docs/ops/ring_attention.md): global positions come in
as traced starts, outputs in float32 with the block's log-sum-exp, so ring steps merge exactly."""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel.ops.utils.padding import pad_axis

from ejkernel_pallas.tpu_flash_attention.blocks import TpuFlashBlocks, _row_multiple, padded_lengths, validate_blocks
from ejkernel_pallas.tpu_flash_attention.kernels import _backward, _forward, _Static


def _block_arrays(query, key, value, q_segment_ids, kv_segment_ids, q_start, kv_start, q_len: int, kv_len: int, blocks):
    batch, sq, _, _ = query.shape
    skv = key.shape[1]
    sq_pad, skv_pad = padded_lengths(blocks, sq, skv)
    q_pos = q_start + jnp.arange(sq_pad, dtype=jnp.int32) + (kv_len - q_len)
    kv_pos = kv_start + jnp.arange(skv_pad, dtype=jnp.int32)
    arrays = {
        "q": pad_axis(jnp.swapaxes(query, 1, 2), 2, sq_pad),
        "k": pad_axis(jnp.swapaxes(key, 1, 2), 2, skv_pad),
        "v": pad_axis(jnp.swapaxes(value, 1, 2), 2, skv_pad),
        "q_pos": jnp.broadcast_to(q_pos[None, :, None], (batch, sq_pad, 1)),
        "kv_pos": jnp.broadcast_to(kv_pos[None, None, :], (batch, 1, skv_pad)),
    }
    if q_segment_ids is not None:
        arrays["q_seg"] = pad_axis(q_segment_ids.astype(jnp.int32), 1, sq_pad)[:, :, None]
        arrays["kv_seg"] = pad_axis(kv_segment_ids.astype(jnp.int32), 1, skv_pad)[:, None, :]
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
    arrays["do"] = pad_axis(jnp.swapaxes(d_out, 1, 2), 2, sq_pad)
    arrays["lse"] = pad_axis(finite_lse, 2, sq_pad)[..., None]
    arrays["delta"] = pad_axis(delta, 2, sq_pad)[..., None]
    dq, dk, dv, _ = _backward(st, arrays)
    return jnp.swapaxes(dq[:, :, :sq], 1, 2), jnp.swapaxes(dk[:, :, :skv], 1, 2), jnp.swapaxes(dv[:, :, :skv], 1, 2)
