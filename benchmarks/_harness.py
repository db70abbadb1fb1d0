"""The plumbing the benchmark scripts share: timing, numerics, the versions and device of a run, the ejkernel
platforms usable here, and a result document written after every row.

``time_calls``, ``relative_error`` and ``versions`` were ``attention.py``'s (it re-exports them, so
``from attention import time_calls`` still works); the rest serves the per-operation scripts
(``dense_attention.py``, ``mla.py``, ``mean_pooling.py``, ``grouped_matmul.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import platform as host_platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
UNITS = {"tflops": 1e12, "gbps": 1e9}  # a row's throughput key -> its scale (work per second / scale)


def time_calls(run: Callable[[int], Any], warmup: int, reps: int, calls: int) -> float:
    """Median over `reps` samples of the mean time of `calls` back-to-back calls ``run(i)`` (seconds); ``run``
    picks its inputs from the call number ``i`` (rotating input sets beat the L2 cache)."""
    for i in range(warmup):
        jax.block_until_ready(run(i))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        last = None
        for c in range(calls):
            last = run(c)
        jax.block_until_ready(last)
        samples.append((time.perf_counter() - t0) / calls)
    return float(np.median(samples))


def relative_error(a, b) -> float:
    """Relative L2 error of ``a`` against ``b`` in float64 (inf when ``a`` is not finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": host_platform.python_version(), "jax": jax.__version__}
    for dist in ("jaxlib", "triton", "jax-triton", "ejkernel-core", "ejkernel-triton", "ejkernel-pallas",
                 "ejkernel-xla", "ejkernel-cuda"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def usable_platforms(algorithm: str, backend: str | None = None) -> list[str]:
    """Platforms registering ``algorithm`` for ``backend`` (default: this machine's device) whose plugin is
    usable here, best first; each one passed over is named on stderr with its reason."""
    from ejkernel.kernels._registry import kernel_registry
    from ejkernel.plugins import usable_reason

    platforms: list[str] = []
    for spec in kernel_registry.find(algorithm, None, backend or jax.default_backend()):
        reason = usable_reason(spec.plugin)
        if reason:
            print(f"# skipping ejkernel {algorithm} platform={spec.platform.value}: {reason}", file=sys.stderr)
        elif spec.platform.value not in platforms:
            platforms.append(spec.platform.value)
    return platforms


def failure(error: BaseException) -> str:
    """What a row records of the exception that ended it: type and first line."""
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def add_common_args(parser: argparse.ArgumentParser, *, reps: int = 7, calls: int = 5, warmup: int = 2,
                    sets: int = 3) -> None:
    """``--quick --dtype --reps --calls --warmup --sets --out --name`` (see :func:`time_calls`)."""
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few samples: a smoke run on any machine (CPU: seconds)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=reps, help="timed samples (the median is reported)")
    parser.add_argument("--calls", type=int, default=calls, help="back-to-back calls per sample")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--sets", type=int, default=sets, help="fresh input sets rotated through (beat the L2)")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder of the JSON and PNG")
    parser.add_argument("--name", default="", help="result file stem (default <device>-<date>-<benchmark>)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; ``--quick`` also cuts the timing to 2 samples of 2 calls over 2 input sets after 1 warm-up."""
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.calls, args.warmup, args.sets = 2, 2, 1, 2
    return args


class Recorder:
    """One run's document (device, date, versions, setup, ``rows``), written to ``<out>/<stem>.json`` after
    every row, so that a run cut short still leaves its numbers."""

    def __init__(self, args: argparse.Namespace, benchmark: str, **setup):
        device = jax.devices()[0]
        self.device = str(getattr(device, "device_kind", device.platform))
        now = dt.datetime.now(dt.timezone.utc)
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stem = args.name or f"{'-'.join(self.device.lower().split()[:2])}-{now:%Y-%m-%d}-{benchmark}"
        timing = dict(warmup=args.warmup, reps=args.reps, calls=args.calls, input_sets=args.sets,
                      timing="median of reps; each rep = mean of back-to-back calls ended by block_until_ready")
        self.doc: dict[str, Any] = dict(benchmark=benchmark, device=self.device, backend=jax.default_backend(),
                                        date=now.isoformat(timespec="seconds"), versions=versions(),
                                        quick=bool(args.quick), setup={**setup, "dtype": args.dtype, **timing},
                                        rows=[])
        print(f"# {benchmark}: {self.device}, {now:%Y-%m-%d %H:%M} UTC, jax {jax.__version__}", flush=True)

    @property
    def json_path(self) -> Path:
        return self.out_dir / f"{self.stem}.json"

    @property
    def png_path(self) -> Path:
        return self.out_dir / f"{self.stem}.png"

    def save(self) -> None:
        self.json_path.write_text(json.dumps(self.doc, indent=1))

    def add(self, row: dict) -> dict:
        self.doc["rows"].append(row)
        self.save()
        return row

    def finish(self, plot: Callable[[dict, Path], None]) -> None:
        """Save, draw the PNG (a plotting failure is printed, not raised) and say where both are."""
        self.save()
        try:
            plot(self.doc, self.png_path)
        except Exception as error:  # noqa: BLE001 - the JSON is what matters
            print(f"# no plot: {failure(error)}", file=sys.stderr)
        print(f"wrote {self.json_path}" + (f" and {self.png_path.name}" if self.png_path.exists() else ""))


def timed_row(rec: Recorder, row: dict, make_step: Callable[[], Callable], sets: Sequence[tuple],
              args: argparse.Namespace, work: float, unit: str = "tflops", label: str = "") -> dict:
    """Build the step (``make_step()``, a jitted function of one input set), time it over the rotating
    ``sets`` (:func:`time_calls`) into ``row`` (``ms`` and ``unit``: ``work`` per second, in TFLOP/s or
    GB/s), or record the exception that stopped it (``error``: the run goes on); add the row to the
    document and print it."""
    try:
        step = make_step()
        seconds = time_calls(lambda c: step(*sets[c % len(sets)]), args.warmup, args.reps, args.calls)
        row.update({"ms": seconds * 1e3, unit: work / seconds / UNITS[unit]})
    except Exception as error:  # noqa: BLE001 - one failing column leaves the others
        row["error"] = failure(error)
    rec.add(row)
    shown = row.get("error") or f"{row['ms']:9.3f} ms {row[unit]:8.1f} {'TFLOP/s' if unit == 'tflops' else 'GB/s'}"
    print(f"{label} {row.get('mode', ''):7s} {row['impl']:28s} {shown}", flush=True)
    return row


# ---- attention-like sweeps (dense_attention.py, mla.py): S x causal x implementation x mode ---------------


@dataclasses.dataclass(frozen=True)
class Column:
    """One implementation: ``fn(*inputs, causal=...)`` -> out, or (out, aux) when ``has_aux`` (aux, e.g.
    the attention weights, is returned by the step but not differentiated)."""

    name: str
    fn: Callable
    has_aux: bool = False


def add_sweep_args(parser: argparse.ArgumentParser, *, seqs: str, errors: str) -> None:
    parser.add_argument("--seqs", default=seqs, help="sequence lengths (batch = tokens / S)")
    parser.add_argument("--causal", default="no,yes")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--impls", default="", help="comma-separated subset of the column names")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq")
    parser.add_argument("--errors", default=errors, help="seq lengths at which to measure numerics ('' for none)")


@functools.lru_cache(maxsize=None)
def make_step(column: Column, causal: bool | None, mode: str) -> Callable:
    """The jitted forward ``(*inputs)``, or forward+backward ``(*inputs, cotangent)`` -> (out, [aux,] grads of
    every input) through ``jax.vjp`` (one per column, causal and mode: numerics and timing share its
    compilations); ``causal=None``: ``column.fn`` takes no ``causal``."""
    attend = column.fn if causal is None else functools.partial(column.fn, causal=causal)
    if mode == "fwd":
        return jax.jit(attend)

    def fwd_bwd(*inputs):
        *primals, cotangent = inputs
        if column.has_aux:
            out, pullback, aux = jax.vjp(attend, *primals, has_aux=True)
            return out, aux, pullback(cotangent)
        out, pullback = jax.vjp(attend, *primals)
        return out, pullback(cotangent)

    return jax.jit(fwd_bwd)


def gradient_errors(column: Column, reference: Callable, inputs: tuple, causal: bool | None,
                    names: Sequence[str]) -> dict[str, float]:
    """Relative L2 error of the output and every input's gradient (``names``: out, then one per input)
    against ``reference`` run in float32 on the same inputs (the last one the output's cotangent)."""
    got = make_step(column, causal, "fwd+bwd")(*inputs)
    want = make_step(Column("reference", reference), causal, "fwd+bwd")(*(x.astype(jnp.float32) for x in inputs))
    got = (got[0], *got[-1])
    want = (want[0], *want[-1])
    return {name: relative_error(g, w) for name, g, w in zip(names, got, want)}


def sweep(rec: Recorder, args: argparse.Namespace, dims: dict, inputs: Callable[[int, int, int], list[tuple]],
          columns: Sequence[Column], flops: Callable[[dict, bool, str], float], reference: Callable,
          names: Sequence[str], title: str) -> None:
    """Time every column at every ``--seqs`` length S (batch ``--tokens`` / S; ``inputs(seed, batch, seq)``
    gives the input sets, each one's last entry the output's cotangent), ``--causal`` and ``--modes``, as rows
    ``impl, **dims, seq, batch, causal, mode, ms, tflops`` (``attention.py``'s: its ``plot`` draws the PNG
    and ``markdown_table`` the printed table; ``dims`` must hold ``head_dim``); numerics
    (:func:`gradient_errors` against ``reference``, one name per output and input) at the ``--errors``
    lengths into ``doc["numerics"]``."""
    from attention import markdown_table, plot

    wanted = {s for s in args.impls.split(",") if s}
    columns = [c for c in columns if not wanted or c.name in wanted]
    error_seqs = {int(s) for s in args.errors.split(",") if s}
    numerics = rec.doc.setdefault("numerics", [])
    for seed, seq in enumerate(int(s) for s in args.seqs.split(",")):
        batch = max(1, args.tokens // seq)
        shape, sets = dict(**dims, seq=seq, batch=batch), inputs(seed, batch, seq)
        for causal in (c == "yes" for c in args.causal.split(",")):
            label = f"S={seq:5d} B={batch:2d} {'causal' if causal else 'full  '}"
            for column in columns:
                if seq in error_seqs:
                    entry = dict(impl=column.name, **shape, causal=causal)
                    try:
                        entry.update(gradient_errors(column, reference, sets[0], causal, names))
                    except Exception as error:  # noqa: BLE001
                        entry["error"] = failure(error)
                    numerics.append(entry)
                for mode in args.modes.split(","):
                    row = dict(impl=column.name, **shape, causal=causal, mode=mode)
                    mode_sets = [s if mode == "fwd+bwd" else s[:-1] for s in sets]
                    timed_row(rec, row, lambda: make_step(column, causal, mode), mode_sets, args,
                              flops(shape, causal, mode), label=label)
        del sets
    impls = [c.name for c in columns]
    rec.finish(lambda doc, path: plot(doc["rows"], impls, path, f"{title}, {args.dtype}, {args.tokens} tokens "
                                      f"— {doc['device']}, {doc['date'][:10]}"))
    print(f"\n## {rec.device}, TFLOP/s (D = head_dim)")
    print(markdown_table(rec.doc["rows"], impls))
    if numerics:
        print(f"\n## relative L2 error vs the float32 reference ({' / '.join(names)})")
    for n in numerics:
        values = n.get("error") or " ".join(f"{n[name]:.2e}" for name in names)
        print(f"S={n['seq']} causal={n['causal']} {n['impl']:28s} {values}")
