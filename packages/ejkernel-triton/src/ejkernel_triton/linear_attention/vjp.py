"""Kernel launches, the custom VJP and the vmap rules of chunked gated linear attention.

:func:`linear_attention` takes prepared arrays (``__init__`` builds them from the call): q, k [B, T, H, K],
v [B, T, H, V] (one dtype) with T a multiple of ``forward.CHUNK`` and kv heads already repeated, ``a`` float32
[B, T, H, K] the summed log gates, ``h0`` [B, H, K, V] or None. It is differentiable in all five. The
forward saves the in-chunk cumulative gates and the intra-chunk matrix A ([B, T, H, 64] float32, the size
of one more head of q); the backward recomputes the chunk states. Under ``jax.vmap`` the vmapped axis
folds into the batch axis (every array here has the batch first): one launch per kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton

from ejkernel_triton.launch import launch
from ejkernel_triton.linear_attention.backward import _dqkg_kernel, _dv_kernel, _state_grad_kernel
from ejkernel_triton.linear_attention.forward import CHUNK, SUB_CHUNK, _cumsum_kernel, _output_kernel, _state_kernel


@dataclasses.dataclass(frozen=True)
class StaticParams:
    """Everything static about one call (hashable: it keys the custom-VJP and vmap closures)."""

    scale: float
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int
    interpret: bool


def _placeholder():
    return jnp.zeros((1,), jnp.float32)


def chunk_cumsum(a, st: StaticParams):
    """Log gates [B, T, H, K] cumulated inside each chunk (float32; a Triton kernel: XLA's cumsum is slower)."""
    b, t, h, k = a.shape
    return launch(_cumsum_kernel, (a,), (jax.ShapeDtypeStruct(a.shape, jnp.float32),), (t // CHUNK, b * h),
                  num_warps=4, num_stages=1, interpret=st.interpret, H=h, K=k, BT=CHUNK, BK=st.block_k)[0]


def _meta(q, v, st: StaticParams):
    _, _, h, k = q.shape
    return dict(H=h, K=k, V=v.shape[-1], BT=CHUNK,
                DOT_PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def _state_dtype(q):
    # The dots read the states in the inputs' dtype, so bf16 states lose nothing and halve the traffic; fp16
    # (range 65504) keeps float32 states: sums of many k v^T with weak decay could overflow it.
    return jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32


def _states(k, v, gc, a, h0, st: StaticParams):
    """(h_n entering every chunk [B, N, H, K, V], final state [B, H, K, V] float32)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    n = t // CHUNK
    out_shapes = (jax.ShapeDtypeStruct((b, n, h, dk, dv), _state_dtype(k)),
                  jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32))
    grid = (triton.cdiv(dk, st.block_k), triton.cdiv(dv, st.block_v), b * h)
    meta = _meta(k, v, st)
    return launch(_state_kernel, (k, v, gc, a, h0 if h0 is not None else _placeholder(), n), out_shapes, grid,
                  num_warps=st.num_warps, num_stages=st.num_stages, interpret=st.interpret, BK=st.block_k,
                  BV=st.block_v, HAS_H0=h0 is not None, **meta)


def _run_forward(q, k, v, a, h0, st: StaticParams):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n = t // CHUNK
    gc = chunk_cumsum(a, st)
    hs, final = _states(k, v, gc, a, h0, st)
    out_shapes = (jax.ShapeDtypeStruct((b, t, h, dv), q.dtype), jax.ShapeDtypeStruct((b, t, h, CHUNK), jnp.float32))
    o, attn = launch(_output_kernel, (q, k, v, gc, hs, np.float32(st.scale), n), out_shapes,
                     (triton.cdiv(dv, st.block_v), n, b * h), num_warps=st.num_warps, num_stages=st.num_stages,
                     interpret=st.interpret, BC=SUB_CHUNK, BK=st.block_k, BV=st.block_v, **_meta(q, v, st))
    return o, final, gc, attn


def _run_backward(q, k, v, a, gc, h0, attn, do, dht, st: StaticParams):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n = t // CHUNK
    meta = _meta(q, v, st)
    common = dict(num_warps=st.num_warps, num_stages=st.num_stages, interpret=st.interpret, **meta)
    hs, _ = _states(k, v, gc, a, h0, st)
    state_shape = (b, n, h, dk, dv)
    dhs, dh0 = launch(
        _state_grad_kernel, (q, gc, do, dht, np.float32(st.scale), n),
        (jax.ShapeDtypeStruct(state_shape, _state_dtype(q)), jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)),
        (triton.cdiv(dk, st.block_k), triton.cdiv(dv, st.block_v), b * h), BK=st.block_k, BV=st.block_v,
        HAS_DHT=True, **common)
    d_v, d_attn = launch(
        _dv_kernel, (k, v, gc, attn, do, dhs, n),
        (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, t, h, CHUNK), jnp.float32)),
        (n, b * h), BK=st.block_k, BV=st.block_v, **common)
    d_q, d_k, d_a = launch(
        _dqkg_kernel, (q, k, v, gc, hs, do, dhs, d_attn, np.float32(st.scale), n),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        (triton.cdiv(dk, st.block_k), n, b * h), BC=SUB_CHUNK, BK=st.block_k, BV=st.block_v, **common)
    return d_q, d_k, d_v, d_a, dh0


def _fold_batch_rule(fn, num_out: int):
    """vmap rule: every argument has the batch first, so the vmapped axis folds into it (one launch)."""

    def rule(axis_size, in_batched, *args):
        folded = []
        for x, batched in zip(args, in_batched):
            if x is None:
                folded.append(None)
                continue
            if not batched:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        outs = fn(*folded)
        return tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs), (True,) * num_out

    return rule


@functools.lru_cache(maxsize=None)
def _batched_calls(st: StaticParams):
    @jax.custom_batching.custom_vmap
    def fwd(q, k, v, a, h0):
        return tuple(_run_forward(q, k, v, a, h0, st))

    fwd.def_vmap(_fold_batch_rule(fwd, 4))

    @jax.custom_batching.custom_vmap
    def bwd(q, k, v, a, gc, h0, attn, do, dht):
        return tuple(_run_backward(q, k, v, a, gc, h0, attn, do, dht, st))

    bwd.def_vmap(_fold_batch_rule(bwd, 5))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def linear_attention(q, k, v, a, h0, st: StaticParams):
    """``(o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32)`` (see the module docstring)."""
    return _linear_attention_fwd(q, k, v, a, h0, st)[0]


def _linear_attention_fwd(q, k, v, a, h0, st: StaticParams):
    fwd, _ = _batched_calls(st)
    o, final, gc, attn = fwd(q, k, v, a, h0)
    return (o, final), (q, k, v, a, gc, h0, attn)


def _linear_attention_bwd(st: StaticParams, res, cotangents):
    q, k, v, a, gc, h0, attn = res
    do, dht = cotangents
    _, bwd = _batched_calls(st)
    dq, dk, dv, da, dh0 = bwd(q, k, v, a, gc, h0, attn, do.astype(q.dtype), dht.astype(jnp.float32))
    return dq, dk, dv, da, None if h0 is None else dh0.astype(h0.dtype)


linear_attention.defvjp(_linear_attention_fwd, _linear_attention_bwd)
