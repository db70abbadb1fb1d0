"""XLA ``ring_attention``: each device keeps its query block while key/value blocks go round the ring
(``lax.ppermute``); every ring step is blockwise online-softmax attention (``_blockwise``'s
``forward_block`` / ``backward_block`` / ``combine``) on global token positions.

Custom VJP: the forward saves only the local shards, the output and the per-row log-sum-exp. The
backward makes a second trip round the ring in which key, value *and their gradient accumulators*
travel together, so after ``P`` steps every device holds the gradients of its own key/value shard.
Ring steps that causal / sliding-window masking empties entirely are skipped (``lax.cond``). Token positions
follow the call's ``sequence_layout`` (contiguous or zig-zag shards).
Memory per device: O(local shard) plus one [B, H, bq, bk] logits block. The config is flash attention's
(``XlaBlockConfig``: the blocks of every ring step); forward and backward run their matmuls at the
call's precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations._ring_schedule import rotate as _rotate
from ejkernel.modules.operations._ring_schedule import summed_like, varying_like
from ejkernel.modules.operations.ring_attention import RingAttentionCall, ring_token_positions
from ejkernel.ops.utils.padding import pad_axis
from ejkernel_xla._blockwise import (
    AttentionParams,
    BlockSizes,
    Tokens,
    backward_block,
    blocks_may_meet,
    combine,
    forward_block,
    pad_tokens,
    sink_lse,
)
from ejkernel_xla.flash_attention import XlaBlockConfig

F32 = jnp.float32


def _ring_position(axis_name):
    """(P, r): ring size and this device's place on it."""
    if axis_name is None:
        return 1, jnp.int32(0)
    return lax.axis_size(axis_name), lax.axis_index(axis_name)


def _tokens(layout: str, rank, size: int, length: int, offset, segment):
    """The tokens of shard ``rank``'s ``length`` tokens: global positions by the call's sequence layout."""
    index = ring_token_positions(layout, rank, size, length)
    return Tokens(index=index, position=(index + offset)[None], valid=jnp.ones((1, length), bool), segment=segment)


def _blocks(x, n, block, axis=1):
    """Split ``axis`` (padded to n * block) into a leading block axis."""
    x = pad_axis(x, axis, n * block)
    x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblock(x, length, axis=1):
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])
    return lax.slice_in_dim(x, 0, length, axis=axis)


def _token_blocks(tokens: Tokens, n, block):
    tokens = pad_tokens(tokens, n * block)
    split = lambda x: None if x is None else jnp.moveaxis(x.reshape(*x.shape[:-1], n, block), -2, 0)  # noqa: E731
    return Tokens(*(split(x) for x in tokens))


def _step_forward(params, blocks: BlockSizes, q, k, v, q_tok, kv_tok, out, lse):
    """Fold one visiting kv shard into the running (out [B, Sq, H, Dv] f32, lse [B, H, Sq])."""
    q_len, kv_len = q.shape[1], k.shape[1]
    nq, nk = -(-q_len // blocks.q), -(-kv_len // blocks.kv)
    kb, vb, ktb = _blocks(k, nk, blocks.kv), _blocks(v, nk, blocks.kv), _token_blocks(kv_tok, nk, blocks.kv)

    def one_q_block(xs):
        q_b, qt_b, out_b, lse_b = xs

        def kv_step(carry, ys):
            k_b, v_b, kt_b = ys
            return combine(*carry, *forward_block(q_b, k_b, v_b, qt_b, kt_b, params)), None

        return lax.scan(kv_step, (out_b, lse_b), (kb, vb, ktb))[0]

    xs = (_blocks(q, nq, blocks.q), _token_blocks(q_tok, nq, blocks.q), _blocks(out, nq, blocks.q),
          _blocks(lse, nq, blocks.q, axis=2))
    out_blocks, lse_blocks = lax.map(one_q_block, xs)
    return _unblock(out_blocks, q_len), _unblock(lse_blocks, q_len, axis=2)


def _step_backward(params, blocks: BlockSizes, axis_name, q, k, v, d_out, lse, delta, q_tok, kv_tok):
    """(dq, dk, dv) float32 contributions of one visiting kv shard."""
    q_len, kv_len = q.shape[1], k.shape[1]
    nq, nk = -(-q_len // blocks.bwd_q), -(-kv_len // blocks.bwd_kv)
    qb, dob = _blocks(q, nq, blocks.bwd_q), _blocks(d_out, nq, blocks.bwd_q)
    lseb, deltab = _blocks(lse, nq, blocks.bwd_q, axis=2), _blocks(delta, nq, blocks.bwd_q, axis=2)
    qtb = _token_blocks(q_tok, nq, blocks.bwd_q)

    def one_kv_block(dq_all, xs):
        k_b, v_b, kt_b = xs

        def q_step(carry, ys):
            q_b, do_b, lse_b, delta_b, qt_b, dq_b = ys
            dq, dk, dv, _ = backward_block(q_b, k_b, v_b, do_b, lse_b, delta_b, qt_b, kt_b, params)
            return (carry[0] + dk, carry[1] + dv), dq_b + dq

        init = varying_like((jnp.zeros(k_b.shape, F32), jnp.zeros(v_b.shape, F32)), q)
        (dk_b, dv_b), dq_all = lax.scan(q_step, init, (qb, dob, lseb, deltab, qtb, dq_all))
        return dq_all, (dk_b, dv_b)

    xs = (_blocks(k, nk, blocks.bwd_kv), _blocks(v, nk, blocks.bwd_kv), _token_blocks(kv_tok, nk, blocks.bwd_kv))
    dq_all, (dk, dv) = lax.scan(one_kv_block, varying_like(jnp.zeros(qb.shape, F32), q), xs)
    return _unblock(dq_all, q_len), _unblock(dk, kv_len), _unblock(dv, kv_len)


def _layout(axis_name, q, k):
    """Ring size, this device's rank and the query->key position offset."""
    size, rank = _ring_position(axis_name)
    q_len, kv_len = q.shape[1], k.shape[1]
    offset = size * kv_len - size * q_len  # bottom-right alignment on the global lengths
    return size, rank, offset


def _ring_forward(params, blocks, axis_name, layout, q, k, v, q_seg, kv_seg, aux):
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    size, rank, offset = _layout(axis_name, q, k)
    q_tok = _tokens(layout, rank, size, q_len, offset, q_seg)
    out, lse = varying_like((jnp.zeros((batch, q_len, num_heads, v.shape[-1]), F32),
                             sink_lse(aux, batch, num_heads, q_len)), q)

    def step(carry, s):
        out, lse, k_cur, v_cur, seg_cur = carry
        src = (rank - s) % size
        kv_tok = _tokens(layout, src, size, kv_len, 0, seg_cur)
        visible = blocks_may_meet(q_tok, kv_tok, params)
        out, lse = lax.cond(
            visible,
            lambda: _step_forward(params, blocks, q, k_cur, v_cur, q_tok, kv_tok, out, lse),
            lambda: (out, lse),
        )
        k_cur, v_cur, seg_cur = _rotate(axis_name, size, (k_cur, v_cur, seg_cur))
        return (out, lse, k_cur, v_cur, seg_cur), None

    (out, lse, *_), _ = lax.scan(step, (out, lse, k, v, kv_seg), jnp.arange(size))
    return out.astype(q.dtype), lse


def _ring_primal(params, blocks, axis_name, layout, q, k, v, q_seg, kv_seg, aux):
    with params.matmuls():
        return _ring_forward(params, blocks, axis_name, layout, q, k, v, q_seg, kv_seg, aux)[0]


def _ring_fwd(params, blocks, axis_name, layout, q, k, v, q_seg, kv_seg, aux):
    with params.matmuls():
        out, lse = _ring_forward(params, blocks, axis_name, layout, q, k, v, q_seg, kv_seg, aux)
    return out, (q, k, v, q_seg, kv_seg, aux, out, lse)


def _ring_bwd(params, blocks, axis_name, layout, res, d_out):
    with params.matmuls():  # traced later, outside the forward's scope
        return _ring_backward(params, blocks, axis_name, layout, res, d_out)


def _ring_backward(params, blocks, axis_name, layout, res, d_out):
    q, k, v, q_seg, kv_seg, aux, out, lse = res
    q_len, kv_len = q.shape[1], k.shape[1]
    size, rank, offset = _layout(axis_name, q, k)
    q_tok = _tokens(layout, rank, size, q_len, offset, q_seg)
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(F32), out.astype(F32))

    def step(carry, s):
        dq, k_cur, v_cur, seg_cur, dk_cur, dv_cur = carry
        src = (rank - s) % size
        kv_tok = _tokens(layout, src, size, kv_len, 0, seg_cur)
        visible = blocks_may_meet(q_tok, kv_tok, params)
        dq_part, dk_part, dv_part = lax.cond(
            visible,
            lambda: _step_backward(params, blocks, axis_name, q, k_cur, v_cur, d_out, lse, delta, q_tok, kv_tok),
            lambda: varying_like((jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), q),
        )
        # the gradient accumulators travel with their shard: after `size` steps they are home
        k_cur, v_cur, seg_cur, dk_cur, dv_cur = _rotate(
            axis_name, size, (k_cur, v_cur, seg_cur, dk_cur + dk_part, dv_cur + dv_part)
        )
        return (dq + dq_part, k_cur, v_cur, seg_cur, dk_cur, dv_cur), None

    zeros = varying_like((jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), q)
    init = (zeros[0], k, v, kv_seg, zeros[1], zeros[2])
    (dq, _, _, _, dk, dv), _ = lax.scan(step, init, jnp.arange(size))
    d_aux = None
    if aux is not None:
        # sinks sit in the denominator only: d aux[h, k] = -sum_{b,i} exp(aux[h, k] - lse_i) * delta_i
        aux2 = aux.astype(F32)[:, None] if aux.ndim == 1 else aux.astype(F32)
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        d_aux = -jnp.einsum("bhqk,bhq->hk", jnp.exp(aux2[None, :, None, :] - lse_safe[..., None]), delta)
        d_aux = summed_like(d_aux, aux, axis_name)  # aux is replicated: its gradient sums every device's rows
        d_aux = d_aux.reshape(aux.shape).astype(aux.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_aux


_ring = jax.custom_vjp(_ring_primal, nondiff_argnums=(0, 1, 2, 3))
_ring.defvjp(_ring_fwd, _ring_bwd)


class XlaRingAttention(Implementation[RingAttentionCall, XlaBlockConfig]):
    config_type = XlaBlockConfig

    def heuristic_config(self, call: RingAttentionCall) -> XlaBlockConfig:
        """The default blocks of a ring step over this device's shard (the call's shapes), spelled out."""
        return XlaBlockConfig().with_blocks(call.query.shape[1], call.key.shape[1], call.query.shape[3])

    def __call__(self, call: RingAttentionCall, config: XlaBlockConfig) -> jax.Array:
        # a user's config may leave sizes at None: ``blocks`` fills them in as ``with_blocks`` does
        blocks = config.blocks(call.query.shape[1], call.key.shape[1], call.query.shape[3])
        return _ring(
            AttentionParams.of(call), blocks, call.axis_name, call.sequence_layout, call.query, call.key, call.value,
            call.q_segment_ids, call.kv_segment_ids, call.softmax_aux,
        )


IMPLEMENTATION = XlaRingAttention()
