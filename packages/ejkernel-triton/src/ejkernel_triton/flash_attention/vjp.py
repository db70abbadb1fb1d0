"""The custom VJP and the vmap rules around the kernel calls (jax-triton's primitive has neither).

:func:`attention` is differentiable in q, k, v and the sinks (``aux``); the forward saves the output and
the log-sum-exp, the backward runs `backward.run_backward` and derives the sinks' gradient from its delta.
Under ``jax.vmap`` the vmapped axis folds into the batch axis (one kernel launch), except for varlen and
dropout calls, which loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ejkernel_triton.batching import fold_batch_rule
from ejkernel_triton.flash_attention.backward import run_backward
from ejkernel_triton.flash_attention.common import LOG2E, StaticParams
from ejkernel_triton.flash_attention.forward import run_forward

__all__ = ["attention", "fold_batch_rule", "kernel_calls", "sink_gradient"]  # fold_batch_rule: re-exported (block-sparse, mean pooling)


def sink_gradient(aux, lse, delta):
    """The sinks' gradient [H, num_sinks] from the forward's lse [B, H, Sq] (log2 units) and the backward's
    delta_i = <dO_i, O_i> [B, H, Sq]: d aux[h, s] = -sum_i P_sink[i, s] * delta_i, P_sink = exp(aux - lse)."""
    p_sink = jnp.exp2(aux[None, :, None, :] * LOG2E - lse[..., None])
    p_sink = jnp.where(delta[..., None] == 0.0, 0.0, p_sink)
    return -jnp.einsum("bhsk,bhs->hk", p_sink, delta).astype(aux.dtype)


@functools.lru_cache(maxsize=None)
def kernel_calls(st: StaticParams):
    """The forward and backward kernel calls for `st`, each with its vmap rule."""

    foldable = st.dropout_threshold == 0

    @jax.custom_batching.custom_vmap
    def fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed):
        return tuple(run_forward(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st))

    fwd.def_vmap(fold_batch_rule(fwd, 5, 2, foldable))

    @jax.custom_batching.custom_vmap
    def bwd(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed):
        return tuple(run_backward(q, k, v, do, lse, out, q_seg, kv_seg, cu_q, cu_k, seed, st))

    bwd.def_vmap(fold_batch_rule(bwd, 8, 4, foldable))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def attention(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: StaticParams):
    """Attention output [B, Sq, H, Dv]; `aux` is [H, num_sinks] float32 or None, `seed` uint32[1] or None."""
    return _attention_fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, st: StaticParams):
    fwd, _ = kernel_calls(st)
    out, lse = fwd(q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed)
    return out, (q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, out, lse)


def _attention_bwd(st: StaticParams, res, d_out):
    q, k, v, q_seg, kv_seg, cu_q, cu_k, aux, seed, out, lse = res
    _, bwd = kernel_calls(st)
    d_out = d_out.astype(q.dtype)
    # delta_i = <dO_i, O_i> = sum_j P_ij dP_ij comes back with the gradients (the sinks' need it).
    dq, dk, dv, delta = bwd(q, k, v, d_out, lse, out, q_seg, kv_seg, cu_q, cu_k, seed)
    d_aux = sink_gradient(aux, lse, delta) if aux is not None else None
    return dq, dk, dv, None, None, None, None, d_aux, None


attention.defvjp(_attention_fwd, _attention_bwd)
