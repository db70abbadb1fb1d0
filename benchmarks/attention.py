"""Attention benchmark: every installed ejkernel backend against cuDNN, XLA and JAX's Pallas `mha`.

One command (on a GPU; through the device tool: `bash scripts/device/run.sh python3 benchmarks/attention.py`):

    python benchmarks/attention.py                       # the full sweep
    python benchmarks/attention.py --seqs 2048,8192 --head-dims 128 --quick
    python benchmarks/attention.py --impls cudnn --cfg triton:fwd_block_q=64,fwd_num_warps=4  # explicit config
    python benchmarks/attention.py --impls cudnn,ejkernel-cuda-native   # the CUDA backend's own sm_90a kernels
    (the same as --cfg cuda:kernel=native; ejkernel-cuda is what its heuristic picks: native for causal D=128,
    else cuDNN where cuDNN takes it)

Sweep: S in {1k, 2k, 4k, 8k, 16k}, causal and not, head_dim 64 and 128, forward and forward+backward, bf16,
a fixed token budget (batch = tokens / S) and hidden size (heads = hidden / head_dim). Timing: jit, warm-up,
then `--reps` samples, each the mean of `--calls` calls queued back to back (so the host's dispatch hides
behind the GPU's work and the figure is the device's time per call) over rotating sets of fresh random
inputs (more data than L2); a cell times its implementations in `--rounds` rounds, interleaved in a rotating
order (the GPU's clock under sustained load moves between measurements), and reports the median of the
rounds' median samples (every round's in `ms_rounds`). TFLOP/s: forward 4·B·H·S²·D (half if causal),
forward+backward 3.5× that. Numerics (`--errors`): relative L2 error of out, dq, dk, dv against a float32
XLA reference at one shape per head dim, for every implementation.

Writes `benchmarks/results/<device>-<date>.json` (or `--out DIR`), a PNG plot of TFLOP/s against S per
implementation, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (RESULTS_DIR, failure, relative_error, time_calls,  # noqa: E402,F401 (re-exported)
                      usable_platforms, versions)


# ---- implementations ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable  # (q, k, v, causal) -> out, layout [B, S, H, D]


def _jax_nn(implementation: str) -> Callable:
    def attend(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    return attend


def _jax_pallas_mha() -> Callable | None:
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    except Exception:
        return None

    def attend(q, k, v, causal):
        return pallas_attention.mha(q, k, v, segment_ids=None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)

    return attend


def _flash_attn3() -> Callable | None:
    """flash-attn3-jax's ``flash_mha`` (FlashAttention-3 through XLA FFI; Hopper, D=128 wheels on PyPI), where
    installed (carry its wheel: ``EXTRA_WHEELS="flash-attn3-jax==0.2.3" bash scripts/device/prepare.sh``)."""
    try:
        from flash_attn3_jax import flash_mha
    except Exception as error:  # noqa: BLE001 - any import failure: the column is skipped, with the reason
        print(f"# no flash-attn3-jax: {type(error).__name__}: {error}", file=sys.stderr)
        return None

    def attend(q, k, v, causal):
        return flash_mha(q, k, v, softmax_scale=1.0 / math.sqrt(q.shape[-1]), is_causal=causal)

    return attend


def usable_gpu_platforms(algorithm: str) -> list[str]:
    """The platforms that register ``algorithm`` for the GPU and can run here, best first (each one passed
    over is named on stderr with its reason)."""
    return usable_platforms(algorithm, "gpu")


def _ejkernel_impls() -> list[Impl]:
    """One entry per platform that has flash_attention registered for the GPU and is usable here."""
    try:
        from ejkernel.modules.operations.flash_attention import flash_attention

        platforms = usable_gpu_platforms("flash_attention")
    except Exception:
        traceback.print_exc()
        return []
    impls = []
    for platform in platforms:

        def attend(q, k, v, causal, platform=platform):
            return flash_attention(q, k, v, causal=causal, platform=platform)

        impls.append(Impl(f"ejkernel-{platform}", attend))
    native = _cuda_native_impl() if "cuda" in platforms else None
    return impls + ([native] if native is not None else [])


def _cuda_native_impl() -> Impl | None:
    """``ejkernel-cuda-native``: the CUDA backend's own sm_90a kernels, forced by their config (the
    ``ejkernel-cuda`` column runs what the heuristic picks: the native kernels for causal head_dim-128 calls,
    cuDNN for the rest cuDNN takes)."""
    from ejkernel.modules.operations.flash_attention import flash_attention
    from ejkernel_cuda.flash_attention import CudaFlashConfig
    from ejkernel_cuda.native_flash import usable_here

    reason = usable_here()
    if reason:
        print(f"# skipping ejkernel-cuda-native: {reason}", file=sys.stderr)
        return None

    def attend(q, k, v, causal):
        return flash_attention(q, k, v, causal=causal, platform="cuda", cfg=CudaFlashConfig(kernel="native"))

    return Impl("ejkernel-cuda-native", attend)


def _config_value(text: str):
    """A ``--cfg`` field's value: ``none``, an int, ``true`` / ``false``, else the text itself."""
    lowered = text.lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text


def configured_impls(specs: list[str]) -> list[Impl]:
    """``--cfg triton:fwd_block_q=128,fwd_num_warps=4``: an ejkernel platform run with an explicit config,
    its implementation's own config type built from the given fields (:func:`_config_value`: ints, ``none``,
    ``true``/``false``, names such as ``cuda:kernel=native``; the other fields keep their defaults), e.g.
    ``ejkernel_triton.flash_attention.TritonFlashConfig``."""
    from ejkernel.kernels._registry import kernel_registry
    from ejkernel.modules.operations.flash_attention import flash_attention

    impls = []
    for text in specs:
        platform, _, fields = text.partition(":")
        spec = next(s for s in kernel_registry.find("flash_attention", platform, "gpu"))
        values = dict(item.split("=", 1) for item in fields.split(",") if item)
        cfg = spec.implementation.config_type(**{name: _config_value(value) for name, value in values.items()})

        def attend(q, k, v, causal, platform=platform, cfg=cfg):
            return flash_attention(q, k, v, causal=causal, platform=platform, cfg=cfg)

        impls.append(Impl(f"ejkernel-{platform}[{fields}]", attend))
    return impls


def implementations(selected: list[str] | None, configured: list[str] = ()) -> list[Impl]:
    impls = _ejkernel_impls()
    impls.append(Impl("cudnn", _jax_nn("cudnn")))
    impls.append(Impl("xla", _jax_nn("xla")))
    mha = _jax_pallas_mha()
    if mha is not None:
        impls.append(Impl("jax-pallas-mha", mha))
    fa3 = _flash_attn3()
    if fa3 is not None:
        impls.append(Impl("flash-attn3", fa3))
    if selected:
        here = ", ".join(i.name for i in impls)
        missing = [name for name in selected if name not in {i.name for i in impls}]
        impls = [i for i in impls if i.name in selected]
        if not impls and not configured:
            raise SystemExit(f"--impls {','.join(selected)}: none of these runs here; available: {here}")
        if missing:  # misspelled, or not usable here (the reason was printed above)
            print(f"# --impls: not run: {', '.join(missing)} (here: {here})", file=sys.stderr)
    return impls + configured_impls(list(configured))


# ---- timing ------------------------------------------------------------------------------------------


def attention_flops(batch, heads, seq, head_dim, causal, mode) -> float:
    flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def make_step(impl: Impl, causal: bool, mode: str) -> Callable:
    attend = functools.partial(impl.fn, causal=causal)
    if mode == "fwd":
        return jax.jit(attend)

    def fwd_bwd(q, k, v, do):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(do)

    return jax.jit(fwd_bwd)


def random_inputs(key, batch, seq, heads, head_dim, dtype, sets):
    out = []
    for s in range(sets):
        ks = jax.random.split(jax.random.fold_in(key, s), 4)
        q, k, v, do = (jax.random.normal(kk, (batch, seq, heads, head_dim), jnp.float32).astype(dtype) for kk in ks)
        out.append((q, k, v, do))
    return out


def time_step(step, inputs, mode, warmup, reps, calls) -> float:
    """:func:`time_calls` of an attention step over rotating (q, k, v[, do]) input sets."""
    args = [x if mode == "fwd+bwd" else x[:3] for x in inputs]
    return time_calls(lambda c: step(*args[c % len(args)]), warmup, reps, calls)


def interleaved_rows(impls, inputs, d, seq, batch, heads, causal, mode, args) -> list[dict]:
    """One cell's row per implementation, timed in ``args.rounds`` rounds that each time every implementation
    once (:func:`time_step`), the order rotated by one per round: back-to-back attention runs the GPU below its
    boost clock, so implementations timed one after the other met different clocks (on an H100 one cell moved
    10 % between runs while Nsight Compute's kernel times held). ``ms`` is the median of the rounds' medians,
    ``ms_rounds`` all of them; an implementation that fails to build or run gets ``error`` instead."""
    steps, rows = {}, {}
    for impl in impls:
        rows[impl.name] = dict(impl=impl.name, head_dim=d, seq=seq, batch=batch, heads=heads, causal=causal,
                               mode=mode)
        try:
            steps[impl.name] = make_step(impl, causal, mode)
        except Exception as exc:  # noqa: BLE001
            rows[impl.name]["error"] = failure(exc)
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)] if names else ():
            if name not in times:
                continue
            try:
                times[name].append(time_step(steps[name], inputs, mode, args.warmup, args.reps, args.calls))
            except Exception as exc:  # noqa: BLE001
                rows[name]["error"] = failure(exc)
                del times[name]
    for name, secs in times.items():
        median = float(np.median(secs))
        rows[name].update(ms=median * 1e3, ms_rounds=[round(s * 1e3, 4) for s in secs],
                          tflops=attention_flops(batch, heads, seq, d, causal, mode) / median / 1e12)
    return list(rows.values())


# ---- numerics ----------------------------------------------------------------------------------------


def errors(impl: Impl, q, k, v, do, causal) -> dict[str, float]:
    """Relative L2 error of out, dq, dk, dv against float32 XLA attention on the same inputs."""

    def grads(fn, *args):
        out, pullback = jax.vjp(functools.partial(fn, causal=causal), *args[:3])
        return (out, *pullback(args[3]))

    ref = jax.jit(functools.partial(grads, _jax_nn("xla")))(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    got = jax.jit(functools.partial(grads, impl.fn))(q, k, v, do)
    return {name: relative_error(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


# ---- reporting ---------------------------------------------------------------------------------------


def give_fla_a_triton_cache() -> None:
    """Before importing fla (PyTorch Triton kernels) in a process that imported jax-triton: jax-triton empties
    TRITON_CACHE_DIR at import (it compiles in memory), and fla's autotuner then fails with "Could not create
    or locate cache dir". ``FLA_TRITON_CACHE_DIR`` keeps the cache (with ``TRITON_CACHE_AUTOTUNING=1``, fla's
    autotuning results) across processes; otherwise a fresh temporary directory."""
    import os
    import tempfile

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = (os.environ.get("FLA_TRITON_CACHE_DIR")
                                          or tempfile.mkdtemp(prefix="fla-triton-cache-"))
        os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)


def markdown_table(rows: list[dict], impls: list[str]) -> str:
    header = "| D | mode | causal | S | " + " | ".join(impls) + " |"
    lines = [header, "|" + "---|" * (4 + len(impls))]
    keys = sorted({(r["head_dim"], r["mode"], r["causal"], r["seq"]) for r in rows},
                  key=lambda t: (t[0], t[1] != "fwd", t[2], t[3]))
    for d, mode, causal, seq in keys:
        cells = []
        for name in impls:
            hit = [r for r in rows
                   if (r["head_dim"], r["mode"], r["causal"], r["seq"], r["impl"]) == (d, mode, causal, seq, name)]
            cells.append(f"{hit[0]['tflops']:.0f}" if hit and hit[0].get("tflops") else "—")
        lines.append(f"| {d} | {mode} | {'yes' if causal else 'no'} | {seq} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], impls: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["head_dim"], r["mode"], r["causal"]) for r in rows}, key=lambda t: (t[0], t[1] != "fwd", t[2]))
    cols = 4
    nrows = max(1, math.ceil(len(combos) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (d, mode, causal) in zip(axes.flat, combos):
        for name in impls:
            pts = sorted((r["seq"], r["tflops"]) for r in rows
                         if (r["head_dim"], r["mode"], r["causal"], r["impl"]) == (d, mode, causal, name)
                         and r.get("tflops"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} {mode} {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=110)


# ---- main --------------------------------------------------------------------------------------------


def print_report(doc: dict) -> None:
    setup = doc["setup"]
    print(f"## {doc['device']}, {doc['date'][:10]}, TFLOP/s ({setup['dtype']}, {setup['tokens']} tokens, "
          f"hidden {setup['hidden']})")
    print(markdown_table(doc["results"], doc["implementations"]))
    if doc.get("numerics"):
        print()
        print("## relative L2 error vs float32 XLA (out / dq / dk / dv)")
        for n in doc["numerics"]:
            if "error" in n:
                print(f"D={n['head_dim']} S={n['seq']} causal={n['causal']} {n['impl']}: {n['error'][:100]}")
            else:
                print(f"D={n['head_dim']} S={n['seq']} causal={n['causal']} {n['impl']:18s} "
                      f"{n['out']:.2e} {n['dq']:.2e} {n['dk']:.2e} {n['dv']:.2e}")


def replot(path: Path) -> int:
    doc = json.loads(path.read_text())
    plot(doc["results"], doc["implementations"], path.with_suffix(".png"),
         f"flash attention, {doc['setup']['dtype']}, {doc['setup']['tokens']} tokens, hidden {doc['setup']['hidden']}"
         f" — {doc['device']}, {doc['date'][:10]} (jax {doc['versions'].get('jax')}, triton "
         f"{doc['versions'].get('triton')}, jax-triton {doc['versions'].get('jax-triton')})")
    print_report(doc)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--causal", default="no,yes")
    p.add_argument("--impls", default="", help="comma-separated subset of implementation names")
    p.add_argument("--cfg", action="append", default=[], metavar="PLATFORM:FIELD=VALUE,...",
                   help="also run an ejkernel platform with an explicit config, e.g. "
                        "triton:fwd_block_q=128,fwd_block_kv=128,fwd_num_warps=4,fwd_num_stages=2 (repeatable)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="rounds over the implementations per cell (rotated order)")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated through (beat the L2 cache)")
    p.add_argument("--errors", default="2048", help="seq lengths at which to measure numerics ('' for none)")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--name", default="", help="result file stem (default <device>-<date>)")
    p.add_argument("--replot", default="", help="only redraw the PNG and reprint the tables of a result JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.replot:
        return replot(Path(args.replot))

    device = jax.devices()[0]
    device_kind = getattr(device, "device_kind", device.platform)
    now = dt.datetime.now(dt.timezone.utc)
    stem = args.name or f"{device_kind.lower().replace(' ', '-')}-{now:%Y-%m-%d}"
    impls = implementations([s for s in args.impls.split(",") if s], args.cfg)
    names = [i.name for i in impls]
    dtype = jnp.dtype(args.dtype)
    print(f"# {device_kind}, {now:%Y-%m-%d %H:%M} UTC, implementations: {', '.join(names)}", flush=True)

    rows: list[dict] = []
    numerics: list[dict] = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():  # after every measurement: a run cut short still leaves its numbers
        document = dict(
            device=device_kind, date=now.isoformat(timespec="seconds"), versions=versions(),
            setup=dict(tokens=args.tokens, hidden=args.hidden, dtype=str(dtype), warmup=args.warmup, reps=args.reps,
                       calls=args.calls, input_sets=args.sets, rounds=args.rounds,
                       timing="median over rounds (implementations interleaved, order rotated) of the median of "
                              "reps; each rep = mean of back-to-back calls ended by block_until_ready",
                       flops="fwd 4*B*H*S^2*D (x0.5 causal); fwd+bwd 3.5x fwd"),
            implementations=names, results=rows, numerics=numerics,
        )
        (out_dir / f"{stem}.json").write_text(json.dumps(document, indent=1))

    key = jax.random.key(0)
    error_seqs = {int(s) for s in args.errors.split(",") if s}
    for d in (int(x) for x in args.head_dims.split(",")):
        heads = args.hidden // d
        for seq in (int(x) for x in args.seqs.split(",")):
            batch = max(1, args.tokens // seq)
            key, sub = jax.random.split(key)
            inputs = random_inputs(sub, batch, seq, heads, d, dtype, args.sets)
            for causal in (c == "yes" for c in args.causal.split(",")):
                for impl in impls if seq in error_seqs else ():
                    try:
                        err = errors(impl, *inputs[0], causal)
                        numerics.append(dict(impl=impl.name, head_dim=d, seq=seq, batch=batch, heads=heads,
                                             causal=causal, **err))
                    except Exception as exc:  # noqa: BLE001
                        numerics.append(dict(impl=impl.name, head_dim=d, seq=seq, causal=causal,
                                             error=failure(exc)))
                for mode in args.modes.split(","):
                    for row in interleaved_rows(impls, inputs, d, seq, batch, heads, causal, mode, args):
                        rows.append(row)
                        save()
                        shown = f"{row['tflops']:7.1f} TFLOP/s {row['ms']:8.3f} ms" if "tflops" in row else row["error"]
                        print(f"D={d:3d} S={seq:5d} B={batch:2d} {'causal' if causal else 'full  '} {mode:7s} "
                              f"{row['impl']:18s} {shown}", flush=True)
            del inputs

    save()
    try:
        replot_title = json.loads((out_dir / f"{stem}.json").read_text())
        plot(rows, names, out_dir / f"{stem}.png",
             f"flash attention, {dtype}, {args.tokens} tokens, hidden {args.hidden} — {device_kind}, {now:%Y-%m-%d}"
             f" (jax {jax.__version__}, triton {replot_title['versions'].get('triton')})")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print()
    print_report(json.loads((out_dir / f"{stem}.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
