"""First GPU check of ejkernel-cuda's native flash-attention kernels, straight on the FFI targets (no
dispatcher): numerics of out/lse/dq/dk/dv against a float32 reference on masked edge cases, then forward and
forward+backward times against cuDNN and FlashAttention-3 at the standard shapes.

    python3 benchmarks/experiments/cuda_flash_probe.py --library path/to/libejkernel_cuda.so [--no-timing]

Prints one line per case; writes JSON to $OUT/cuda_flash_probe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import _flash_attn3, relative_error, time_step  # noqa: E402


def register(library: str) -> None:
    lib = ctypes.cdll.LoadLibrary(library)
    for name in ("EjkFlashForward", "EjkFlashBackward"):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")


def _attrs(scale, causal, window, softcap):
    left, right = window if window is not None else (-1, -1)
    return dict(softmax_scale=np.float32(scale), causal=bool(causal), window_left=np.int64(left),
                window_right=np.int64(right), softcap=np.float32(softcap or 0.0))


def forward(q, k, v, scale, causal, window, softcap):
    b, sq, h, _ = q.shape
    return jax.ffi.ffi_call("EjkFlashForward", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                jax.ShapeDtypeStruct((b, h, sq), jnp.float32)))(
        q, k, v, **_attrs(scale, causal, window, softcap))


def backward(q, k, v, out, lse, do, scale, causal, window, softcap):
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    b, sq, h, d = q.shape
    return jax.ffi.ffi_call("EjkFlashBackward", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                 jax.ShapeDtypeStruct(k.shape, k.dtype),
                                                 jax.ShapeDtypeStruct(v.shape, v.dtype),
                                                 jax.ShapeDtypeStruct((b, h, sq, d), jnp.float32)))(
        q, k, v, do, lse, delta, **_attrs(scale, causal, window, softcap))[:3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def attention(q, k, v, scale, causal, window, softcap):
    return forward(q, k, v, scale, causal, window, softcap)[0]


def _fwd(q, k, v, scale, causal, window, softcap):
    out, lse = forward(q, k, v, scale, causal, window, softcap)
    return out, (q, k, v, out, lse)


def _bwd(scale, causal, window, softcap, res, do):
    q, k, v, out, lse = res
    return backward(q, k, v, out, lse, do, scale, causal, window, softcap)


attention.defvjp(_fwd, _bwd)


def reference(q, k, v, scale, causal, window, softcap):
    """float32 attention with ejkernel's masking rule; (out, lse), empty rows -> 0 and +inf."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    sq, sk, h, hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    pos = jnp.arange(sq)[:, None] + sk - sq
    j = jnp.arange(sk)[None, :]
    visible = jnp.ones((sq, sk), bool)
    if causal:
        visible &= j <= pos
    if window is not None:
        visible &= (j >= pos - window[0]) & (j <= pos + window[1])
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v, precision="highest")
    lse = jnp.where(l[..., 0] > 0, jnp.log(l[..., 0]) + m[..., 0], jnp.inf)
    return out, lse


CASES = [  # (batch, q_len, kv_len, heads, kv_heads, dim, causal, window, softcap, dtype)
    (2, 256, 256, 4, 4, 128, False, None, None, jnp.bfloat16),
    (2, 256, 256, 4, 4, 128, True, None, None, jnp.bfloat16),
    (1, 1000, 1000, 4, 2, 128, True, None, None, jnp.bfloat16),
    (1, 1000, 1000, 4, 2, 128, False, None, None, jnp.float16),
    (1, 77, 300, 4, 1, 64, True, None, None, jnp.float16),
    (1, 300, 77, 4, 1, 64, True, None, None, jnp.bfloat16),  # rows 0..222 see no key
    (2, 513, 513, 8, 2, 128, True, (64, 0), None, jnp.bfloat16),
    (1, 700, 900, 4, 4, 64, False, (100, 30), 30.0, jnp.bfloat16),
    (1, 1024, 1024, 4, 4, 128, True, None, 20.0, jnp.float16),
    (1, 1, 1, 2, 1, 128, False, None, None, jnp.bfloat16),
    (1, 4096, 4096, 2, 2, 128, True, None, None, jnp.bfloat16),
]


def check(case) -> dict:
    b, sq, sk, h, hk, d, causal, window, softcap, dtype = case
    keys = jax.random.split(jax.random.key(sq * 7 + sk), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, hk, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    scale = 1.0 / math.sqrt(d)

    def grads(fn, q, k, v):
        out, pull = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
        return (out, *pull(do.astype(out.dtype)))

    ours_fn = lambda q, k, v: attention(q, k, v, scale, causal, window, softcap)  # noqa: E731
    ref_fn = lambda q, k, v: reference(q, k, v, scale, causal, window, softcap)[0]  # noqa: E731
    got = jax.jit(functools.partial(grads, ours_fn))(q, k, v)
    ref = jax.jit(functools.partial(grads, ref_fn))(*(x.astype(jnp.float32) for x in (q, k, v)))
    lse = jax.jit(lambda q, k, v: forward(q, k, v, scale, causal, window, softcap)[1])(q, k, v)
    lse_ref = reference(q, k, v, scale, causal, window, softcap)[1]
    finite = np.isfinite(np.asarray(lse_ref))
    row = {"case": str(case[:9]) + str(jnp.dtype(dtype)),
           **{name: relative_error(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)},
           "lse_max_abs": float(np.max(np.abs(np.asarray(lse)[finite] - np.asarray(lse_ref)[finite]), initial=0.0)),
           "lse_empty_rows_ok": bool(np.all(np.isinf(np.asarray(lse)[~finite])))}
    # cuDNN's error on the same inputs where it computes the same thing (no window/cap, equal lengths)
    if window is None and not softcap and sq == sk and sq > 1:
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")  # noqa: E731
        try:
            theirs = jax.jit(functools.partial(grads, cudnn))(q, k, v)
            row.update({f"cudnn_{n}": relative_error(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), theirs, ref)})
        except Exception as error:  # noqa: BLE001
            row["cudnn"] = f"{type(error).__name__}: {error}"[:200]
    return row


def timing(seqs, reps, names) -> list[dict]:
    rows = []
    fa3 = _flash_attn3()
    for seq in seqs:
        batch, heads, d = 16384 // seq, 16, 128
        keys = jax.random.split(jax.random.key(seq), 3)
        inputs = []
        for i in range(3):
            ks = jax.random.split(jax.random.fold_in(keys[0], i), 4)
            inputs.append(tuple(jax.random.normal(kk, (batch, seq, heads, d), jnp.float32).astype(jnp.bfloat16)
                                for kk in ks))
        for causal in (False, True):
            impls = {
                "ejkernel-cuda-native": lambda q, k, v, c=causal: attention(q, k, v, 1 / math.sqrt(d), c, None, None),
                "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                                 implementation="cudnn"),
            }
            if fa3 is not None:
                impls["flash-attn3"] = lambda q, k, v, c=causal: fa3(q, k, v, c)
            flops = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
            for name, fn in impls.items():
                if names and name not in names:
                    continue
                fwd = jax.jit(fn)

                def step(q, k, v, do, fn=fn):
                    out, pull = jax.vjp(fn, q, k, v)
                    return pull(do)

                both = jax.jit(step)
                try:
                    t_fwd = time_step(fwd, inputs, "fwd", 3, reps, 5)
                    t_both = time_step(both, inputs, "fwd+bwd", 3, reps, 5)
                except Exception as error:  # noqa: BLE001
                    print(f"# {name} S={seq} causal={causal}: {type(error).__name__}: {error}"[:300])
                    continue
                row = dict(impl=name, seq=seq, causal=causal, fwd_ms=t_fwd * 1e3, fwd_bwd_ms=t_both * 1e3,
                           fwd_tflops=flops / t_fwd / 1e12, fwd_bwd_tflops=3.5 * flops / t_both / 1e12)
                print(json.dumps(row))
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", required=True)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-checks", action="store_true", help="timing only")
    parser.add_argument("--impls", default="", help="comma-separated subset of the timed columns")
    args = parser.parse_args()
    register(args.library)
    result = {"device": str(jax.devices()[0].device_kind), "checks": [], "timing": []}
    for case in [] if args.no_checks else CASES:
        try:
            row = check(case)
        except Exception as error:  # noqa: BLE001
            row = {"case": str(case), "error": f"{type(error).__name__}: {error}"[:500]}
        print(json.dumps(row))
        result["checks"].append(row)
    if not args.no_timing:
        result["timing"] = timing([int(s) for s in args.seqs.split(",")], args.reps,
                                  [name for name in args.impls.split(",") if name])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_flash_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
