"""XLA ``blocksparse_attention``: the flash-attention block steps of ``_blockwise`` driven over the mask's
blocks, with a custom VJP (memory O(S): the forward saves the output and the row log-sum-exp only).

Compute blocks are the mask's blocks, so there is nothing to tune (``NoConfig``). A block pair the mask
disables, or that causal / the sliding window leave empty (``ejkernel.ops.utils.block_sparse.
effective_block_mask``, the block semantics shared by every backend), is skipped with ``lax.cond`` (real savings when not vmapped; under ``vmap`` the cond becomes a
select and costs the dense amount). Matmuls run at the call's precision, forward and backward. Every
feature is implemented; nothing is refused.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.modules.operations._contract import NoConfig
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttentionCall
from ejkernel.ops.utils.block_sparse import effective_block_mask
from ejkernel.ops.utils.padding import pad_axis
from ejkernel_xla._blockwise import (
    AttentionParams,
    _blocked_tokens,
    _seq_blocks,
    _unblock,
    backward_block,
    combine,
    forward_block,
    key_tokens,
    pad_tokens,
    query_tokens,
    sink_lse,
)
from ejkernel_xla._jitted import JittedImplementation


def _layout(q, k, q_tok, kv_tok, q_block, kv_block):
    nq, nk = math.ceil(q.shape[1] / q_block), math.ceil(k.shape[1] / kv_block)
    qt = _blocked_tokens(pad_tokens(q_tok, nq * q_block), nq, q_block)
    kt = _blocked_tokens(pad_tokens(kv_tok, nk * kv_block), nk, kv_block)
    return nq, nk, qt, kt


def _forward(params, q_block, kv_block, q, k, v, aux, block_mask, q_tok, kv_tok):
    batch, q_len, num_heads, _ = q.shape
    nq, nk, qt, kt = _layout(q, k, q_tok, kv_tok, q_block, kv_block)
    q_blocks = _seq_blocks(pad_axis(q, 1, nq * q_block), nq, q_block)
    k_blocks = _seq_blocks(pad_axis(k, 1, nk * kv_block), nk, kv_block)
    v_blocks = _seq_blocks(pad_axis(v, 1, nk * kv_block), nk, kv_block)
    masks = jnp.moveaxis(block_mask, (2, 3), (0, 1))  # [nq, nk, B', H']
    sinks = pad_axis(sink_lse(aux, batch, num_heads, q_len), 2, nq * q_block, -jnp.inf)
    init_lse = jnp.moveaxis(sinks.reshape(batch, num_heads, nq, q_block), 2, 0)  # [nq, B, H, bq]

    def one_q_block(xs):
        q_b, qt_b, mask_row, lse0 = xs

        def kv_step(carry, ys):
            k_b, v_b, kt_b, enabled = ys

            def attend():
                out_b, lse_b = forward_block(q_b, k_b, v_b, qt_b, kt_b, params, mask=enabled[:, :, None, None])
                return combine(*carry, out_b, lse_b)

            return lax.cond(jnp.any(enabled), attend, lambda: carry), None

        init = (jnp.zeros((*q_b.shape[:3], v.shape[-1]), jnp.float32), lse0)
        return lax.scan(kv_step, init, (k_blocks, v_blocks, kt, mask_row))[0]

    out, lse = lax.map(one_q_block, (q_blocks, qt, masks, init_lse))
    out = _unblock(out)[:, :q_len].astype(q.dtype)
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, num_heads, nq * q_block)[:, :, :q_len]
    return out, lse


def _backward(params, q_block, kv_block, residuals, d_out):
    q, k, v, aux, block_mask, q_tok, kv_tok, out, lse = residuals
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    nq, nk, qt, kt = _layout(q, k, q_tok, kv_tok, q_block, kv_block)
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def rows(x, fill=0.0):  # [B, H, Sq] -> [nq, B, H, bq]
        return jnp.moveaxis(pad_axis(x, 2, nq * q_block, fill).reshape(batch, num_heads, nq, q_block), 2, 0)

    q_blocks = _seq_blocks(pad_axis(q, 1, nq * q_block), nq, q_block)
    do_blocks = _seq_blocks(pad_axis(d_out, 1, nq * q_block), nq, q_block)
    k_blocks = _seq_blocks(pad_axis(k, 1, nk * kv_block), nk, kv_block)
    v_blocks = _seq_blocks(pad_axis(v, 1, nk * kv_block), nk, kv_block)
    masks = jnp.moveaxis(block_mask, (3, 2), (0, 1))  # [nk, nq, B', H']

    def one_kv_block(dq_all, xs):
        k_b, v_b, kt_b, mask_col = xs

        def q_step(carry, ys):
            q_b, do_b, lse_b, delta_b, qt_b, enabled, dq_b = ys

            def attend():
                dq, dk, dv, _ = backward_block(
                    q_b, k_b, v_b, do_b, lse_b, delta_b, qt_b, kt_b, params, mask=enabled[:, :, None, None]
                )
                return (carry[0] + dk, carry[1] + dv), dq_b + dq

            return lax.cond(jnp.any(enabled), attend, lambda: (carry, dq_b))

        init = (jnp.zeros(k_b.shape, jnp.float32), jnp.zeros(v_b.shape, jnp.float32))
        (dk_b, dv_b), dq_all = lax.scan(
            q_step, init, (q_blocks, do_blocks, rows(lse, -jnp.inf), rows(delta), qt, mask_col, dq_all)
        )
        return dq_all, (dk_b, dv_b)

    dq_all, (dk, dv) = lax.scan(one_kv_block, jnp.zeros(q_blocks.shape, jnp.float32), (k_blocks, v_blocks, kt, masks))
    d_aux = None
    if aux is not None:
        # sinks sit in the denominator only: d aux[h, s] = -sum_{b,i} P_sink[b, h, i, s] * delta[b, h, i]
        aux2 = aux.astype(jnp.float32).reshape(num_heads, -1)
        p_sink = jnp.exp(aux2[None, :, None, :] - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
        d_aux = -jnp.einsum("bhqs,bhq->hs", p_sink, delta).reshape(aux.shape).astype(aux.dtype)
    return (
        _unblock(dq_all)[:, :q_len].astype(q.dtype),
        _unblock(dk)[:, :kv_len].astype(k.dtype),
        _unblock(dv)[:, :kv_len].astype(v.dtype),
        d_aux,
    )


def _blocksparse_fwd(params, q_block, kv_block, q, k, v, aux, block_mask, q_tok, kv_tok):
    with params.matmuls():
        out, lse = _forward(params, q_block, kv_block, q, k, v, aux, block_mask, q_tok, kv_tok)
    return out, (q, k, v, aux, block_mask, q_tok, kv_tok, out, lse)


def _blocksparse_bwd(params, q_block, kv_block, residuals, d_out):
    with params.matmuls():  # traced outside the forward's scope
        dq, dk, dv, d_aux = _backward(params, q_block, kv_block, residuals, d_out)
    return dq, dk, dv, d_aux, None, None, None  # the mask and token descriptions are not differentiable


def _blocksparse_primal(params, q_block, kv_block, q, k, v, aux, block_mask, q_tok, kv_tok):
    with params.matmuls():
        return _forward(params, q_block, kv_block, q, k, v, aux, block_mask, q_tok, kv_tok)[0]


_blocksparse = jax.custom_vjp(_blocksparse_primal, nondiff_argnums=(0, 1, 2))
_blocksparse.defvjp(_blocksparse_fwd, _blocksparse_bwd)


class XlaBlockSparseAttention(JittedImplementation[BlockSparseAttentionCall, NoConfig]):
    config_type = NoConfig

    def compute(self, call: BlockSparseAttentionCall, config: NoConfig) -> jax.Array:
        (batch, q_len), kv_len = call.query.shape[:2], call.key.shape[1]
        q_tok = query_tokens(batch, q_len, kv_len, segment_ids=call.q_segment_ids)
        kv_tok = key_tokens(batch, kv_len, segment_ids=call.kv_segment_ids)
        return _blocksparse(
            AttentionParams.of(call), call.q_block_size, call.kv_block_size, call.query, call.key, call.value,
            call.softmax_aux, effective_block_mask(call), q_tok, kv_tok,
        )


IMPLEMENTATION = XlaBlockSparseAttention()
