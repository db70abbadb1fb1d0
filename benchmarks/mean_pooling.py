"""mean_pooling: every ejkernel platform registered for it on this machine's device and usable here against a
plain ``jnp`` mean (float32 sums), fixed-length and packed varlen, forward and forward+backward (GB/s).

    python3 benchmarks/mean_pooling.py                 # the standard shapes on this machine's device
    python3 benchmarks/mean_pooling.py --quick         # tiny shapes: a smoke run (CPU, seconds)
    bash scripts/device/run.sh python3 benchmarks/mean_pooling.py --out $OUT   # on the device

Shapes: 16384 tokens of hidden 2048, bf16 (64 MiB a set): ``fixed`` [16384 / S, S, 2048] at S = 2048 (batch
8) and ``varlen`` [16384, 2048] packed as 8 sequences of random lengths (``cu_seqlens``). Columns:
``ejkernel-<platform>`` (``mean_pooling(x, cu_seqlens=..., platform=...)``) and ``jnp-mean``
(``x.astype(float32).mean(1)``; varlen: ``jax.ops.segment_sum`` over the sequences, divided by their
lengths). Forward+backward is ``jax.vjp`` with a fresh random cotangent (step returns out and dx). GB/s:
forward x read + out written, forward+backward that + dx written (the cotangent read), in the input dtype.
Timing as ``_harness.time_calls`` (jit, warm-up, median of ``--reps`` samples of ``--calls`` back-to-back
calls over rotating fresh inputs). Numerics: relative L2 error of out and dx against the float32 ``jnp-mean``.
``blocksparse.py`` also times Triton against XLA mean_pooling at its own (larger) varlen shapes.
Writes ``<device>-<date>-mean-pooling`` .json (after every row) and .png into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

OPERATIONS = ("mean_pooling",)  # the ops this script benchmarks (tests/ reads it)
NAMES = ("out", "dx")


def jnp_mean(cu_seqlens):
    """The plain-JAX peer: float32 mean over each sequence (fixed length: axis 1; else the packed ones)."""

    def mean(x):
        if cu_seqlens is None:
            return x.astype(jnp.float32).mean(axis=1).astype(x.dtype)
        seqs = cu_seqlens.shape[0] - 1
        ids = jnp.searchsorted(cu_seqlens[1:], jnp.arange(x.shape[0]), side="right")  # past the end: seqs
        sums = jax.ops.segment_sum(x.astype(jnp.float32), ids, num_segments=seqs)
        lengths = jnp.maximum(jnp.diff(cu_seqlens), 1).astype(jnp.float32)
        return (sums / lengths.reshape((seqs,) + (1,) * (x.ndim - 1))).astype(x.dtype)

    return mean


def columns(cu_seqlens) -> list[h.Column]:
    from ejkernel.modules import mean_pooling

    out = [h.Column(f"ejkernel-{platform}",
                    lambda x, platform=platform: mean_pooling(x, cu_seqlens=cu_seqlens, platform=platform))
           for platform in h.usable_platforms("mean_pooling")]
    return out + [h.Column("jnp-mean", jnp_mean(cu_seqlens))]


def cases(args, dtype):
    """(shape, cu_seqlens or None, input sets (x, d_out)) for the fixed-length and the varlen layout."""
    rng = np.random.default_rng(0)
    tokens, features = args.tokens, args.features
    sizes = rng.multinomial(tokens, rng.dirichlet(np.full(args.varlen, 2.0)))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
    layouts = [("fixed", (tokens // args.seq, args.seq, features), (tokens // args.seq, features), None),
               ("varlen", (tokens, features), (args.varlen, features), cu)]
    for i, (layout, x_shape, out_shape, cu_seqlens) in enumerate(layouts):
        sets = []
        for s in range(args.sets):
            kx, kd = jax.random.split(jax.random.key(100 * i + s))
            sets.append((jax.random.normal(kx, x_shape, jnp.float32).astype(dtype),
                         jax.random.normal(kd, out_shape, jnp.float32).astype(dtype)))
        shape = dict(layout=layout, tokens=tokens, features=features, seqs=out_shape[0])
        yield shape, cu_seqlens, sets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_common_args(p)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--features", type=int, default=2048)
    p.add_argument("--seq", type=int, default=2048, help="fixed layout: batch = tokens / seq")
    p.add_argument("--varlen", type=int, default=8, help="varlen layout: the tokens packed as this many sequences")
    args = h.parse(p, argv)
    if args.quick:
        args.tokens, args.features, args.seq, args.varlen = 64, 16, 16, 4
    dtype = jnp.dtype(args.dtype)
    rec = h.Recorder(args, "mean-pooling", tokens=args.tokens, features=args.features, seq=args.seq,
                     varlen=args.varlen, bytes="fwd x + out; fwd+bwd x + out + d_out + dx (input dtype)")
    rec.doc["numerics"] = []
    for shape, cu_seqlens, sets in cases(args, dtype):
        cols = columns(cu_seqlens)
        moved = dtype.itemsize * (shape["tokens"] + shape["seqs"]) * shape["features"]
        label = f"{shape['layout']:6s} T={shape['tokens']} F={shape['features']} N={shape['seqs']}"
        for column in cols:
            entry = dict(impl=column.name, **shape)
            try:
                entry.update(h.gradient_errors(column, cols[-1].fn, sets[0], None, NAMES))
            except Exception as error:  # noqa: BLE001
                entry["error"] = h.failure(error)
            rec.doc["numerics"].append(entry)
            for mode, work in (("fwd", moved), ("fwd+bwd", 2 * moved)):
                mode_sets = [s if mode == "fwd+bwd" else s[:1] for s in sets]
                h.timed_row(rec, dict(impl=column.name, **shape, mode=mode), lambda: h.make_step(column, None, mode),
                            mode_sets, args, work, unit="gbps", label=label)
        del sets
    rec.finish(plot)
    for n in rec.doc["numerics"]:
        print(f"{n['layout']:6s} {n['impl']:18s} rel. error (out / dx) "
              + (n.get("error") or " / ".join(f"{n[k]:.2e}" for k in NAMES)))
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "gbps" in r]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / max(1, len(impls))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for i, impl in enumerate(impls):
            values = [next((r["gbps"] for r in rows if (r["impl"], r["layout"], r["mode"]) == (impl, lay, mode)), 0.0)
                      for lay in layouts]
            ax.bar(np.arange(len(layouts)) + i * width, values, width, label=impl)
        ax.set_xticks(np.arange(len(layouts)) + 0.4 - width / 2, layouts)
        ax.set_ylabel("GB/s")
        ax.set_title(f"mean_pooling {mode}", fontsize=9)
        ax.legend(fontsize=7)
    setup = doc["setup"]
    fig.suptitle(f"{doc['device']}, {doc['date'][:10]}, {setup['tokens']} tokens x {setup['features']}, "
                 f"{setup['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
