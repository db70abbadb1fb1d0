"""One device run: conformance of the Pallas GPU flash attention, then timing against JAX's Pallas `mha`
and cuDNN (the anchors' harness: bf16, D=128, 16 heads, B*S = 16384 tokens, jit, 3 warm-ups, median of 30
forward / 15 forward+backward wall-clock calls with block_until_ready; fwd+bwd FLOPs = 3.5 x fwd).

Calls go to the GPU implementation with a validated call (``cfg``: a ``GpuFlashTuning``). Run from the repo
root:
PYTHONPATH=packages/ejkernel-core/src:packages/ejkernel-pallas/src python3 <this>
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from pallas_test_helpers import flash_call, flash_reference  # noqa: E402

from ejkernel_pallas.gpu_flash_attention import IMPLEMENTATION, GpuFlashTuning  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RESULTS: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "checks": [], "bench": []}


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def vjp_all(fn, args, cotangent):
    out, pull = jax.vjp(fn, *args)
    return out, pull(cotangent)


def pallas_gpu(q, k, v, cfg=None, **kw):
    """The GPU implementation on the validated call (what ``flash_attention(..., platform="pallas")`` runs;
    called directly so the script needs no installed plugin), with ``cfg`` or the heuristic tuning."""
    call = flash_call(q, k, v, **kw)
    return IMPLEMENTATION(call, cfg or IMPLEMENTATION.heuristic_config(call))


def cudnn(q, k, v, causal, scale):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


# ---------------------------------------------------------------------------------------------------
def check(name, dtype, b, sq, skv, h, hkv, d, with_cudnn=False, **kw):
    keys = jax.random.split(jax.random.key(hash(name) % 2**31), 6)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, skv, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32).astype(dtype)
    kw.setdefault("softmax_scale", d**-0.5)
    kernel = jax.jit(lambda q, k, v, do: vjp_all(lambda *a: pallas_gpu(*a, **kw), (q, k, v), do))
    out, grads = kernel(q, k, v, do)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = jax.jit(lambda q, k, v, do: vjp_all(lambda *a: flash_reference(*a, **kw), (q, k, v), do))
    r_out, r_grads = ref(f32(q), f32(k), f32(v), f32(do))
    errs = [rel(out, r_out)] + [rel(g, r) for g, r in zip(grads, r_grads)]
    row = {"case": name, "dtype": jnp.dtype(dtype).name, "err(out,dq,dk,dv)": [f"{e:.2e}" for e in errs]}
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *grads))
    bound = {"bfloat16": (1e-2, 2e-2), "float16": (2e-3, 4e-3), "float32": (1e-5, 1e-4)}[jnp.dtype(dtype).name]
    ok = finite and errs[0] < bound[0] and all(e < bound[1] for e in errs[1:])
    if with_cudnn:
        c = jax.jit(lambda q, k, v, do: vjp_all(lambda *a: cudnn(*a, kw["causal"], kw["softmax_scale"]), (q, k, v), do))
        c_out, c_grads = c(q, k, v, do)
        c_errs = [rel(c_out, r_out)] + [rel(g, r) for g, r in zip(c_grads, r_grads)]
        row["cudnn_err"] = [f"{e:.2e}" for e in c_errs]
        row["ratio_to_cudnn"] = [round(e / max(ce, 1e-12), 2) for e, ce in zip(errs, c_errs)]
        ok = ok and all(e <= 1.5 * ce or e < bound[0] / 4 for e, ce in zip(errs, c_errs))
    row["ok"] = bool(ok)
    RESULTS["checks"].append(row)
    print(json.dumps(row), flush=True)


def run_checks():
    if os.environ.get("CHECKS") == "quick":
        check("causal", jnp.bfloat16, 2, 1024, 1024, 8, 8, 128, with_cudnn=True, causal=True)
        check("gqa+window+cap+sinks, Sq!=Skv, odd", jnp.bfloat16, 2, 700, 1000, 8, 2, 128, causal=True,
              sliding_window=(300, 16), logits_soft_cap=30.0, softmax_aux=jnp.linspace(-1, 1, 8 * 2).reshape(8, 2))
        return
    seg = lambda b, s, cut: jnp.broadcast_to((jnp.arange(s) >= cut).astype(jnp.int32), (b, s))  # noqa: E731
    check("plain", jnp.bfloat16, 2, 1024, 1024, 8, 8, 128, with_cudnn=True, causal=False)
    check("causal", jnp.bfloat16, 2, 1024, 1024, 8, 8, 128, with_cudnn=True, causal=True)
    check("gqa+window+cap+sinks, Sq!=Skv, odd", jnp.bfloat16, 2, 700, 1000, 8, 2, 128, causal=True,
          sliding_window=(300, 16), logits_soft_cap=30.0, softmax_aux=jnp.linspace(-1, 1, 8 * 2).reshape(8, 2))
    check("segments", jnp.bfloat16, 2, 777, 777, 4, 4, 64, causal=False, q_segment_ids=seg(2, 777, 301),
          kv_segment_ids=seg(2, 777, 301))
    check("varlen", jnp.bfloat16, 1, 900, 900, 4, 2, 128, causal=True,
          cum_seqlens_q=jnp.array([0, 100, 550, 870], jnp.int32), cum_seqlens_k=jnp.array([0, 100, 550, 870], jnp.int32))
    check("fp16 causal D=64", jnp.float16, 2, 512, 512, 4, 4, 64, causal=True)
    check("fp32 causal", jnp.float32, 1, 256, 384, 2, 1, 64, causal=True)


# ---------------------------------------------------------------------------------------------------
def timed(fn, args, iters):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench(seq, causal, variants):
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas

    b, h, d = 16384 // seq, 16, 128
    keys = jax.random.split(jax.random.key(seq + causal), 4)
    q, k, v, do = (jax.random.normal(kk, (b, seq, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys)
    scale = d**-0.5
    flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
    impls = {
        "cudnn": lambda q, k, v: cudnn(q, k, v, causal, scale),
        "jax_pallas_mha": lambda q, k, v: jax_pallas.mha(q, k, v, None, sm_scale=scale, causal=causal),
    }
    for label, cfg in variants.items():
        impls[label] = (lambda cfg: lambda q, k, v: pallas_gpu(q, k, v, cfg, softmax_scale=scale, causal=causal))(cfg)
    row = {"S": seq, "B": b, "causal": causal}
    for name, fn in impls.items():
        try:
            fwd = jax.jit(fn)
            both = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
            t_f = timed(fwd, (q, k, v), 30)
            t_b = timed(both, (q, k, v, do), 15)
            row[name] = {"fwd_ms": round(t_f * 1e3, 3), "fwd_tflops": round(flops / t_f / 1e12, 1),
                         "fwdbwd_ms": round(t_b * 1e3, 3), "fwdbwd_tflops": round(3.5 * flops / t_b / 1e12, 1)}
        except Exception as exc:  # keep the run going; record why
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        print(seq, causal, name, row[name], flush=True)
    RESULTS["bench"].append(row)


def main():
    t0 = time.time()
    try:
        run_checks()
    except Exception:
        traceback.print_exc()
    print(f"checks done in {time.time() - t0:.0f}s", flush=True)
    default = {"ejk_default": None}
    # variants of the defaults (GpuFlashTuning's fields not named keep the H200 defaults)
    sweep = {
        "ejk_default": None,
        "ejk_f128x128w8s3": GpuFlashTuning(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3),
        "ejk_f128x64w4s2": GpuFlashTuning(fwd_q=128, fwd_kv=64, fwd_warps=4, fwd_stages=2),
        "ejk_f64x64w4s3": GpuFlashTuning(fwd_q=64, fwd_kv=64, fwd_warps=4, fwd_stages=3),
        "ejk_b64x128_128x64w4s3": GpuFlashTuning(dkv_q=64, dkv_kv=128, dq_q=128, dq_kv=64, bwd_warps=4, bwd_stages=3),
        "ejk_b32x128_64x64w4s3": GpuFlashTuning(dkv_q=32, dkv_kv=128, dq_q=64, dq_kv=64, bwd_warps=4, bwd_stages=3),
        "ejk_b64x64w4s2": GpuFlashTuning(dkv_q=64, dkv_kv=64, dq_q=64, dq_kv=64, bwd_warps=4, bwd_stages=2),
        "ejk_b64x64w8s3": GpuFlashTuning(dkv_q=64, dkv_kv=64, dq_q=64, dq_kv=64, bwd_warps=8, bwd_stages=3),
        "ejk_b128x64_64x128w8s2": GpuFlashTuning(dkv_q=128, dkv_kv=64, dq_q=64, dq_kv=128, bwd_warps=8, bwd_stages=2),
    }
    bench(8192, False, sweep)
    bench(8192, True, default)
    bench(2048, False, default)
    bench(2048, True, default)
    with open(os.path.join(OUT, "pallas_gpu_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print("\nSUMMARY", RESULTS["device"])
    for row in RESULTS["checks"]:
        print("check", row["case"], row["dtype"], "ok" if row["ok"] else "FAIL", row["err(out,dq,dk,dv)"], row.get("ratio_to_cudnn", ""))
    for row in RESULTS["bench"]:
        mha = row.get("jax_pallas_mha", {})
        for name, r in row.items():
            if isinstance(r, dict) and "fwd_tflops" in r:
                ratio = ""
                if "fwd_tflops" in mha:
                    ratio = f"x mha fwd {r['fwd_tflops'] / mha['fwd_tflops']:.2f} fwd+bwd {r['fwdbwd_tflops'] / mha['fwdbwd_tflops']:.2f}"
                print(f"S={row['S']} causal={row['causal']} {name:18s} fwd {r['fwd_tflops']:6.1f} fwd+bwd {r['fwdbwd_tflops']:6.1f} TFLOP/s {ratio}")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
