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

Modules: ``blocks`` (the config :class:`TpuFlashBlocks`, defaults, candidates, tiling checks), ``kernels``
(the Pallas kernels and their launches, shared with block-sparse and ring attention), ``ring_block`` (ring
attention's inner block), this one (custom VJP and the implementation), ``__main__`` (micro-benchmark).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel.ops.utils import dropout as dropout_hash
from ejkernel.ops.utils.padding import pad_axis
from ejkernel.ops.utils.varlen import packed_keys, packed_queries

from ejkernel_pallas.call_fields import attention_fields
from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_flash_attention.blocks import (
    TpuFlashBlocks,
    _row_multiple,
    block_caps,
    candidate_blocks,
    heuristic_blocks,
    padded_lengths,
    validate_blocks,
)
from ejkernel_pallas.tpu_flash_attention.kernels import _backward, _forward, _Static
from ejkernel_pallas.tpu_flash_attention.ring_block import block_backward, block_forward, block_static
from ejkernel_pallas.tpu_tiling import sublane_multiple

TpuFlashBlocks.__module__ = __name__  # its public path (configs and error messages name it from here)


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
        "q": pad_axis(jnp.swapaxes(query, 1, 2), 2, sq_pad),
        "k": pad_axis(jnp.swapaxes(key, 1, 2), 2, skv_pad),
        "v": pad_axis(jnp.swapaxes(value, 1, 2), 2, skv_pad),
    }
    bias_shape = None
    if call.bias is not None:
        bias_shape = (call.bias.shape[0], call.bias.shape[1])
        arrays["bias"] = pad_axis(pad_axis(call.bias, 2, sq_pad), 3, skv_pad)
    mask_heads = None
    if call.attention_mask is not None:
        mask_heads = call.attention_mask.shape[1]
        arrays["mask"] = pad_axis(pad_axis(call.attention_mask.astype(jnp.int8), 2, sq_pad), 3, skv_pad)
    if varlen:
        q_seq, q_pos, q_exists = packed_queries(call.cum_seqlens_q, call.cum_seqlens_k, sq_pad)
        kv_seq, kv_pos, kv_exists = packed_keys(call.cum_seqlens_k, skv_pad)
        arrays["q_pos"] = q_pos[None, :, None]
        arrays["kv_pos"] = kv_pos[None, None, :]
        # tokens past the packed ends are in no sequence (and distinct ones on the two sides)
        arrays["q_seg"] = jnp.where(q_exists, q_seq, -1)[None, :, None]
        arrays["kv_seg"] = jnp.where(kv_exists, kv_seq, -2)[None, None, :]
    elif call.q_segment_ids is not None:
        arrays["q_seg"] = pad_axis(call.q_segment_ids, 1, sq_pad)[:, :, None]
        arrays["kv_seg"] = pad_axis(call.kv_segment_ids, 1, skv_pad)[:, None, :]
    num_sinks = 0
    if call.softmax_aux is not None:
        sinks = call.softmax_aux.reshape(heads, -1)
        num_sinks = sinks.shape[1]
        arrays["sinks"] = sinks[:, None, :]
    if call.dropout_prob > 0.0:  # scalar memory holds int32: the seed's 32 bits, reinterpreted
        arrays["seed"] = jax.lax.bitcast_convert_type(dropout_hash.seed_bits(call.dropout_seed), jnp.int32).reshape(1)

    st = _Static(
        **attention_fields(call, sq=sq, skv=skv, groups=heads // kv_heads),
        dropout_prob=call.dropout_prob,
        varlen=varlen,
        has_segments=varlen or call.q_segment_ids is not None,
        bias_shape=bias_shape,
        mask_heads=mask_heads,
        num_sinks=num_sinks,
        blocks=blocks,
        interpret=interpret,
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


__all__ = [
    "IMPLEMENTATION", "TpuFlashAttention", "TpuFlashBlocks", "block_backward", "block_caps", "block_forward",
    "block_static", "candidate_blocks", "flash_attention", "heuristic_blocks", "sink_gradient", "validate_blocks",
]
