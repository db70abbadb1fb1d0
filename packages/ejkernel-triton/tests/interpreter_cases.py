"""Numerics of the Triton kernels through Triton's interpreter, on the host (run by test_triton_interpreter).

TRITON_INTERPRET=1 must be set before triton is imported, so these cases run in a process of their
own. Each case runs forward and gradients (q, k, v and sinks) of a fresh random problem through the public
``flash_attention`` with ``platform="triton"``, compares them with the float64 dense reference
(``ejkernel.testing.flash_attention.reference_flash_attention``), and prints one JSON line per case.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ejkernel.modules.operations.flash_attention import flash_attention  # noqa: E402
from ejkernel.testing.flash_attention import reference_flash_attention  # noqa: E402
from ejkernel_triton.flash_attention import TritonFlashConfig, forward  # noqa: E402
from ejkernel.testing.numerics import relative_error  # noqa: E402
from interpreter_support import compile_for_hopper, random_qkv  # noqa: E402

SMALL_BLOCKS = TritonFlashConfig(32, 32, 4, 1, 32, 32, 32, 32, 4, 1)


def _segments(rng, batch, length, num):
    return jnp.asarray(np.sort(rng.integers(0, num, (batch, length)), axis=1), jnp.int32)


def case(name, *, seed, b=1, sq=37, skv=37, h=1, hkv=1, d=32, dv=None, dtype=jnp.float32, sinks=0,
         segments=False, unmatched_segment=False, varlen=None, vmap=False, hopper=False, **kw):
    """`hopper`: compile as for sm_90, where eligible calls take the TMA forward (`_fwd_tma_kernel`)."""
    compile_for_hopper(hopper)
    tma_calls = []  # which TMA kernels ran ("fwd")
    original_tma = forward.forward_tma
    forward.forward_tma = lambda *a: tma_calls.append("fwd") or original_tma(*a)
    rng = np.random.default_rng(seed)
    dv = dv or d
    ks = jax.random.split(jax.random.key(seed), 5)
    lead = (2,) if vmap else ()
    q, k, v = random_qkv(ks, lead=lead, b=b, sq=sq, skv=skv, h=h, hkv=hkv, d=d, dv=dv, dtype=dtype)
    w = jax.random.normal(ks[3], (*lead, b, sq, h, dv), jnp.float32)
    extra = dict(kw)
    if sinks:
        extra["softmax_aux"] = jax.random.normal(ks[4], (h, sinks), jnp.float32)
    if segments:
        qs = _segments(rng, b, sq, 3)
        kvs = _segments(rng, b, skv, 3)
        if unmatched_segment:  # rows of a segment no key has: they must come out as zeros
            qs = qs.at[:, :5].set(7)
        extra.update(q_segment_ids=qs, kv_segment_ids=kvs)
    if varlen:
        extra.update(cum_seqlens_q=jnp.asarray(varlen[0], jnp.int32), cum_seqlens_k=jnp.asarray(varlen[1], jnp.int32))

    def loss(fn, q, k, v, aux):
        kwargs = dict(extra)
        if aux is not None:
            kwargs["softmax_aux"] = aux
        attend = lambda q, k, v: fn(q, k, v, **kwargs)  # noqa: E731
        if vmap:
            attend = jax.vmap(attend)
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float64) * w), out

    ours = lambda q, k, v, **a: flash_attention(q, k, v, platform="triton", cfg=SMALL_BLOCKS, **a)  # noqa: E731
    aux = extra.pop("softmax_aux", None)
    t0 = time.time()
    grad = jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True)
    (g_ours, out_ours) = grad(ours, q, k, v, aux)
    as_f64 = lambda x: None if x is None else x.astype(jnp.float64)  # noqa: E731
    # the reference compiled once (eager, each of its primitives compiles on its own)
    (g_ref, out_ref) = jax.jit(functools.partial(grad, reference_flash_attention))(*map(as_f64, (q, k, v, aux)))
    result = dict(
        name=name, dtype=jnp.dtype(dtype).name, seconds=round(time.time() - t0, 2),
        out=relative_error(out_ours, out_ref), dq=relative_error(g_ours[0], g_ref[0]), dk=relative_error(g_ours[1], g_ref[1]),
        dv=relative_error(g_ours[2], g_ref[2]),
        d_aux=relative_error(g_ours[3], g_ref[3]) if aux is not None else 0.0,
        finite=bool(all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in (out_ours, *g_ours[:3]))),
    )
    result["tma_kernels"] = sorted(set(tma_calls))
    forward.forward_tma = original_tma
    if unmatched_segment:
        result["masked_rows_zero"] = bool(np.all(np.asarray(out_ours)[:, :5] == 0))
    print(json.dumps(result), flush=True)


CASES = {
    "gqa_cross_lengths": dict(seed=1, sq=37, skv=45, h=4, hkv=2),
    "window_sinks": dict(seed=3, sq=40, skv=40, h=2, sliding_window=(5, 3), sinks=2),
    "segments_unmatched_causal": dict(seed=4, sq=33, skv=33, causal=True, segments=True, unmatched_segment=True),
    # p = 0.6: the dropout threshold is above 2**31 (unsigned compares)
    "varlen_causal_padding_dropout": dict(seed=5, b=1, sq=40, skv=44, causal=True, varlen=([0, 5, 20, 33], [0, 7, 20, 37]),
                                          dropout_prob=0.6, dropout_seed=11),
    "fp16_mqa_headdim40": dict(seed=6, sq=35, skv=35, h=3, hkv=1, d=40, dv=24, dtype=jnp.float16, causal=True),
    # Every row sees one key: the exact dq and dk are 0, and must come out exactly 0 (delta's dot order).
    "diagonal_window_exact_zero": dict(seed=8, sq=45, skv=61, sliding_window=(0, 0)),
    # Sq > Skv, soft cap and dropout with a seed past 32 bits (its low 32 bits are hashed)
    "causal_softcap_dropout_gqa": dict(seed=9, sq=45, skv=37, h=2, hkv=1, causal=True, logits_soft_cap=2.0,
                                       dropout_prob=0.3, dropout_seed=2**33 + 5),
    "vmap_fold": dict(seed=7, b=1, sq=21, skv=21, causal=True, vmap=True),
    # The TMA + warp-specialized forward (Hopper target): GQA, Sq != Skv, soft cap, sinks; and a causal call
    # on the same target, which must keep the pointer kernel.
    "hopper_tma_forward": dict(seed=10, b=2, sq=64, skv=96, h=4, hkv=2, d=128, dtype=jnp.float16, logits_soft_cap=3.0,
                               sinks=1, hopper=True),
    "hopper_causal_pointer_forward": dict(seed=12, b=1, sq=64, skv=64, h=2, hkv=1, d=128, dtype=jnp.float16,
                                          causal=True, hopper=True),
}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        case(name, **CASES[name])
