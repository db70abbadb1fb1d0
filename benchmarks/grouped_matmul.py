"""grouped_matmul (MoE experts): every ejkernel platform registered for it and usable here against XLA's own
``jax.lax.ragged_dot``, forward and forward+backward, in one run.

    python3 benchmarks/grouped_matmul.py                       # the standard shapes on this machine's device
    python3 benchmarks/grouped_matmul.py --quick               # tiny shapes: a smoke run (CPU)
    bash scripts/device/run.sh python3 benchmarks/grouped_matmul.py --out $OUT   # on the device

Shapes: 16384 tokens (``m``) routed to ``groups`` experts of ``k x n`` each (hidden 2048 -> 2048; 8 and 64
experts; bf16), group sizes drawn at random around ``m / groups`` (some experts get nothing). TFLOP/s: forward
2·m·k·n, forward+backward 3× that (d lhs and d rhs are one product each). Timing as ``attention.py``: jit,
warm-up, median of ``--reps`` samples of ``--calls`` back-to-back calls over rotating fresh inputs. Numerics:
relative L2 error against float32 ``ragged_dot`` on the same inputs. Writes ``<device>-<date>-grouped-matmul``
.json (after every row) and .png into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

STANDARD = [(16384, 2048, 2048, 8), (16384, 2048, 2048, 64)]
QUICK = [(96, 32, 48, 4)]


def inputs(seed: int, m: int, k: int, n: int, groups: int, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """lhs [m, k] and rhs [groups, k, n] (~N(0, 1/k): outputs of unit scale), group sizes summing to m."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m, rng.dirichlet(np.full(groups, 2.0))).astype(np.int32)
    lhs = rng.standard_normal((m, k), np.float32) / np.sqrt(k)
    rhs = rng.standard_normal((groups, k, n), np.float32)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes)


def implementations() -> dict[str, Callable]:
    from ejkernel.modules import grouped_matmul

    impls: dict[str, Callable] = {
        f"ejkernel-{p}": (lambda lhs, rhs, sizes, p=p: grouped_matmul(lhs, rhs, sizes, platform=p))
        for p in h.usable_platforms("grouped_matmul")
    }
    impls["jax-ragged-dot"] = lambda lhs, rhs, sizes: jax.lax.ragged_dot(
        lhs, rhs, sizes, preferred_element_type=jnp.float32)
    return impls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_common_args(p, reps=7, calls=10, warmup=3, sets=3)
    args = h.parse(p, argv)
    dtype = jnp.dtype(args.dtype)
    rec = h.Recorder(args, "grouped-matmul", flops="fwd 2*m*k*n, fwd+bwd 3x")
    shapes = QUICK if args.quick else STANDARD
    for m, k, n, groups in shapes:
        sets = [inputs(s, m, k, n, groups, dtype) for s in range(args.sets)]
        lhs, rhs, sizes = sets[0]
        with jax.default_matmul_precision("highest"):
            reference = jax.jit(jax.lax.ragged_dot)(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
        flops = 2.0 * m * k * n
        for name, fn in implementations().items():
            row = dict(impl=name, m=m, k=k, n=n, groups=groups)
            try:
                forward = jax.jit(fn)
                both = jax.jit(lambda lhs, rhs, sizes, fn=fn: jax.grad(
                    lambda a, b: fn(a, b, sizes).astype(jnp.float32).sum(), (0, 1))(lhs, rhs))
                row["rel_err"] = h.relative_error(forward(lhs, rhs, sizes), reference)
                for mode, step, factor in (("fwd", forward, 1.0), ("fwd+bwd", both, 3.0)):
                    secs = h.time_calls(lambda c, step=step: step(*sets[c % len(sets)]), args.warmup, args.reps,
                                        args.calls)
                    row[f"{mode}_ms"] = secs * 1e3
                    row[f"{mode}_tflops"] = factor * flops / secs / 1e12
            except Exception as error:  # noqa: BLE001 - one column failing leaves the others
                row["error"] = h.failure(error)
            rec.add(row)
            shown = row.get("error") or (f"fwd {row['fwd_ms']:8.3f} ms {row['fwd_tflops']:6.1f} TFLOP/s   "
                                         f"fwd+bwd {row['fwd+bwd_ms']:8.3f} ms {row['fwd+bwd_tflops']:6.1f} TFLOP/s   "
                                         f"err {row['rel_err']:.1e}")
            print(f"m={m} k={k} n={n} groups={groups:3d} {name:18s} {shown}", flush=True)
    rec.finish(plot)
    return 0


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "fwd_ms" in r]
    if not rows:
        return
    shapes = sorted({(r["m"], r["k"], r["n"], r["groups"]) for r in rows}, key=lambda s: s[3])
    impls = sorted({r["impl"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / len(impls)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for i, impl in enumerate(impls):
            values = [next((r[f"{mode}_tflops"] for r in rows if r["impl"] == impl
                            and (r["m"], r["k"], r["n"], r["groups"]) == s), 0.0) for s in shapes]
            ax.bar(np.arange(len(shapes)) + i * width, values, width, label=impl)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [f"{s[3]} experts" for s in shapes])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"grouped_matmul {mode}", fontsize=9)
        ax.legend(fontsize=7)
    m, k, n, _ = shapes[0]
    fig.suptitle(f"{doc['device']}, {doc['date']}, m={m} k={k} n={n}, {doc['setup']['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
