"""The pallas_calls of GPU flash attention (Triton-lowered, or the Mosaic GPU kernels of
:mod:`ejkernel_pallas.mosaic_attention`) and the custom VJP ``_attention`` that joins forward and backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ejkernel_pallas import mosaic_attention
from ejkernel_pallas.gpu_flash_attention.kernels import _dkv_kernel, _dq_kernel, _fwd_kernel, _Static


# ---------------------------------------------------------------------------------------------------
# pallas_call plumbing


def _spec_table(
    st: _Static, bq: int, whole_q: int, whole_kv: int, d: int, dv: int, q_whole: bool, kv_whole: bool, bkv: int
):
    """BlockSpecs over grid (block, b, h): the per-program block on one side, whole rows on the other."""
    g = st.groups
    q_rows = whole_q if q_whole else bq
    kv_rows = whole_kv if kv_whole else bkv
    q_index = (lambda i, b, h: (b, 0, h, 0)) if q_whole else (lambda i, b, h: (b, i, h, 0))
    kv_index = (lambda i, b, h: (b, 0, h // g, 0)) if kv_whole else (lambda i, b, h: (b, i, h // g, 0))
    q_vec = (lambda i, b, h: (b, 0)) if q_whole else (lambda i, b, h: (b, i))
    kv_vec = (lambda i, b, h: (b, 0)) if kv_whole else (lambda i, b, h: (b, i))
    lse_index = (lambda i, b, h: (b, h, 0)) if q_whole else (lambda i, b, h: (b, h, i))
    table = {}
    if st.schedule_dims is not None:  # one schedule row per program: (b, h, its mask block) of [B', H', rows, W]
        mb, mh = st.schedule_dims
        ratio = st.mask_blocks[0] // bq if not q_whole else st.mask_blocks[1] // bkv  # kernel blocks per mask block
        row = lambda i, b, h: (b if mb > 1 else 0, h if mh > 1 else 0, i // ratio, 0)  # noqa: E731
        table["sched_q"] = table["sched_kv"] = pl.BlockSpec((None, None, None, st.schedule_width), row)
    return table | {
        "q": pl.BlockSpec((None, q_rows, None, d), q_index),
        "do": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "out": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "o": pl.BlockSpec((None, q_rows, None, dv), q_index),
        "k": pl.BlockSpec((None, kv_rows, None, d), kv_index),
        "v": pl.BlockSpec((None, kv_rows, None, dv), kv_index),
        # dK/dV are produced per query head and summed over the GQA group outside.
        "dk": pl.BlockSpec((None, kv_rows, None, d), lambda i, b, h: (b, i, h, 0)),
        "dv": pl.BlockSpec((None, kv_rows, None, dv), lambda i, b, h: (b, i, h, 0)),
        "lse": pl.BlockSpec((None, None, q_rows), lse_index),
        "delta": pl.BlockSpec((None, None, q_rows), lse_index),
        "q_pos": pl.BlockSpec((None, q_rows), q_vec),
        "q_seg": pl.BlockSpec((None, q_rows), q_vec),
        "kv_pos": pl.BlockSpec((None, kv_rows), kv_vec),
        "kv_seg": pl.BlockSpec((None, kv_rows), kv_vec),
        "sinks": pl.BlockSpec((None, st.num_sinks), lambda i, b, h: (h, 0)),
        "seed": pl.BlockSpec((1,), lambda i, b, h: (0,)),
    }


_META = ("q_pos", "kv_pos", "q_seg", "kv_seg", "seed")
_SCHEDULES = ("sched_q", "sched_kv")  # block-sparse: the forward and dQ use sched_q, the dK/dV pass sched_kv


def _forward(st: _Static, arrays: dict):
    if st.mosaic_stages:
        sinks = arrays.get("sinks")
        return mosaic_attention.forward(
            arrays["q"], arrays["k"], arrays["v"], arrays["sched_q"], _mosaic_segments(arrays),
            None if sinks is None else mosaic_attention.sink_statistics(sinks),
            **_mosaic_static(st, st.mosaic_stages),
        )
    q, v = arrays["q"], arrays["v"]
    batch, sq_pad, heads, d = q.shape
    skv_pad, dv = v.shape[1], v.shape[3]
    t = st.tuning
    table = _spec_table(st, t.fwd_q, sq_pad, skv_pad, d, dv, q_whole=False, kv_whole=True, bkv=t.fwd_kv)
    names = [n for n in ("q", "k", "v", *_META, "sinks", "sched_q") if n in arrays]
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, names=names + ["out", "lse_out"]),
        grid=(sq_pad // t.fwd_q, batch, heads),
        in_specs=[table[n] for n in names],
        out_specs=[table["out"], table["lse"]],
        out_shape=[
            jax.ShapeDtypeStruct((batch, sq_pad, heads, dv), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=t.fwd_warps, num_stages=t.fwd_stages),
        interpret=st.interpret,
        name="ejkernel_gpu_flash_fwd",
    )(*[arrays[n] for n in names])
    return out, lse


def _mosaic_static(st: _Static, stages: int) -> dict:
    """The static arguments of the Mosaic GPU block-sparse kernels."""
    return dict(scale=st.scale, causal=st.causal, window=st.window, soft_cap=st.soft_cap, q_len=st.sq,
                kv_len=st.skv, kv_block=st.mask_blocks[1], schedule_dims=st.schedule_dims, stages=stages)


def _mosaic_segments(arrays: dict):
    return (arrays["q_seg"], arrays["kv_seg"]) if "q_seg" in arrays else None


def _delta(out, d_out):
    """delta [B, H, S] = <dO_i, O_i>, elementwise in float32 (an einsum could run as a TF32 matmul on a GPU)."""
    return jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)


def _backward(st: _Static, arrays: dict, out, lse, d_out):
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    batch, sq_pad, heads, d = q.shape
    skv_pad, kv_heads, dv = k.shape[1], k.shape[2], v.shape[3]
    t = st.tuning
    delta = _delta(out, d_out)
    if st.mosaic_backward:
        return mosaic_attention.backward(
            q, k, v, d_out, lse, delta, arrays["sched_q"], arrays["sched_kv"], _mosaic_segments(arrays),
            **_mosaic_static(st, 2),
        )
    inputs = {**arrays, "do": d_out, "lse": lse, "delta": delta}
    if st.exact_delta:
        inputs["o"] = out
    names = [n for n in ("q", "k", "v", "do", "o", "lse", "delta", *_META) if n in inputs]
    dkv_names = names + [n for n in ("sched_kv",) if n in inputs]
    dq_names = names + [n for n in ("sched_q",) if n in inputs]
    params = pltriton.CompilerParams(num_warps=t.bwd_warps, num_stages=t.bwd_stages)

    table = _spec_table(st, t.dkv_q, sq_pad, skv_pad, d, dv, q_whole=True, kv_whole=False, bkv=t.dkv_kv)
    grad_dtype = k.dtype if st.groups == 1 else jnp.float32
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, names=dkv_names + ["dk_out", "dv_out"]),
        grid=(skv_pad // t.dkv_kv, batch, heads),
        in_specs=[table[n] for n in dkv_names],
        out_specs=[table["dk"], table["dv"]],
        out_shape=[
            jax.ShapeDtypeStruct((batch, skv_pad, heads, d), grad_dtype),
            jax.ShapeDtypeStruct((batch, skv_pad, heads, dv), grad_dtype),
        ],
        compiler_params=params,
        interpret=st.interpret,
        name="ejkernel_gpu_flash_dkv",
    )(*[inputs[n] for n in dkv_names])
    if st.groups > 1:
        dk = dk.reshape(batch, skv_pad, kv_heads, st.groups, d).sum(axis=3).astype(k.dtype)
        dv_ = dv_.reshape(batch, skv_pad, kv_heads, st.groups, dv).sum(axis=3).astype(v.dtype)

    table = _spec_table(st, t.dq_q, sq_pad, skv_pad, d, dv, q_whole=False, kv_whole=True, bkv=t.dq_kv)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, names=dq_names + ["dq_out"]),
        grid=(sq_pad // t.dq_q, batch, heads),
        in_specs=[table[n] for n in dq_names],
        out_specs=table["q"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=st.interpret,
        name="ejkernel_gpu_flash_dq",
    )(*[inputs[n] for n in dq_names])
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, arrays: dict):
    return _forward(st, arrays)[0]


def _attention_fwd(st, arrays):
    out, lse = _forward(st, arrays)
    return out, (arrays, out, lse)


def _attention_bwd(st, residuals, d_out):
    arrays, out, lse = residuals
    dq, dk, dv = _backward(st, arrays, out, lse, d_out)
    grads = {}
    for name, value in arrays.items():
        if name in ("q", "k", "v"):
            grads[name] = {"q": dq, "k": dk, "v": dv}[name]
        elif name == "sinks":
            # d/d sink = -sum_i exp(sink - lse_i) * delta_i (padded sinks are -inf: zero gradient).
            delta = _delta(out, d_out)
            p_sink = jnp.exp(value.astype(jnp.float32)[None, :, None, :] - lse[..., None])
            grads[name] = (-jnp.sum(p_sink * delta[..., None], axis=(0, 2))).astype(value.dtype)
        else:
            grads[name] = None
    return (grads,)


_attention.defvjp(_attention_fwd, _attention_bwd)
