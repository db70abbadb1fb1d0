"""Block-sparse attention benchmark: ejkernel's Triton block-sparse kernels at 10 / 25 / 50 % block density
against our dense Triton flash attention (same shape, every block) and the XLA block-sparse implementation,
forward and forward+backward, at S = 8k and 16k; and the Triton mean_pooling against XLA's (GB/s, forward and backward).

One command (on a GPU; through the device tool: `bash scripts/device/run.sh python3 benchmarks/blocksparse.py`):

    python benchmarks/blocksparse.py                          # the standard sweep (~60 s on an H200)
    python benchmarks/blocksparse.py --seqs 16384 --densities 0.1 --no-xla
    python benchmarks/blocksparse.py --replot benchmarks/results/X.json

Shapes: batch 1, 16 heads (kv heads 16), D=128, bf16, 128 x 128 mask blocks, non-causal; per-head random
masks with the diagonal blocks on and the rest on with probability density (the exact kept fraction is
recorded). The mask is a jit argument (a schedule built at run time: its cost is inside every timing; the
schedule alone is timed too, `schedule_ms`). TFLOP/s count the kept blocks only (4·D per kept (q, k) pair,
x3.5 for forward+backward), the dense kernel's all pairs, so equal TFLOP/s means time proportional to the
kept blocks. Targets (issue #12): at 10 % density and S=16k, time <= 1/5 of the dense kernel's, and kept-block
TFLOP/s >= dense TFLOP/s / 1.3. Timing as `attention.py` (`time_calls`: jit, warm-up, median of `--reps`
samples of `--calls` back-to-back calls over rotating input sets). Numerics: relative L2 error of the
Triton output against XLA block-sparse on the first input set (S=8k).

`triton`: the dispatcher's default config (since 2026-11-23 evening the Hopper TMA + warp-specialized forward
wherever it applies: non-causal, whole blocks, as here). `triton-const`: the mask a constant of the jitted
function (the schedule is then built once, at trace time: kernel time only), at the lowest density and the
longest sequence. `triton:<candidate>`: forward configs to compare at the lowest density and the longest
sequence (`FWD_CANDIDATES`: the pointer forward as the former default, other tiles / warps / stages).
`--final`: only S=16k at 10 %: dense flash and the default config forward and forward+backward, and the
forward candidates (no XLA, no mean_pooling; ~40 s on an H200 with compiles).

Writes `<out>/<gpu>-<date>-blocksparse.json` (after every measurement) and a PNG, prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import relative_error, time_calls, versions  # noqa: E402

BLOCK = 128
MEAN_POOLING_SHAPES = ((1 << 20, 1024, 64), (1 << 16, 4096, 4))
"""(tokens, features, sequences): 2 GiB of bf16 in 64 equal sequences; 512 MiB in 4 long ones (splits)."""


def block_mask(seed: int, heads: int, seq: int, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.ceil(seq / BLOCK)
    mask = rng.random((1, heads, n, n)) < density
    mask[:, :, np.arange(n), np.arange(n)] = True
    return mask


FWD_CANDIDATES = {
    # name: (fwd_block_q, fwd_block_kv, fwd_num_warps, fwd_num_stages, tma_forward[, persistent_forward]);
    # backward: the heuristic's. Most promising first (a timeout of the final run cuts the last ones).
    "tma-persistent-128x128-w4s2": (128, 128, 4, 2, True, 1),  # the default's kernel, persistent: descriptors
    #                               once per program, no per-item program start, longest rows first (no tail)
    "tma-128x128-w4s2": (128, 128, 4, 2, True),  # the TMA forward, one program per query tile
    "tma-128x64-w4s2": (128, 64, 4, 2, True),  # 96 KB: 2 programs per SM if registers allow
    "pointer-64x64-w4s3": (64, 64, 4, 3, False),  # 64 KB of shared memory: ~3 programs per SM overlap their
    #                                              prologues / epilogues with the others' loops
    "persistent-128x64-w8s3": (128, 64, 8, 3, False, 1),  # the pointer forward, persistent
    "pointer-128x64-w8s3": (128, 64, 8, 3, False),  # the default before the TMA forward (flash's tuned forward)
    "pointer-128x128-w8s2": (128, 128, 8, 2, False),  # one tile per mask block: half the loop iterations
}
"""Forward configs compared at S=16k, 10 % (short rows: ~14 visits per query block)."""


def candidate_config(name: str):
    """The heuristic's config with candidate `name`'s forward fields."""
    import dataclasses

    from ejkernel_triton.blocksparse_attention import TritonBlockSparseConfig
    from ejkernel_triton.flash_attention import tuning
    from ejkernel_triton.launch import gpu_device_kind

    base = tuning.heuristic_config(128, 128, jnp.bfloat16, device_kind=gpu_device_kind())
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    bq, bkv, warps, stages, tma, *persistent = FWD_CANDIDATES[name]
    fields.update(zip(tuning.FWD_FIELDS, (bq, bkv, warps, stages)))
    return TritonBlockSparseConfig(**fields, tma_forward=tma, persistent_forward=persistent[0] if persistent else 0)


def make_step(kind: str, mode: str, constant_mask=None):
    from ejkernel.modules import blocksparse_attention, flash_attention

    if kind == "triton-const":  # the mask closed over: the schedule is a constant of the program
        def attend(q, k, v, mask):
            del mask
            return blocksparse_attention(q, k, v, block_mask=constant_mask, block_size=BLOCK, causal=False,
                                         platform="triton")
    elif kind == "flash":
        def attend(q, k, v, mask):
            del mask
            return flash_attention(q, k, v, causal=False, platform="triton")
    elif kind.startswith("triton:"):
        config = candidate_config(kind.split(":", 1)[1])

        def attend(q, k, v, mask):
            return blocksparse_attention(q, k, v, block_mask=mask, block_size=BLOCK, causal=False, platform="triton",
                                         cfg=config)
    else:
        def attend(q, k, v, mask):
            return blocksparse_attention(q, k, v, block_mask=mask, block_size=BLOCK, causal=False, platform=kind)
    if mode == "fwd":
        return jax.jit(attend)

    def fwd_bwd(q, k, v, mask, do):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, mask), q, k, v)
        return out, pullback(do)

    return jax.jit(fwd_bwd)


def schedule_step():
    from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention
    from ejkernel_triton.blocksparse_attention.kernels import kernel_schedule

    def schedules(q, k, v, mask):
        call = BlockSparseAttention().validate(q, k, v, block_mask=mask, block_size=BLOCK, causal=False)
        return kernel_schedule(call, "q"), kernel_schedule(call, "kv")

    return jax.jit(schedules)


def random_inputs(seed, batch, seq, heads, dim, dtype, sets):
    out = []
    for s in range(sets):
        ks = jax.random.split(jax.random.key(seed * 100 + s), 4)
        out.append(tuple(jax.random.normal(kk, (batch, seq, heads, dim), jnp.float32).astype(dtype) for kk in ks))
    return out


def mean_pooling_rows(args) -> list[dict]:
    """Triton vs XLA mean_pooling, varlen bf16 [T, F]: forward GB/s (x read) and backward GB/s (dx written)."""
    from ejkernel.modules import mean_pooling

    rows = []
    for tokens, features, seqs in MEAN_POOLING_SHAPES:
        cu = jnp.asarray(np.linspace(0, tokens, seqs + 1).astype(np.int32))
        xs = [jax.random.normal(jax.random.key(i), (tokens, features), jnp.float32).astype(jnp.bfloat16)
              for i in range(2)]
        for platform in ("triton", "xla"):
            fwd = jax.jit(lambda x, p=platform: mean_pooling(x, cu_seqlens=cu, platform=p))
            both = jax.jit(lambda x, p=platform: jax.grad(
                lambda x: mean_pooling(x, cu_seqlens=cu, platform=p).astype(jnp.float32).sum())(x))
            # "bwd": the gradient of a sum, which needs no forward (XLA drops it): dx written, 2 bytes a value
            for mode, step, nbytes in (("fwd", fwd, 2 * tokens * features), ("bwd", both, 2 * tokens * features)):
                try:
                    seconds = time_calls(lambda c, s=step: s(xs[c % 2]), args.warmup, args.reps, args.calls)
                    rows.append(dict(op="mean_pooling", impl=platform, mode=mode, tokens=tokens, features=features,
                                     seqs=seqs, ms=seconds * 1e3, gbps=nbytes / seconds / 1e9))
                except Exception as exc:  # noqa: BLE001 -- one failing row must not end the run
                    rows.append(dict(op="mean_pooling", impl=platform, mode=mode, tokens=tokens,
                                     features=features, seqs=seqs, error=f"{type(exc).__name__}: {exc}"[:300]))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["results"] if r.get("ms")]
    if len({r["density"] for r in rows if r["impl"] != "triton-flash-dense"}) == 1:
        plot_bars(doc, rows, path)
        return
    combos = sorted({(r["seq"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(2, max(1, len(combos)), figsize=(4.2 * max(1, len(combos)), 6.4), squeeze=False)
    for col, (seq, mode) in enumerate(combos):
        impls = ["triton", "triton-const", "xla", *sorted({r["impl"] for r in rows if r["impl"].startswith("triton:")})]
        for impl in impls:
            pts = sorted((r["density"], r["ms"], r["tflops"]) for r in rows
                         if (r["seq"], r["mode"], r["impl"]) == (seq, mode, impl))
            if pts:
                axes[0, col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} block-sparse")
                axes[1, col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"{impl} block-sparse")
        dense = [r for r in rows if (r["seq"], r["mode"], r["impl"]) == (seq, mode, "triton-flash-dense")]
        if dense:
            axes[0, col].axhline(dense[0]["ms"], color="k", ls="--", label="triton flash (dense)")
            axes[1, col].axhline(dense[0]["tflops"], color="k", ls="--", label="triton flash (dense)")
        axes[0, col].set_title(f"S={seq} {mode}", fontsize=9)
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("ms")
        axes[1, col].set_ylabel("TFLOP/s (kept blocks)")
        axes[1, col].set_xlabel("block density")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"block-sparse attention, {doc['device']}, {doc['date'][:10]} (B=1, H=16, D=128, bf16, "
                 f"128-blocks)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=110)


def plot_bars(doc: dict, rows: list, path: Path) -> None:
    """One density (`--final`): time of every implementation, one panel per (S, mode), dense as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["seq"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5.5 * len(combos), 4.2), squeeze=False)
    for ax, (seq, mode) in zip(axes[0], combos):
        sparse = [r for r in rows if (r["seq"], r["mode"]) == (seq, mode) and r["impl"] != "triton-flash-dense"]
        ax.barh([r["impl"] for r in sparse], [r["ms"] for r in sparse])
        for i, r in enumerate(sparse):
            ax.text(r["ms"], i, f" {r['ms']:.3f} ms, {r.get('tflops_vs_dense', float('nan')):.2f}", va="center",
                    fontsize=7)
        dense = [r for r in rows if (r["seq"], r["mode"], r["impl"]) == (seq, mode, "triton-flash-dense")]
        if dense:
            ax.axvline(dense[0]["ms"] / 5, color="k", ls="--", label="dense / 5 (target)")
            ax.legend(fontsize=7)
        ax.set_title(f"S={seq} {mode}, density {sparse[0]['density'] if sparse else ''}", fontsize=9)
        ax.set_xlabel("ms (label: kept-block TFLOP/s / dense)")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"block-sparse attention, {doc['device']}, {doc['date'][:10]} (B=1, H=16, D=128, bf16, "
                 f"128-blocks)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_target(t: dict) -> None:
    print(f"target {t.get('impl', 'triton')} S={t['seq']} {t['mode']} density {t['density']}: speedup {t['speedup']:.2f}x (>= 5), "
          f"kept-block TFLOP/s / dense {t['tflops_ratio']:.2f} (>= {1 / 1.3:.2f}): {'MET' if t['met'] else 'NOT MET'}",
          flush=True)


def print_report(doc: dict) -> None:
    print(f"## {doc['device']}, {doc['date'][:10]}: block-sparse attention (B=1, H=16, D=128, bf16, 128-blocks)")
    print("| S | mode | density (kept) | impl | ms | TFLOP/s kept | x dense time |")
    print("|---|---|---|---|---|---|---|")
    for r in doc["results"]:
        if r.get("ms"):
            print(f"| {r['seq']} | {r['mode']} | {r['density']} ({r['kept']:.3f}) | {r['impl']} | {r['ms']:.3f} | "
                  f"{r['tflops']:.1f} | {r.get('vs_dense_time', float('nan')):.3f} |")
        else:
            print(f"| {r['seq']} | {r['mode']} | {r['density']} | {r['impl']} | error: {r.get('error', '')[:80]} |")
    for t in doc.get("targets", []):
        print_target(t)
    for r in doc.get("mean_pooling", []):
        if r.get("ms"):
            print(f"mean_pooling {r['impl']:6s} {r['mode']:7s} T={r['tokens']} F={r['features']} N={r['seqs']}: "
                  f"{r['ms']:.3f} ms, {r['gbps']:.0f} GB/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="default 8192 16384 (--final: 16384)")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA block-sparse baseline")
    parser.add_argument("--xla-max-seq", type=int, default=16384)
    parser.add_argument("--no-mean-pooling", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--replot", type=Path)
    parser.add_argument("--final", action="store_true",
                        help="S=16k, 10 %%: dense, default (fwd, fwd+bwd) and the forward candidates only")
    parser.add_argument("--candidates", nargs="*", default=list(FWD_CANDIDATES),
                        help="forward candidates (FWD_CANDIDATES names) at the longest sequence, lowest density")
    args = parser.parse_args(argv)
    if args.final:
        args.densities, args.no_xla, args.no_mean_pooling = [0.1], True, True
    args.seqs = args.seqs or ([16384] if args.final else [8192, 16384])
    if args.replot:
        doc = json.loads(args.replot.read_text())
        plot(doc, args.replot.with_suffix(".png"))
        print_report(doc)
        return 0

    device = jax.devices()[0]
    now = dt.datetime.now(dt.timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{device.device_kind.replace(' ', '-')}-{now:%Y-%m-%d}-blocksparse"
    doc = dict(device=device.device_kind, date=now.isoformat(), versions=versions(), setup=dict(
        batch=1, heads=args.heads, head_dim=args.head_dim, dtype="bfloat16", block=BLOCK, causal=False,
        warmup=args.warmup, reps=args.reps, calls=args.calls), results=[], targets=[], numerics=[])
    json_path = args.out / f"{stem}.json"

    def save():
        json_path.write_text(json.dumps(doc, indent=1))

    h, d = args.heads, args.head_dim
    for seq in args.seqs:
        inputs = random_inputs(seq, 1, seq, h, d, jnp.bfloat16, sets=2)
        dense_pairs = float(h) * seq * seq
        passes = []
        for mode in args.modes:
            runs = [("triton-flash-dense", "flash", 1.0)]
            runs += [("triton", "triton", density) for density in args.densities]  # ours first: a timeout
            if seq == max(args.seqs):
                if not args.final:  # the mask a constant of the jitted function: schedule built at trace time
                    runs += [("triton-const", "triton-const", min(args.densities))]
                if args.head_dim == 128 and mode == "fwd":
                    runs += [(f"triton:{name}", f"triton:{name}", min(args.densities)) for name in args.candidates]
            if not args.no_xla and seq <= args.xla_max_seq:  # (the device script's) cuts the slow XLA rows
                runs += [("xla", "xla", density) for density in args.densities]
            passes.append((mode, runs))
        if args.final:  # the default's fwd and fwd+bwd rows before the candidates (a timeout cuts candidates)
            candidates = [run for _, runs in passes for run in runs if run[1].startswith("triton:")]
            passes = [(mode, [run for run in runs if run not in candidates]) for mode, runs in passes]
            passes.append(("fwd", candidates))
        dense_of_mode = {}
        for mode, runs in passes:
            factor = 4.0 * d * (3.5 if mode == "fwd+bwd" else 1.0)
            dense_ms, dense_tflops = dense_of_mode.get(mode, (None, None))
            steps = {}
            for name, kind, density in runs:
                mask = jnp.asarray(block_mask(7, h, seq, density)) if kind != "flash" else jnp.ones((1,), bool)
                kept = float(np.mean(np.asarray(mask))) if kind != "flash" else 1.0
                row = dict(seq=seq, mode=mode, impl=name, density=density, kept=kept)
                try:
                    if kind == "triton-const":
                        step = make_step(kind, mode, constant_mask=mask)
                    else:
                        step = steps.setdefault(kind, make_step(kind, mode))
                    sets = [(*x[:3], mask, x[3]) if mode == "fwd+bwd" else (*x[:3], mask) for x in inputs]
                    reps, calls = (3, 1) if kind == "xla" else (args.reps, args.calls)
                    seconds = time_calls(lambda c: step(*sets[c % len(sets)]), args.warmup, reps, calls)
                    row.update(ms=seconds * 1e3, tflops=factor * dense_pairs * kept / seconds / 1e12)
                    if kind == "flash":
                        dense_ms, dense_tflops = row["ms"], row["tflops"]
                        dense_of_mode[mode] = (dense_ms, dense_tflops)
                    elif dense_ms:
                        row["vs_dense_time"] = row["ms"] / dense_ms
                        row["tflops_vs_dense"] = row["tflops"] / dense_tflops
                    if kind == "triton" and mode == "fwd" and not args.final:
                        sched = schedule_step()
                        row["schedule_ms"] = 1e3 * time_calls(lambda c: sched(*sets[c % 2][:4]), 2, 5, 3)
                except Exception as exc:  # noqa: BLE001 -- one failing row must not end the run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    traceback.print_exc()
                doc["results"].append(row)
                print(json.dumps(row), flush=True)
                if kind.startswith("triton") and density == 0.1 and row.get("ms") and dense_ms:
                    speedup, ratio = dense_ms / row["ms"], row["tflops"] / dense_tflops
                    doc["targets"].append(dict(seq=seq, mode=mode, impl=name, density=density, speedup=speedup,
                                               tflops_ratio=ratio, met=speedup >= 5 and ratio >= 1 / 1.3))
                    print_target(doc["targets"][-1])
                save()
        if seq == min(args.seqs) and not args.no_xla:
            try:  # numerics: Triton against XLA block-sparse, forward, first input set, 25 % density
                q, k, v, _ = inputs[0]
                mask = jnp.asarray(block_mask(7, h, seq, 0.25))
                got = make_step("triton", "fwd")(q, k, v, mask)
                ref = make_step("xla", "fwd")(q, k, v, mask)
                doc["numerics"].append(dict(seq=seq, density=0.25, out_vs_xla=relative_error(got, ref)))
            except Exception as exc:  # noqa: BLE001
                doc["numerics"].append(dict(seq=seq, error=f"{type(exc).__name__}: {exc}"[:400]))
            print(json.dumps(doc["numerics"][-1]), flush=True)
        del inputs
    if not args.no_mean_pooling:
        doc["mean_pooling"] = mean_pooling_rows(args)
    save()
    try:
        plot(doc, json_path.with_suffix(".png"))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print_report(doc)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
