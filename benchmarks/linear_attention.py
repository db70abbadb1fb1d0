"""Chunked linear attention benchmark: ejkernel's ``gla_attention`` on the Triton and XLA backends against
flash-linear-attention's ``chunk_gla`` (``fla.ops.gla``, Triton through PyTorch), in one run on one GPU.

One command (on a GPU; through the device tool: `bash scripts/device/run.sh python3 benchmarks/linear_attention.py`,
with ``fla-core==0.6.0`` among the carried wheels for the fla column):

    python benchmarks/linear_attention.py                         # T = 1k, 4k, 16k; xla at 4k only
    python benchmarks/linear_attention.py --seqs 4096 --xla-seqs 1024,4096 --out /tmp/out
    python benchmarks/linear_attention.py --seqs 4096 --configs 64:64:4:2,64:128:8:2   # + Triton configs at 4k
    python benchmarks/linear_attention.py --seqs 4096 --xla-seqs "" --no-numerics --fla-last \
        --configs decayed_keys=1,state_block_k=32/state_block_v=32             # candidates, then fla

Shape: B=4, H=8, K=V=128, bf16, per-dimension log-sigmoid gates g [B, T, H, K] (float32), no initial state.
Modes: ``fwd`` (output and final state) and ``fwd+bwd`` (gradients of q, k, v and g under a random
cotangent of the output). fla runs ``chunk_gla(q, k, v, g, output_final_state=False)`` in bf16 with g in
float32; its fwd+bwd is ``o.backward(do)``. Timing: warm-up, then the median over ``--reps`` samples of the
mean of ``--calls`` back-to-back calls, rotating over ``--sets`` fresh input sets (as ``attention.py``);
torch is timed the same way with ``torch.cuda.synchronize``. Numerics: relative L2 error of each backend's
output and gradients against the float32 XLA implementation (HIGHEST matmuls) at T=1024.

Writes ``<out>/linear_attention.json`` (device, date, versions, rows) and ``linear_attention.png``, prints a
table with the ratio triton / fla (the target: <= 1.0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import relative_error, time_calls, versions  # noqa: E402

SHAPE = dict(batch=4, heads=8, dk=128, dv=128)


def jax_inputs(key, batch, total, heads, dk, dv):
    kq, kk, kv, kg, kd = jax.random.split(key, 5)
    q = jax.random.normal(kq, (batch, total, heads, dk), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, total, heads, dk), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, total, heads, dv), jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (batch, total, heads, dk), jnp.float32) + 2.0) / 4.0
    do = jax.random.normal(kd, (batch, total, heads, dv), jnp.bfloat16)
    return q, k, v, g, do


def ejkernel_steps(platform: str, cfg=None):
    from ejkernel.modules import gla_attention

    def fwd(q, k, v, g):
        return gla_attention(q, k, v, g, platform=platform, cfg=cfg)

    def fwd_bwd(q, k, v, g, do):
        (out, _), pullback = jax.vjp(fwd, q, k, v, g)
        return pullback((do, jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def time_jax(platform, total, sets, warmup, reps, calls, cfg=None):
    fwd, fwd_bwd = ejkernel_steps(platform, cfg)
    inputs = [jax_inputs(jax.random.PRNGKey(i), total=total, **SHAPE) for i in range(sets)]
    t_fwd = time_calls(lambda c: fwd(*inputs[c % sets][:4]), warmup, reps, calls)
    t_bwd = time_calls(lambda c: fwd_bwd(*inputs[c % sets]), warmup, reps, calls)
    return t_fwd, t_bwd


def time_fla(total, sets, warmup, reps, calls):
    import os
    import tempfile

    import torch

    # jax-triton sets TRITON_CACHE_DIR to "" at import (it compiles in memory); fla's Triton autotuner in the
    # same process then finds no cache directory ("Could not create or locate cache dir"): give it one.
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fla-triton-cache-")
    from fla.ops.gla import chunk_gla

    b, h, dk, dv = SHAPE["batch"], SHAPE["heads"], SHAPE["dk"], SHAPE["dv"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make():
        q = torch.randn(b, total, h, dk, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k = torch.randn(b, total, h, dk, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        v = torch.randn(b, total, h, dv, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        g = (torch.nn.functional.logsigmoid(torch.randn(b, total, h, dk, device="cuda", generator=gen) + 2.0) / 4.0)
        do = torch.randn(b, total, h, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        return q, k, v, g.requires_grad_(), do

    inputs = [make() for _ in range(sets)]

    def run_fwd(c):
        q, k, v, g, _ = inputs[c % sets]
        with torch.no_grad():
            return chunk_gla(q, k, v, g, output_final_state=False)[0]

    def run_bwd(c):
        q, k, v, g, do = inputs[c % sets]
        for x in (q, k, v, g):
            x.grad = None
        o, _ = chunk_gla(q, k, v, g, output_final_state=False)
        o.backward(do)
        return q.grad

    def timed(run):
        for i in range(warmup):
            run(i)
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for c in range(calls):
                run(c)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / calls)
        return float(np.median(samples))

    return timed(run_fwd), timed(run_bwd)


def numerics(platforms, total=1024):
    """Relative L2 error of out, dq, dk, dv, dg of each platform against float32 XLA at HIGHEST."""
    from ejkernel.modules import gla_attention

    q, k, v, g, do = jax_inputs(jax.random.PRNGKey(99), total=total, **SHAPE)

    def grads(platform, q, k, v, g, do):
        (out, _), pullback = jax.vjp(lambda *a: gla_attention(*a, platform=platform), q, k, v, g)
        return (out, *pullback((do, jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32))))

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(functools.partial(grads, "xla"))(*(x.astype(jnp.float32) for x in (q, k, v)), g,
                                                       do.astype(jnp.float32))
    out = {}
    for platform in platforms:
        got = jax.jit(functools.partial(grads, platform))(q, k, v, g, do)
        out[platform] = {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv", "dg"), got, ref)}
    return out


def plot(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [r for r in rows if "config" in r and r.get("ms")]
    fig, axes = plt.subplots(1, 3 if configs else 2, figsize=(15 if configs else 10, 3.8))
    if configs:  # bars at the config length: the default, each config, fla
        seq = configs[0]["seq"]
        ref = [r for r in rows if r["seq"] == seq and "config" not in r and r["impl"] in ("triton", "fla") and r.get("ms")]
        labels = sorted({r.get("config", r["impl"]) for r in ref + configs}, key=lambda n: (n != "triton", n == "fla", n))
        ax = axes[2]
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            ms = {r.get("config", r["impl"]): r["ms"] for r in ref + configs if r["mode"] == mode}
            ax.barh([j + 0.4 * i for j in range(len(labels))], [ms.get(n, 0) for n in labels], height=0.4, label=mode)
        ax.set_yticks([j + 0.2 for j in range(len(labels))], [n.replace("/", "\n") for n in labels], fontsize=6)
        ax.set_xlabel(f"ms at T={seq}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for impl in ("triton", "xla", "fla"):
            pts = sorted((r["seq"], r["ms"]) for r in rows
                         if r["impl"] == impl and r["mode"] == mode and r.get("ms") and "config" not in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel("ms")
        ax.set_title(f"{mode}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--xla-seqs", default="4096", help="XLA is slow to compile: fewer lengths")
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--no-numerics", action="store_true")
    parser.add_argument("--configs", default="", help="Triton configs to time at --config-seq, comma-separated; "
                        "each either name=value pairs joined by '/' (TritonLinearAttentionConfig.parse, e.g. "
                        "decayed_keys=1/state_block_k=32) or block_k:block_v:num_warps:num_stages[:output_block_v]")
    parser.add_argument("--fla-last", action="store_true", help="time fla after the config rows (a short run "
                        "keeps the config comparison if fla's autotuning runs out of time)")
    parser.add_argument("--config-seq", type=int, default=4096)
    parser.add_argument("--impls", default="triton,xla,fla", help="which of triton, xla, fla to time (fla alone in "
                        "its own process: its first-call autotuning is long; see --append)")
    parser.add_argument("--append", action="store_true", help="add rows to an existing linear_attention.json "
                        "(e.g. fla timed by an earlier process of the same device call)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    doc = dict(benchmark="linear_attention", device=device.device_kind, platform=device.platform,
               date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), versions=versions(),
               shape=SHAPE, dtype="bfloat16", gates="log-sigmoid per dimension (float32)",
               timing=dict(sets=args.sets, warmup=args.warmup, reps=args.reps, calls=args.calls), rows=[], errors={})
    try:
        import fla  # noqa: F401

        doc["versions"]["fla-core"] = __import__("importlib.metadata").metadata.version("fla-core")
        have_fla = True
    except Exception as exc:  # noqa: BLE001
        print("fla not importable:", exc)
        have_fla = False
    json_path = out_dir / "linear_attention.json"
    if args.append and json_path.exists():
        earlier = json.loads(json_path.read_text())
        doc["rows"] = earlier.get("rows", [])
        doc["versions"] = {**earlier.get("versions", {}), **doc["versions"]}
    impls = set(args.impls.split(","))

    def save():
        json_path.write_text(json.dumps(doc, indent=1))

    seqs = [int(s) for s in args.seqs.split(",") if s]
    xla_seqs = {int(s) for s in args.xla_seqs.split(",") if s}
    for total in seqs:
        fla_here = have_fla and not (args.fla_last and total == args.config_seq and args.configs)
        todo = [("triton", None)] + ([("xla", None)] if total in xla_seqs else []) + ([("fla", None)] if fla_here else [])
        todo = [item for item in todo if item[0] in impls]
        for impl, _ in todo:
            t0 = time.perf_counter()
            try:
                if impl == "fla":
                    t_fwd, t_bwd = time_fla(total, args.sets, args.warmup, args.reps, args.calls)
                else:
                    t_fwd, t_bwd = time_jax(impl, total, args.sets, args.warmup, args.reps, args.calls)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                doc["rows"].append(dict(impl=impl, seq=total, mode="fwd", error=repr(exc)[:500]))
                save()
                continue
            for mode, t in (("fwd", t_fwd), ("fwd+bwd", t_bwd)):
                doc["rows"].append(dict(impl=impl, seq=total, mode=mode, ms=round(t * 1e3, 4)))
            print(f"T={total:6d} {impl:7s} fwd {t_fwd * 1e3:8.3f} ms  fwd+bwd {t_bwd * 1e3:8.3f} ms"
                  f"  ({time.perf_counter() - t0:.1f} s incl. compile)", flush=True)
            save()
    if not args.no_numerics:
        try:
            doc["errors"] = numerics(["triton"])
            print("errors vs float32 xla (T=1024):", json.dumps(doc["errors"]))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            doc["errors"] = {"failed": repr(exc)[:500]}
        save()

    for spec in [c for c in args.configs.split(",") if c]:
        from ejkernel_triton.linear_attention import TritonLinearAttentionConfig

        if "=" in spec:
            cfg = TritonLinearAttentionConfig.parse(spec)
        else:
            bk, bv, warps, stages, *out_bv = (int(x) for x in spec.split(":"))
            cfg = TritonLinearAttentionConfig(block_k=bk, block_v=bv, num_warps=warps, num_stages=stages,
                                              output_block_v=out_bv[0] if out_bv else None)
        t0 = time.perf_counter()
        try:
            t_fwd, t_bwd = time_jax("triton", args.config_seq, args.sets, args.warmup, args.reps, args.calls, cfg)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            doc["rows"].append(dict(impl="triton", config=spec, seq=args.config_seq, mode="fwd", error=repr(exc)[:500]))
            save()
            continue
        for mode, t in (("fwd", t_fwd), ("fwd+bwd", t_bwd)):
            doc["rows"].append(dict(impl="triton", config=spec, seq=args.config_seq, mode=mode, ms=round(t * 1e3, 4)))
        print(f"config {spec:40s} T={args.config_seq} fwd {t_fwd * 1e3:8.3f} ms  fwd+bwd {t_bwd * 1e3:8.3f} ms"
              f"  ({time.perf_counter() - t0:.1f} s incl. compile)", flush=True)
        save()
    def draw():
        try:
            plot(doc["rows"], out_dir / "linear_attention.png",
                 f"gla_attention B=4 H=8 K=V=128 bf16, {doc['device']}, {doc['date'][:10]}")
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    if have_fla and args.fla_last and args.configs and args.config_seq in seqs:
        draw()  # a plot without fla survives a timeout during fla's autotuning
        t0 = time.perf_counter()
        try:
            t_fwd, t_bwd = time_fla(args.config_seq, args.sets, args.warmup, args.reps, args.calls)
            for mode, t in (("fwd", t_fwd), ("fwd+bwd", t_bwd)):
                doc["rows"].append(dict(impl="fla", seq=args.config_seq, mode=mode, ms=round(t * 1e3, 4)))
            print(f"T={args.config_seq:6d} fla     fwd {t_fwd * 1e3:8.3f} ms  fwd+bwd {t_bwd * 1e3:8.3f} ms"
                  f"  ({time.perf_counter() - t0:.1f} s incl. compile)", flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            doc["rows"].append(dict(impl="fla", seq=args.config_seq, mode="fwd", error=repr(exc)[:500]))
        save()
    configs = [r for r in doc["rows"] if "config" in r and r.get("ms")]
    if configs:  # each config row against the default and fla at its own length (rows may come from --append)
        def reference(impl, r):
            return next((x["ms"] for x in doc["rows"] if x["impl"] == impl and x["seq"] == r["seq"] and
                         x["mode"] == r["mode"] and "config" not in x and x.get("ms")), None)

        print("\n| config | T | mode | ms | / default | / fla |")
        print("|---|---|---|---|---|---|")
        for r in configs:
            rel = [f"{r['ms'] / ref:.2f}" if ref else "-" for ref in (reference("triton", r), reference("fla", r))]
            print(f"| {r['config']} | {r['seq']} | {r['mode']} | {r['ms']:.3f} | {rel[0]} | {rel[1]} |")
    print("\n| T | mode | triton ms | xla ms | fla ms | triton / fla |")
    print("|---|---|---|---|---|---|")
    for total in seqs:
        for mode in ("fwd", "fwd+bwd"):
            ms = {r["impl"]: r.get("ms") for r in doc["rows"]
                  if r["seq"] == total and r["mode"] == mode and "config" not in r}
            ratio = (f"{ms['triton'] / ms['fla']:.2f}" if ms.get("triton") and ms.get("fla") else "-")
            cell = lambda name: f"{ms[name]:.3f}" if ms.get(name) else "-"  # noqa: E731
            print(f"| {total} | {mode} | {cell('triton')} | {cell('xla')} | {cell('fla')} | {ratio} |")
    draw()
    print("wrote", json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
