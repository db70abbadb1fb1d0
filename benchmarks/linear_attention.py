"""Chunked linear attention benchmark: ejkernel's ``gla_attention``, ``recurrent_attention`` and
``lightning_attention`` on the Triton and XLA backends against flash-linear-attention's chunk kernels
(Triton through PyTorch), in one run on one GPU.

One command (on a GPU; through the device tool: `bash scripts/device/run.sh python3 benchmarks/linear_attention.py`,
with ``fla-core==0.6.0`` among the carried wheels for the fla column):

    python benchmarks/linear_attention.py                         # gla, T = 1k, 4k, 16k; xla at 4k only
    python benchmarks/linear_attention.py --op lightning --xla-seqs ""   # against chunk_lightning_attn
    python benchmarks/linear_attention.py --op recurrent --varlen 8     # scalar gates, 8 packed sequences
    python benchmarks/linear_attention.py --seqs 4096 --configs 64:64:4:2,64:128:8:2   # + Triton configs at 4k
    python benchmarks/linear_attention.py --seqs 4096 --xla-seqs "" --no-numerics --fla-last \
        --configs decayed_keys=1,state_block_k=32/state_block_v=32             # candidates, then fla

Shape: B=4, H=8, K=V=128, bf16, no initial state; ``--varlen N``: batch 1 of 4·T tokens cut into N sequences
of random lengths (``cu_seqlens``, the same for both libraries). Gates (float32, log-sigmoid): ``--op gla``
per dimension g [B, T, H, K] against fla's ``chunk_gla``; ``--op recurrent`` scalar g [B, T, H] against
``chunk_simple_gla``; ``--op lightning`` the per-head decay of layer 3 of 24 against ``chunk_lightning_attn``.
Modes: ``fwd`` (output and final state, fla with ``output_final_state=True`` too) and ``fwd+bwd`` (gradients
of q, k, v and the gate under a random cotangent of the output; fla: ``o.backward(do)``). Timing: warm-up,
then the median over ``--reps`` samples of the mean of ``--calls`` back-to-back calls, rotating over
``--sets`` fresh input sets (as ``attention.py``); torch is timed the same way with ``torch.cuda.synchronize``.
Numerics: relative L2 error of each backend's output and gradients against the float32 XLA implementation
(HIGHEST matmuls) at T=1024.

Writes ``<out>/linear_attention[-<op>][-varlen<N>].json`` (device, date, versions, rows) and a PNG, prints a
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
from attention import give_fla_a_triton_cache, relative_error, time_calls, versions  # noqa: E402

SHAPE = dict(batch=4, heads=8, dk=128, dv=128)


# op -> (ejkernel module function, the gate it takes, fla's chunk kernel (module, name)).
OPS = {
    "gla": ("gla_attention", "dim", ("fla.ops.gla", "chunk_gla")),
    "recurrent": ("recurrent_attention", "scalar", ("fla.ops.simple_gla", "chunk_simple_gla")),
    "lightning": ("lightning_attention", None, ("fla.ops.lightning_attn", "chunk_lightning_attn")),
}
LIGHTNING_LAYER = dict(layer_idx=3, num_layers=24)  # a decay of -(8/H)(1 - 3/24)·h per head


def varlen_offsets(total: int, count: int, seed: int = 0) -> np.ndarray:
    """cu_seqlens of ``count`` sequences of random lengths (at least 64 tokens) summing to ``total``."""
    if not 1 <= count <= total // 64:
        raise ValueError(f"--varlen {count}: {total} tokens hold 1 to {total // 64} sequences of at least 64 tokens")
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(64, total - 63, 64), count - 1, replace=False))
    return np.concatenate([[0], cuts, [total]]).astype(np.int32)


def gate_shape(op, batch, total, heads, dk):
    kind = OPS[op][1]
    return None if kind is None else (batch, total, heads) + ((dk,) if kind == "dim" else ())


def jax_inputs(key, op, batch, total, heads, dk, dv):
    kq, kk, kv, kg, kd = jax.random.split(key, 5)
    q = jax.random.normal(kq, (batch, total, heads, dk), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, total, heads, dk), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, total, heads, dv), jnp.bfloat16)
    shape = gate_shape(op, batch, total, heads, dk)
    g = None if shape is None else jax.nn.log_sigmoid(jax.random.normal(kg, shape, jnp.float32) + 2.0) / 4.0
    do = jax.random.normal(kd, (batch, total, heads, dv), jnp.bfloat16)
    return q, k, v, g, do


def ejkernel_call(op, platform, cfg=None, cu_seqlens=None):
    """``f(q, k, v, g) -> (out, final_state)`` running ``op`` on ``platform`` (g ignored by lightning)."""
    import ejkernel.modules as modules

    function = getattr(modules, OPS[op][0])
    varlen = {} if cu_seqlens is None else dict(cu_seqlens=jnp.asarray(cu_seqlens))

    def call(q, k, v, g):
        if op == "lightning":
            return function(q, k, v, **LIGHTNING_LAYER, platform=platform, cfg=cfg, **varlen)
        return function(q, k, v, g, platform=platform, cfg=cfg, **varlen)

    return call


def ejkernel_steps(op, platform: str, cfg=None, cu_seqlens=None):
    call = ejkernel_call(op, platform, cfg, cu_seqlens)

    def fwd(q, k, v, g):
        return call(q, k, v, g)

    def fwd_bwd(q, k, v, g, do):
        (out, state), pullback = jax.vjp(call, q, k, v, g)
        return pullback((do, jnp.zeros_like(state)))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def time_jax(op, platform, total, sets, warmup, reps, calls, cfg=None, cu_seqlens=None):
    fwd, fwd_bwd = ejkernel_steps(op, platform, cfg, cu_seqlens)
    shape = SHAPE if cu_seqlens is None else {**SHAPE, "batch": 1}
    tokens = total if cu_seqlens is None else int(cu_seqlens[-1])  # varlen: the B * T tokens packed
    inputs = [jax_inputs(jax.random.PRNGKey(i), op, total=tokens, **shape) for i in range(sets)]
    t_fwd = time_calls(lambda c: fwd(*inputs[c % sets][:4]), warmup, reps, calls)
    t_bwd = time_calls(lambda c: fwd_bwd(*inputs[c % sets]), warmup, reps, calls)
    return t_fwd, t_bwd


def time_fla(op, total, sets, warmup, reps, calls, cu_seqlens=None):
    import importlib

    import torch

    give_fla_a_triton_cache()
    module, name = OPS[op][2]
    kernel = getattr(importlib.import_module(module), name)

    b, h, dk, dv = SHAPE["batch"], SHAPE["heads"], SHAPE["dk"], SHAPE["dv"]
    extra = {} if op != "lightning" else dict(LIGHTNING_LAYER)
    if cu_seqlens is not None:  # the B * T tokens packed in batch 1
        b, total = 1, int(cu_seqlens[-1])
        extra["cu_seqlens"] = torch.as_tensor(cu_seqlens, dtype=torch.long, device="cuda")
    shape = gate_shape(op, b, total, h, dk)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make():
        q = torch.randn(b, total, h, dk, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k = torch.randn(b, total, h, dk, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        v = torch.randn(b, total, h, dv, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        g = None if shape is None else (
            torch.nn.functional.logsigmoid(torch.randn(*shape, device="cuda", generator=gen) + 2.0) / 4.0)
        do = torch.randn(b, total, h, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        return q, k, v, None if g is None else g.requires_grad_(), do

    inputs = [make() for _ in range(sets)]

    def run(q, k, v, g):  # the final state too, as ejkernel's operations return it
        gate = {} if g is None else dict(g=g)
        return kernel(q, k, v, **gate, output_final_state=True, **extra)[0]

    def run_fwd(c):
        q, k, v, g, _ = inputs[c % sets]
        with torch.no_grad():
            return run(q, k, v, g)

    def run_bwd(c):
        q, k, v, g, do = inputs[c % sets]
        for x in (q, k, v, g):
            if x is not None:
                x.grad = None
        run(q, k, v, g).backward(do)
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

    t_fwd = timed(run_fwd)
    try:  # fla 0.6.0 refuses some backward kernels on Triton < 3.7.1 (Hopper): keep the forward
        return t_fwd, timed(run_bwd)
    except RuntimeError as exc:
        return t_fwd, exc


def numerics(op, platforms, total=1024):
    """Relative L2 error of out, dq, dk, dv, dg of each platform against float32 XLA at HIGHEST."""
    q, k, v, g, do = jax_inputs(jax.random.PRNGKey(99), op, total=total, **SHAPE)

    def grads(platform, q, k, v, g, do):
        (out, state), pullback = jax.vjp(ejkernel_call(op, platform), q, k, v, g)
        return (out, *pullback((do, jnp.zeros_like(state))))

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(functools.partial(grads, "xla"))(*(x.astype(jnp.float32) for x in (q, k, v)), g,
                                                       do.astype(jnp.float32))
    out = {}
    for platform in platforms:
        got = jax.jit(functools.partial(grads, platform))(q, k, v, g, do)
        out[platform] = {n: relative_error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv", "dg"), got, ref)
                         if a is not None}
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
    parser.add_argument("--op", choices=sorted(OPS), default="gla", help="gla (per-dimension gates) against fla's "
                        "chunk_gla, recurrent (scalar gates [B, T, H]) against chunk_simple_gla, lightning against "
                        "chunk_lightning_attn")
    parser.add_argument("--varlen", type=int, default=0, help="N > 0: batch 1 of B*T tokens packed as N sequences "
                        "of random lengths (cu_seqlens, the same for every backend)")
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
    gates = {"dim": "log-sigmoid per dimension (float32)", "scalar": "log-sigmoid per head (float32)",
             None: f"none (lightning decay, {LIGHTNING_LAYER})"}[OPS[args.op][1]]
    doc = dict(benchmark="linear_attention", op=args.op, device=device.device_kind, platform=device.platform,
               date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), versions=versions(),
               shape=SHAPE, dtype="bfloat16", gates=gates, varlen=args.varlen,
               timing=dict(sets=args.sets, warmup=args.warmup, reps=args.reps, calls=args.calls), rows=[], errors={})
    try:
        import fla  # noqa: F401

        doc["versions"]["fla-core"] = __import__("importlib.metadata").metadata.version("fla-core")
        have_fla = True
    except Exception as exc:  # noqa: BLE001
        print("fla not importable:", exc)
        have_fla = False
    stem = "linear_attention" + ("" if args.op == "gla" else f"-{args.op}") + (f"-varlen{args.varlen}" if args.varlen else "")
    json_path = out_dir / f"{stem}.json"
    if args.append and json_path.exists():
        earlier = json.loads(json_path.read_text())
        doc["rows"] = earlier.get("rows", [])
        doc["versions"] = {**earlier.get("versions", {}), **doc["versions"]}
    impls = set(args.impls.split(","))

    def save():
        json_path.write_text(json.dumps(doc, indent=1))

    def record(impl, total, t_fwd, t_bwd, t0):
        """One row per mode (a mode that raised, as fla's refused backward, records the error) and a line."""
        for mode, t in (("fwd", t_fwd), ("fwd+bwd", t_bwd)):
            doc["rows"].append(dict(impl=impl, seq=total, mode=mode, **(
                dict(error=repr(t)[:500]) if isinstance(t, Exception) else dict(ms=round(t * 1e3, 4)))))
        shown = [f"{t * 1e3:8.3f} ms" if not isinstance(t, Exception) else "failed" for t in (t_fwd, t_bwd)]
        print(f"T={total:6d} {impl:7s} fwd {shown[0]}  fwd+bwd {shown[1]}"
              f"  ({time.perf_counter() - t0:.1f} s incl. compile)", flush=True)
        save()

    seqs = [int(s) for s in args.seqs.split(",") if s]
    xla_seqs = {int(s) for s in args.xla_seqs.split(",") if s}
    for total in seqs:
        offsets = varlen_offsets(SHAPE["batch"] * total, args.varlen) if args.varlen else None
        fla_here = have_fla and not (args.fla_last and total == args.config_seq and args.configs)
        todo = [("triton", None)] + ([("xla", None)] if total in xla_seqs else []) + ([("fla", None)] if fla_here else [])
        todo = [item for item in todo if item[0] in impls]
        for impl, _ in todo:
            t0 = time.perf_counter()
            try:
                if impl == "fla":
                    t_fwd, t_bwd = time_fla(args.op, total, args.sets, args.warmup, args.reps, args.calls, offsets)
                else:
                    t_fwd, t_bwd = time_jax(args.op, impl, total, args.sets, args.warmup, args.reps, args.calls,
                                            cu_seqlens=offsets)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                doc["rows"].append(dict(impl=impl, seq=total, mode="fwd", error=repr(exc)[:500]))
                save()
                continue
            record(impl, total, t_fwd, t_bwd, t0)
    if not args.no_numerics:
        try:
            doc["errors"] = numerics(args.op, ["triton"])
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
        offsets = varlen_offsets(SHAPE["batch"] * args.config_seq, args.varlen) if args.varlen else None
        try:
            t_fwd, t_bwd = time_jax(args.op, "triton", args.config_seq, args.sets, args.warmup, args.reps, args.calls,
                                    cfg, cu_seqlens=offsets)
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
            layout = f"varlen: {args.varlen} sequences in B*T tokens" if args.varlen else "B=4"
            plot(doc["rows"], out_dir / f"{stem}.png",
                 f"{OPS[args.op][0]} {layout} H=8 K=V=128 bf16, {doc['device']}, {doc['date'][:10]}")
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    if have_fla and args.fla_last and args.configs and args.config_seq in seqs:
        draw()  # a plot without fla survives a timeout during fla's autotuning
        t0 = time.perf_counter()
        try:
            record("fla", args.config_seq, *time_fla(args.op, args.config_seq, args.sets, args.warmup, args.reps,
                                                     args.calls), t0)
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
