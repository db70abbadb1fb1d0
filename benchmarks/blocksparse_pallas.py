"""Pallas (Triton-lowered) block-sparse attention on a GPU against our dense flash attention (issue #17).

One command (on a GPU; through the device tool: `bash scripts/device/blocksparse_pallas.sh`):

    python benchmarks/blocksparse_pallas.py                       # S=16k, 10 % density, fwd and fwd+bwd
    python benchmarks/blocksparse_pallas.py --seq 8192 --density 0.25 --modes fwd

Shape: batch 1, 16 heads (kv heads 16), D=128, bf16, 128 x 128 mask blocks, non-causal, a per-head random
mask with the diagonal blocks on and the others on with probability ``--density`` (the kept fraction is
recorded). The mask is a jit argument (the schedule is built inside every timed call; the "sparse-static" rows
close over it instead: built once, at trace time, as for a builder's mask). Implementations:
``pallas`` block-sparse (this package's GPU kernel), ``triton`` block-sparse where installed, and the dense
flash attention of ``pallas`` and ``triton`` (every block). Timing: ``attention.time_calls`` (jit, warm-up,
median of ``--reps`` samples of ``--calls`` back-to-back calls over rotating fresh inputs). TFLOP/s of
block-sparse count the kept blocks only (4·D per kept (q, k) pair, x3.5 for forward+backward). Target
(issue #17): at 10 % density, S=16k, pallas block-sparse time <= 0.15 x the fastest dense flash attention.
Numerics: relative L2 error of the pallas block-sparse output and gradients against XLA block-sparse in
float32 at S=2048 (same mask form).

Writes ``<out>/<gpu>-<date>-blocksparse-pallas.json`` (after every measurement) and a PNG; prints a table
and the target line.
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


def random_mask(seed: int, heads: int, seq: int, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.ceil(seq / BLOCK)
    mask = rng.random((1, heads, n, n)) < density
    mask[:, :, np.arange(n), np.arange(n)] = True
    return mask


# extra configs of the pallas block-sparse kernels ("pallas:<name>" rows; GpuFlashTuning fields). The
# default (heuristic) on a Hopper GPU runs the Mosaic GPU kernels since 2026-11-27; "triton-fwd" is the
# Triton-lowered forward and backward they replaced (128x128 / 8 warps / 3 stages forward for 128-blocks),
# "triton-bwd" the Mosaic forward with the Triton-lowered backward; the other variants run the Triton-lowered
# kernels (mosaic_forward and mosaic_backward default to False).
VARIANTS = {
    "triton-fwd": dict(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3),
    "triton-bwd": dict(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3, mosaic_forward=True),
    "fwd128x64": dict(),  # the flash defaults: the block-sparse default before (forward only)
    "bwd-wide": dict(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3, dkv_q=64, dkv_kv=128, dq_q=128, dq_kv=64,
                     bwd_warps=8),  # Triton block-sparse's tuned backward blocks (fwd+bwd only)
    # forward tilings with 2-3 programs per SM (the Triton pointer forward gained 8 % at 64 x 64 / 4 warps,
    # H100 2026-11-24), also with the default backward (fwd+bwd)
    "fwd64x64-w4s3": dict(fwd_q=64, fwd_kv=64, fwd_warps=4, fwd_stages=3),
    "fwd64x128-w4s2": dict(fwd_q=64, fwd_kv=128, fwd_warps=4, fwd_stages=2),
}
VARIANT_MODES = {"triton-fwd": ("fwd", "fwd+bwd"), "triton-bwd": ("fwd+bwd",), "fwd128x64": ("fwd",),
                 "bwd-wide": ("fwd+bwd",), "fwd64x64-w4s3": ("fwd", "fwd+bwd"), "fwd64x128-w4s2": ("fwd", "fwd+bwd")}


def attend_fn(kind: str, platform: str):
    from ejkernel.modules import blocksparse_attention, flash_attention

    if kind == "dense":
        return lambda q, k, v, mask: flash_attention(q, k, v, causal=False, platform=platform)
    cfg = None
    if ":" in platform:
        from ejkernel_pallas.gpu_flash_attention import GpuFlashTuning

        platform, variant = platform.split(":")
        cfg = GpuFlashTuning(**VARIANTS[variant])
    return lambda q, k, v, mask: blocksparse_attention(
        q, k, v, block_mask=mask, block_size=BLOCK, causal=False, platform=platform, cfg=cfg
    )


def make_step(kind: str, platform: str, mode: str, static_mask=None):
    attend = attend_fn("sparse" if kind == "sparse-static" else kind, platform)
    if kind == "sparse-static":  # the mask a constant of the program: its schedule built once, at trace time
        traced_attend = attend

        def attend(q, k, v, mask):
            return traced_attend(q, k, v, static_mask)
    if mode == "fwd":
        return jax.jit(attend)

    def fwd_bwd(q, k, v, mask, do):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, mask), q, k, v)
        return out, pullback(do)

    return jax.jit(fwd_bwd)


def inputs(seq, heads, dim, sets=2):
    out = []
    for s in range(sets):
        ks = jax.random.split(jax.random.key(100 + s), 4)
        out.append(tuple(jax.random.normal(kk, (1, seq, heads, dim), jnp.float32).astype(jnp.bfloat16) for kk in ks))
    return out


def numerics(heads: int, dim: int) -> dict:
    """Relative L2 errors (out, dq, dk, dv) of pallas block-sparse (bf16) against XLA block-sparse (f32)."""
    seq = 2048
    mask = jnp.asarray(random_mask(7, heads, seq, 0.25))
    q, k, v, do = inputs(seq, heads, dim, sets=1)[0]

    def grads(platform, *args):
        attend = attend_fn("sparse", platform)
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, mask), *args[:3])
        return (out, *pullback(args[3]))

    ref = jax.jit(lambda *a: grads("xla", *a))(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    got = jax.jit(lambda *a: grads("pallas", *a))(q, k, v, do)
    return {name: relative_error(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def plot(rows, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    ok = [r for r in rows if "ms" in r]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        sel = [r for r in ok if r["mode"] == mode]
        ax.bar([f"{r['kind']}\n{r['platform']}" for r in sel], [r["ms"] for r in sel])
        ax.set_title(f"{mode} (ms, lower is better)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    # 2: the first call in a process can define a jax config option (a lazily imported lowering module), which
    # changes the tracing context, so the second call traces and compiles again (seen in interpret mode)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--no-numerics", action="store_true")
    parser.add_argument("--final", action="store_true",
                        help="pallas block-sparse (default config) and dense Triton flash only, no numerics")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.final:
        args.no_numerics = True

    device = jax.devices()[0]
    gpu = device.device_kind.replace(" ", "_")
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{gpu}-{date}-blocksparse-pallas.json"
    mask_np = random_mask(0, args.heads, args.seq, args.density)
    kept = float(mask_np.mean())
    doc = dict(device=device.device_kind, date=date, versions=versions(), seq=args.seq, heads=args.heads,
               head_dim=args.head_dim, density=args.density, kept_fraction=kept, block=BLOCK, rows=[])
    sets = inputs(args.seq, args.heads, args.head_dim)
    mask = jnp.asarray(mask_np)
    pairs = args.seq * args.seq
    for mode in args.modes:
        # the target's pair first (the JSON is rewritten after every row, so a timeout keeps what was measured)
        impls = [("sparse", "pallas"), ("dense", "triton")]
        if not args.final:
            impls += [("sparse", "triton"), ("dense", "pallas")]
            impls += [("sparse-static", "pallas"), ("sparse-static", "triton")]
            impls += [("sparse", f"pallas:{name}") for name in VARIANTS if mode in VARIANT_MODES[name]]
        for kind, platform in impls:
            row = dict(kind=kind, platform=platform, mode=mode)
            try:
                step = make_step(kind, platform, mode, static_mask=mask)
                if mode == "fwd":
                    run = lambda c, step=step: step(*sets[c % 2][:3], mask)  # noqa: E731
                else:
                    run = lambda c, step=step: step(*sets[c % 2][:3], mask, sets[c % 2][3])  # noqa: E731
                seconds = time_calls(run, args.warmup, args.reps, args.calls)
                flops = 4 * args.heads * args.head_dim * pairs * (1.0 if kind == "dense" else kept)
                flops *= 3.5 if mode == "fwd+bwd" else 1.0
                row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
            except Exception as error:  # a missing backend or a failing kernel: recorded, the rest goes on
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                traceback.print_exc(limit=2)
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            path.write_text(json.dumps(doc, indent=1))
    if not args.no_numerics:
        try:
            doc["numerics_vs_xla_f32_S2048"] = numerics(args.heads, args.head_dim)
        except Exception as error:
            doc["numerics_vs_xla_f32_S2048"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print("numerics (pallas bf16 vs xla f32, S=2048):", doc["numerics_vs_xla_f32_S2048"])
    path.write_text(json.dumps(doc, indent=1))
    plot(doc["rows"], path.with_suffix(".png"),
         f"{device.device_kind}: S={args.seq}, density {args.density} (kept {kept:.3f}), bf16 D={args.head_dim}")

    print("\n| mode | kind | platform | ms | TFLOP/s |\n|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['mode']} | {r['kind']} | {r['platform']} | {r.get('ms', float('nan')):.3f} | "
              f"{r.get('tflops', float('nan')):.1f} |" + (f" {r['error'][:80]}" if "error" in r else ""))
    for mode in args.modes:
        sparse = [r["ms"] for r in doc["rows"] if r["mode"] == mode and r["kind"] == "sparse"
                  and r["platform"] == "pallas" and "ms" in r]
        dense = [r["ms"] for r in doc["rows"] if r["mode"] == mode and r["kind"] == "dense" and "ms" in r]
        if sparse and dense:
            ratio = sparse[0] / min(dense)
            verdict = "MET" if ratio <= 0.15 else "NOT MET"
            print(f"target {mode}: pallas block-sparse / fastest dense = {ratio:.3f} (<= 0.15: {verdict})")
            doc.setdefault("targets", {})[mode] = dict(ratio=ratio, met=ratio <= 0.15)
    path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
