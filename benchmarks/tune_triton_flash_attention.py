"""Tune the Triton flash attention's block shapes on the visible GPU (run on the device).

For each head dim and causal flag: time the forward for every forward candidate of
`ejkernel_triton.flash_attention.tuning.config_space`, then forward+backward for every backward candidate
with the best forward fixed; for non-causal calls also the forward candidates of the TMA kernel
(`config_space(..., tma=True)`, entry "d<D>-full-tma", forward fields only, written when it beats the
pointer kernel's best). Every candidate runs through `flash_attention(..., cfg=TritonFlashConfig(...))`.
Writes `<out>/triton_flash_tuned.json`: {device_kind: {"d<D>-<causal|full>": {TritonFlashConfig
fields..., "measured": {...}}}} -- the format the package ships
(`ejkernel_triton/tuned/flash_attention.json`; a missing "-causal" entry falls back to "-full") -- and
prints every timing. `--causal "d64=no;d128=no,yes"` picks the causal flags per head dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules.operations.flash_attention import flash_attention
from ejkernel_triton.flash_attention.tuning import BWD_FIELDS, FWD_FIELDS, config_space


def _time(fn, argsets, reps=5, calls=4):
    for a in argsets[:2]:
        jax.block_until_ready(fn(*a))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for c in range(calls):
            out = fn(*argsets[c % len(argsets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return float(np.median(samples)) * 1e3


def causal_flags(spec: str, head_dim: int) -> list[bool]:
    """'no,yes' for every head dim, or per head dim: 'd64=no;d128=no,yes' ('*=' for the rest)."""
    table = {}
    for part in spec.split(";"):
        name, _, value = part.rpartition("=")
        table[name or "*"] = value
    return [c == "yes" for c in table.get(f"d{head_dim}", table.get("*", "no,yes")).split(",")]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--causal", default="no,yes", help="per head dim: 'no,yes'; 'd64=no' style overrides")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    kind = jax.devices()[0].device_kind
    table = {}
    for d in map(int, args.head_dims.split(",")):
        h, b, s = args.hidden // d, max(1, args.tokens // args.seq), args.seq
        argsets = []
        for i in range(3):
            ks = jax.random.split(jax.random.key(i), 4)
            argsets.append(tuple(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in ks))
        space = config_space(d, d, jnp.bfloat16)
        for causal in causal_flags(args.causal, d):
            def fwd_fn(t):
                return jax.jit(lambda q, k, v, do: flash_attention(q, k, v, causal=causal, cfg=t))

            def bwd_fn(t):
                def f(q, k, v, do):
                    out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, cfg=t), q, k, v)
                    return out, pull(do)
                return jax.jit(f)

            def sweep(label, base, names, space, make_fn):
                """Time `base` with each distinct value of fields `names` found in `space`: (best, its ms)."""
                best_t, best_t_ms = base, float("inf")
                for values in dict.fromkeys(tuple(getattr(t, n) for n in names) for t in space):
                    t = dataclasses.replace(base, **dict(zip(names, values)))
                    try:
                        ms = _time(make_fn(t), argsets)
                    except Exception as exc:  # noqa: BLE001
                        print(f"d={d} causal={causal} {label} {values}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
                        continue
                    print(f"d={d} causal={causal} {label} {values}: {ms:.3f} ms", flush=True)
                    if ms < best_t_ms:
                        best_t, best_t_ms = t, ms
                return best_t, best_t_ms

            best_fwd, best_ms = sweep("fwd", space[0], FWD_FIELDS, space, fwd_fn)
            best, best_bwd_ms = sweep("fwd+bwd", best_fwd, BWD_FIELDS, space, bwd_fn)
            entry = dataclasses.asdict(best)
            entry["measured"] = dict(fwd_ms=round(best_ms, 4), fwd_bwd_ms=round(best_bwd_ms, 4), seq=s, batch=b, heads=h)
            table[f"d{d}-{'causal' if causal else 'full'}"] = entry
            print("BEST", d, causal, entry, flush=True)
            if causal:
                continue
            tma_best, tma_ms = sweep("tma fwd", best, FWD_FIELDS, config_space(d, d, jnp.bfloat16, tma=True), fwd_fn)
            if tma_ms < best_ms:  # else the device keeps the pointer forward
                table[f"d{d}-full-tma"] = {n: getattr(tma_best, n) for n in FWD_FIELDS} | dict(
                    measured=dict(fwd_ms=round(tma_ms, 4), seq=s, batch=b, heads=h))
    out = Path(args.out) / "triton_flash_tuned.json"
    out.write_text(json.dumps({kind: table}, indent=1))
    print(json.dumps({kind: table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
