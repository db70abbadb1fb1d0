"""Native sparse attention on one GPU (issue #12): ours (Triton selected branch, XLA) against our dense flash
attention (causal: ``auto``, i.e. cuDNN where it applies, and Triton), and flash-linear-attention's
``parallel_nsa`` when its package is installed, in one run.

    python benchmarks/native_sparse_attention.py --seqs 8192 32768 --out /tmp/out

Shape: 16k tokens per batch (batch = max(1, 16384 // seq)), 16 query heads over 1 kv head (GQA 16, as
NSA's paper), D=128, bf16, block_size 64, 16 selected blocks, window 512, all three gates, selection from
the compressed branch (``block_indices=None``). Forward and forward+backward; warm-up, median of ``--reps``
samples of ``--calls`` back-to-back calls over two input sets (``attention.time_calls``). fla's window
branch calls the ``flash-attn`` package: where it is missing, the fla row records that error; run again
with ``--window 0 --impls triton fla --append`` for the like-for-like pair without windows. Writes
``<out>/<gpu>-<date>-nsa.json`` after every row, and a PNG.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import give_fla_a_triton_cache, time_calls, versions  # noqa: E402


def inputs(batch, seq, heads, kv_heads, dim, sets=2):
    out = []
    for s in range(sets):
        keys = jax.random.split(jax.random.key(s), 7)
        q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (batch, seq, kv_heads, dim), jnp.float32).astype(jnp.bfloat16)
                for kk in keys[1:3])
        gates = [jax.nn.sigmoid(jax.random.normal(kk, (batch, seq, heads), jnp.float32)).astype(jnp.bfloat16)
                 for kk in keys[3:6]]
        do = jax.random.normal(keys[6], (batch, seq, heads, dim), jnp.float32).astype(jnp.bfloat16)
        out.append((q, k, v, *gates, do))
    return out


def nsa_step(platform, mode, args):
    from ejkernel.modules import native_sparse_attention

    def attend(q, k, v, g_cmp, g_slc, g_swa):
        window = dict(g_swa=g_swa, window_size=args.window) if args.window > 0 else {}
        return native_sparse_attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=args.selected,
                                       block_size=args.block_size, platform=platform, **window)

    return _step(attend, mode, 6)


def dense_step(platform, mode):
    from ejkernel.modules import flash_attention

    return _step(lambda q, k, v: flash_attention(q, k, v, causal=True, platform=platform), mode, 3)


def _step(attend, mode, arity):
    if mode == "fwd":
        return jax.jit(lambda *a: attend(*a[:arity]))

    def fwd_bwd(*a):
        out, pullback = jax.vjp(attend, *a[:arity])
        return out, pullback(a[-1])

    return jax.jit(fwd_bwd)


def time_fla(batch, seq, mode, args):
    """flash-linear-attention's parallel_nsa (PyTorch) on the same shapes; its own selection (top-k)."""
    import torch

    give_fla_a_triton_cache()
    from fla.ops.nsa import parallel_nsa

    dev = "cuda"
    q = torch.randn(batch, seq, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seq, args.kv_heads, args.head_dim, device=dev, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    g_cmp, g_slc, g_swa = (torch.rand(batch, seq, args.heads, device=dev, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)

    window = dict(g_swa=g_swa, window_size=args.window) if args.window > 0 else {}

    def run():
        out = parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=args.selected,
                           block_size=args.block_size, **window)
        if mode == "fwd+bwd":
            out.backward(do)
        return out

    for _ in range(args.warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.calls):
            run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / args.calls / 1e3)
    return sorted(samples)[len(samples) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--selected", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--impls", nargs="+", default=["triton", "xla", "dense-auto", "dense-triton", "fla"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--append", action="store_true", help="add rows to the day's JSON instead of replacing it")
    args = parser.parse_args(argv)
    kind = jax.devices()[0].device_kind
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{kind.replace(' ', '_')}-{date}-nsa.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "impls", "append")}
    doc = dict(device=kind, date=date, versions=versions(), **settings, rows=[])
    if args.append and path.exists():
        doc = json.loads(path.read_text())
    for seq in args.seqs:
        batch = max(1, 16384 // seq)
        sets = inputs(batch, seq, args.heads, args.kv_heads, args.head_dim)
        for mode in ("fwd", "fwd+bwd"):
            for impl in args.impls:
                row = dict(seq=seq, batch=batch, mode=mode, impl=impl, window=args.window)
                try:
                    if impl == "fla":
                        seconds = time_fla(batch, seq, mode, args)
                    else:
                        if impl.startswith("dense-"):
                            step, arity = dense_step(impl.split("-", 1)[1], mode), 3
                        else:
                            step, arity = nsa_step(impl, mode, args), 6
                        pick = (lambda c, s=step, a=arity: s(*sets[c % 2][:a])) if mode == "fwd" else \
                            (lambda c, s=step, a=arity: s(*sets[c % 2][:a], sets[c % 2][-1]))
                        seconds = time_calls(pick, args.warmup, args.reps, args.calls)
                    row["ms"] = seconds * 1e3
                except Exception as error:  # a missing peer or an unusable backend is a result
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    traceback.print_exc(limit=1)
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                path.write_text(json.dumps(doc, indent=1))
    plot(doc, path.with_suffix(".png"))
    return 0


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "ms" in r]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        lines = sorted({(r["impl"], r["window"]) for r in rows if r["mode"] == mode})
        for impl, window in lines:
            pts = sorted((r["seq"], r["ms"]) for r in rows
                         if r["mode"] == mode and r["impl"] == impl and r["window"] == window)
            label = impl if impl.startswith("dense-") else f"{impl}, window {window or 'none'}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms")
        ax.set_title(f"NSA {mode}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['device']}, {doc['date']}, 16k tokens, H={doc['heads']}/{doc['kv_heads']}, D={doc['head_dim']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
