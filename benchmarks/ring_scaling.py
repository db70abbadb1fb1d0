"""Ring attention strong scaling (issue #13): one sequence over every GPU of the host against one GPU.

For ``nvidia-h200-x2`` (or more GPUs), in one run:

    python benchmarks/ring_scaling.py --seqs 65536 131072 --ring-only-seqs 262144 --out /tmp/out

Shape: B=1, 16 heads, D=128, bf16 (``--kv-heads`` for GQA). Each S, causal and not, forward and
forward+backward:

- 1 GPU: ours (``flash_attention``, ``platform="auto"``) and cuDNN (``jax.nn.dot_product_attention``,
  ``implementation="cudnn"``) on the whole sequence; a row records an out-of-memory as its error;
- P GPUs: ``ring_attention(..., axis_name="sp", platform=...)`` under ``jax.shard_map`` with the sequence
  sharded over the P devices, zig-zag layout for causal calls (``zigzag_shard`` outside the timing), for
  each of ``--ring-platforms`` (default ``auto``: what the dispatcher picks, recorded in the row);
- ``--ring-only-seqs``: causal forward+backward on the P GPUs alone (lengths one GPU's dense formula cannot
  hold; no efficiency).

Efficiency = t(1 GPU, best of ours and cuDNN) / (P x t(P GPUs)); target >= 0.85. Timing as ``attention.py``
(warm-up, median of ``--reps`` samples of ``--calls`` back-to-back calls, two input sets). Writes
``<out>/<gpu>-x<P>-<date>-ring-scaling.json`` after every row, and a PNG.
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
from attention import time_calls, versions  # noqa: E402

AXIS = "sp"


def inputs(seq: int, heads: int, kv_heads: int, dim: int, sets: int = 2):
    out = []
    for s in range(sets):
        keys = jax.random.split(jax.random.key(s), 4)
        shapes = [(1, seq, heads, dim), (1, seq, kv_heads, dim), (1, seq, kv_heads, dim), (1, seq, heads, dim)]
        out.append(tuple(jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k, shape in zip(keys, shapes)))
    return out


def with_grads(attend, mode: str, options: dict | None = None):
    """The jitted step; ``options``: XLA compiler options of that jit (``--xla-options``)."""
    if mode == "fwd":
        return jax.jit(attend, compiler_options=options or None)

    def fwd_bwd(q, k, v, do):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(do)

    return jax.jit(fwd_bwd, compiler_options=options or None)


def single_gpu(kind: str, causal: bool):
    from ejkernel.modules import flash_attention

    if kind == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return lambda q, k, v: flash_attention(q, k, v, causal=causal)


def ring(devices: int, causal: bool, platform: str):
    from jax.sharding import PartitionSpec as P

    from ejkernel.modules import ring_attention

    mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])
    spec = P(None, AXIS)
    layout = "zigzag" if causal else "contiguous"

    def attend(q, k, v):
        local = lambda q, k, v: ring_attention(q, k, v, causal=causal, axis_name=AXIS,  # noqa: E731
                                               sequence_layout=layout, platform=platform)
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)

    return attend, layout


def dispatched(seq: int, heads: int, kv_heads: int, dim: int, devices: int, causal: bool, platform: str) -> str:
    """The platform ``platform`` resolves to for one device's shards (what ``auto`` picked)."""
    from ejkernel.modules.operations.ring_attention import RingAttention

    local = seq // devices
    q = jax.ShapeDtypeStruct((1, local, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, local, kv_heads, dim), jnp.bfloat16)
    try:
        return RingAttention().explain(q, kv, kv, causal=causal, platform=platform).platform
    except Exception as error:  # the row's own call reports the error
        return f"{type(error).__name__}: {error}"


def timed(doc, path, row, attend, mode, data, args):
    """Time one row into ``row`` (``ms`` or ``error``), append it to the document; seconds or None."""
    try:
        step = with_grads(attend, mode, args.xla_options)
        run = (lambda c: step(*data[c % 2][:3])) if mode == "fwd" else (lambda c: step(*data[c % 2]))
        seconds = time_calls(run, args.warmup, args.reps, args.calls)
        row["ms"] = seconds * 1e3
    except Exception as error:  # an out-of-memory single GPU is a result, not a crash
        seconds = None
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        traceback.print_exc(limit=1)
    doc["rows"].append(row)
    print(json.dumps(row), flush=True)
    path.write_text(json.dumps(doc, indent=1))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--devices", type=int, default=None, help="GPUs of the ring (default: all)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--ring-platforms", nargs="+", default=["auto"],
                        help="ring_attention platforms to time (auto: the dispatcher's pick)")
    parser.add_argument("--ring-only-seqs", type=int, nargs="*", default=[],
                        help="causal forward+backward of the ring alone at these lengths")
    parser.add_argument("--single-gpu", nargs="+", choices=("ours", "cudnn"), default=["ours", "cudnn"],
                        help="one-GPU baselines (ours: flash_attention, auto; cudnn: jax.nn's cuDNN)")
    parser.add_argument("--xla-options", type=json.loads, default={},
                        help='XLA compiler options of every timed jit, as JSON, e.g. '
                             '\'{"xla_gpu_enable_analytical_latency_estimator": true}\' (lets XLA overlap the '
                             'ring\'s ppermute with the cuDNN kernel)')
    args = parser.parse_args(argv)
    from ejkernel.modules import zigzag_shard

    devices = args.devices or jax.device_count()
    kind = jax.devices()[0].device_kind
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{kind.replace(' ', '_')}-x{devices}-{date}-ring-scaling.json"
    doc = dict(device=kind, devices=devices, date=date, versions=versions(), heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, xla_options=args.xla_options, calls=args.calls,
               reps=args.reps, rows=[])
    shape = (args.heads, args.kv_heads, args.head_dim)

    def ring_rows(seq, causal, mode, sets):
        times = {}
        for platform in args.ring_platforms:
            impl = f"ring-{devices}gpu" + ("" if platform == "auto" else f"-{platform}")
            attend, layout = ring(devices, causal, platform)
            data = [tuple(zigzag_shard(x, devices) for x in s) for s in sets] if layout == "zigzag" else sets
            row = dict(seq=seq, causal=causal, mode=mode, impl=impl, layout=layout,
                       dispatched=dispatched(seq, *shape, devices, causal, platform))
            times[impl] = timed(doc, path, row, attend, mode, data, args)
        return times

    for seq in args.seqs:
        sets = inputs(seq, *shape)
        for causal in (False, True):
            for mode in ("fwd", "fwd+bwd"):
                single = {}
                for impl in (f"{name}-1gpu" for name in args.single_gpu):
                    row = dict(seq=seq, causal=causal, mode=mode, impl=impl)
                    if impl == "ours-1gpu":
                        from ejkernel.modules.operations.flash_attention import FlashAttention

                        q = jax.ShapeDtypeStruct((1, seq, args.heads, args.head_dim), jnp.bfloat16)
                        kv = jax.ShapeDtypeStruct((1, seq, args.kv_heads, args.head_dim), jnp.bfloat16)
                        row["dispatched"] = FlashAttention().explain(q, kv, kv, causal=causal).platform
                    single[impl] = timed(doc, path, row, single_gpu(impl.split("-")[0], causal), mode, sets, args)
                best = min((t for t in single.values() if t), default=None)
                for impl, ring_time in ring_rows(seq, causal, mode, sets).items():
                    if best and ring_time:
                        eff = best / (devices * ring_time)
                        doc["rows"].append(dict(seq=seq, causal=causal, mode=mode, impl=impl, efficiency=eff,
                                                target=0.85, met=eff >= 0.85))
                        print(f"S={seq} causal={causal} {mode} {impl}: efficiency {eff:.2f} (>= 0.85: "
                              f"{'MET' if eff >= 0.85 else 'NOT MET'})", flush=True)
                        path.write_text(json.dumps(doc, indent=1))
    for seq in args.ring_only_seqs:
        ring_rows(seq, True, "fwd+bwd", inputs(seq, *shape))
    plot(doc, path.with_suffix(".png"))
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "efficiency" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"S={r['seq'] // 1024}k {'causal' if r['causal'] else 'full'} {r['mode']} {r['impl']}" for r in rows]
    ax.barh(labels, [r["efficiency"] for r in rows])
    ax.axvline(0.85, color="k", ls="--", label="target 0.85")
    ax.set_xlabel(f"strong-scaling efficiency on {doc['devices']} GPUs")
    ax.set_title(f"ring attention, {doc['device']} x{doc['devices']}, {doc['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
