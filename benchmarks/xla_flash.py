"""ejkernel's XLA flash attention against ``jax.nn.dot_product_attention(implementation="xla")`` on a GPU.

One command (on the device: ``bash scripts/device/prepare.sh`` here, then run with ``carry: [".whl"]``):

    bash scripts/device/run.sh python3 benchmarks/xla_flash.py --out $OUT     # ~5 min on one H100/H200
    bash scripts/device/xla_flash.sh                                          # issue #14's check, <= 150 s

1. Memory (first, so the device's peak counter is this part's): forward+backward at S = 16k, 32k, 64k
   (B=1, H=16, D=128, bf16, causal) through the default config: the path the rule takes, XLA's compiled
   temp bytes (O(S): about 2x per doubling, never the S² logits), then one S=64k forward+backward run
   and the device's peak bytes in use.
2. Speed: the standard shapes (bf16, D=128, 16 heads, batch * seq = 16384, S = 1k..16k, causal and not,
   forward and forward+backward) for ``ejkernel-xla`` (the default config: the rule of
   ``ejkernel_xla.flash_attention``: forward+backward and a forward alone have their own memory rules;
   the table names the path each took), ``ejkernel-xla[blockwise]`` (forced) and ``xla``; on request the
   dense path forced (``[dense]``) and its variants (``[dense:selects]``, ``[dense:one-call]``:
   :func:`dense_variant`) and ``cudnn``; timing, TFLOP/s and relative errors as in ``attention.py``. The
   table's last columns are each ejkernel implementation / xla (issue #14's target: >= 1.0 wherever xla
   runs); the JSON's ``ratios`` the same.

Writes ``<out>/<device>-<date>-xla-flash[-<tag>].json`` (default ``benchmarks/results``) after every
measurement.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

import attention as bench  # benchmarks/attention.py: timing, inputs, FLOPs, numerics, versions
from _harness import failure

GiB = 2**30


def xla_impls(names: list[str]) -> list[bench.Impl]:
    from ejkernel.modules import flash_attention
    from ejkernel_xla.flash_attention import XlaFlashConfig

    def ejkernel(cfg):
        def attend(q, k, v, causal):
            return flash_attention(q, k, v, causal=causal, platform="xla", cfg=cfg)

        return attend

    known = {
        "ejkernel-xla": ejkernel(None),
        "ejkernel-xla[blockwise]": ejkernel(XlaFlashConfig(dense=False)),
        "ejkernel-xla[dense]": ejkernel(XlaFlashConfig(dense=True)),
        "ejkernel-xla[dense:selects]": dense_variant("selects", 1),
        "ejkernel-xla[dense:one-call]": dense_variant("constants", 1),
        "ejkernel-xla[dense:selects+chunks]": dense_variant("selects", None),
        "xla": bench._jax_nn("xla"),
        "cudnn": bench._jax_nn("cudnn"),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown --impls {unknown}; known: {', '.join(known)}")
    return [bench.Impl(name, known[name]) for name in names]


def dense_variant(empty_row_guard: str, query_chunks: int | None):
    """The dense path with another ``empty_row_guard`` (``ejkernel_xla._dense.EMPTY_ROW_GUARDS``) or number
    of query chunks (None: the rule, ``query_chunk_count``; 1: one dense call over all keys): the
    formulations compared in one process. Plain q, k, v (no masks or sinks), as the timed calls pass them;
    otherwise what ``XlaFlashAttention`` does for ``XlaFlashConfig(dense=True)``.

    ``[dense:selects]``: last session's dense forward (isfinite/positive selects, one call: 0.85-0.90x
    jax.nn causal on the H100); ``[dense:one-call]``: this session's guard without the causal chunks;
    ``[dense:selects+chunks]``: the old guard with the causal chunks (on the H200 the old guard's unfused
    softmax beat XLA's fused masked one: 51.5 vs 47.0 TFLOP/s causal at S=8k)."""
    from ejkernel.modules.operations._precision import resolve_precision
    from ejkernel_xla._blockwise import AttentionParams, key_tokens, query_tokens
    from ejkernel_xla._dense import flash_attention_dense

    def attend(q, k, v, causal):
        batch, q_len, _, head_dim = q.shape
        kv_len = k.shape[1]
        params = AttentionParams(softmax_scale=head_dim**-0.5, causal=causal,
                                 precision=resolve_precision(None, q.dtype))
        return flash_attention_dense(q, k, v, params=params, q_tokens=query_tokens(batch, q_len, kv_len),
                                     kv_tokens=key_tokens(batch, kv_len), empty_row_guard=empty_row_guard,
                                     query_chunks=query_chunks)

    return attend


def rule_path(batch: int, seq: int, heads: int, head_dim: int, dtype, mode: str = "fwd+bwd",
              causal: bool = True) -> str:
    """Which path the default config takes at this shape on this device: differentiated (``fwd+bwd``) or a
    forward that is not (``fwd``; its own, smaller memory rule)."""
    from ejkernel.modules.operations.flash_attention import FlashAttentionCall
    from ejkernel_xla.flash_attention import XlaFlashConfig, takes_dense_path

    x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
    call = FlashAttentionCall(query=x, key=x, value=x, causal=causal)
    return "dense" if takes_dense_path(call, XlaFlashConfig(), differentiated=mode != "fwd") else "blockwise"


def memory(seqs: list[int], run_seq: int, heads: int, head_dim: int, dtype, save=lambda part: None) -> dict:
    """Compiled temp bytes of the default config's forward+backward per S, and one run at ``run_seq``;
    ``save(part)`` after each of them (a run cut short keeps what it measured)."""
    default, blockwise = (
        bench.make_step(impl, True, "fwd+bwd") for impl in xla_impls(["ejkernel-xla", "ejkernel-xla[blockwise]"])
    )
    step = default
    rows = []
    def temp_bytes(fn, x):
        return jax.jit(fn).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes

    for seq in seqs:
        x = jax.ShapeDtypeStruct((1, seq, heads, head_dim), dtype)
        path = rule_path(1, seq, heads, head_dim, dtype)
        temp = temp_bytes(default, x)
        temp_blockwise = temp if path == "blockwise" else temp_bytes(blockwise, x)  # the same program
        rows.append(dict(seq=seq, path=path, temp_bytes=temp, blockwise_temp_bytes=temp_blockwise,
                         logits_f32_bytes=heads * seq * seq * 4))
        save(dict(compiled=rows))
        print(f"memory S={seq:6d} default config: path={rows[-1]['path']:9s} temp {temp / GiB:8.3f} GiB; "
              f"blockwise temp {temp_blockwise / GiB:6.3f} GiB; float32 logits {heads * seq * seq * 4 / GiB:,.1f} GiB",
              flush=True)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, run_seq, heads, head_dim), jnp.float32).astype(dtype) for key in keys)
    stats = jax.devices()[0].memory_stats() or {}
    before = stats.get("peak_bytes_in_use")
    start = time.perf_counter()
    out, grads = jax.jit(step)(q, k, v, do)
    jax.block_until_ready(grads)
    seconds = time.perf_counter() - start
    stats = jax.devices()[0].memory_stats() or {}
    run = dict(seq=run_seq, seconds_with_compile=seconds, peak_bytes_in_use=stats.get("peak_bytes_in_use"),
               peak_before=before, bytes_limit=stats.get("bytes_limit"),
               finite=bool(all(jnp.isfinite(g.astype(jnp.float32)).all() for g in grads)))
    peak = run["peak_bytes_in_use"]
    print(f"run S={run_seq} fwd+bwd causal: {seconds:.1f} s with compile, device peak "
          f"{'?' if peak is None else f'{peak / GiB:.2f} GiB'}, grads finite: {run['finite']}", flush=True)
    return dict(compiled=rows, run=run)


def ratios(rows: list[dict], against: str = "xla") -> list[dict]:
    """Per (mode, causal, S): every ejkernel implementation's time ratio ``against`` (>1: ejkernel faster),
    i.e. its TFLOP/s over ``against``'s (the same FLOPs)."""
    out = []
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["mode"], r["causal"], r["seq"]), {})[r["impl"]] = r
    for (mode, causal, seq), cell in cells.items():
        base = cell.get(against, {}).get("tflops")
        for name, r in cell.items():
            if name.startswith("ejkernel") and base and r.get("tflops"):
                out.append(dict(mode=mode, causal=causal, seq=seq, impl=name, path=r.get("path"),
                                against=against, ratio=r["tflops"] / base))
    return out


def ratio_table(rows: list[dict], against: str = "xla") -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    mine = [n for n in impls if n.startswith("ejkernel")]
    lines = ["| mode | causal | S | path | " + " | ".join(impls) + " | "
             + " | ".join(f"{n} / {against}" for n in mine) + " |",
             "|" + "---|" * (4 + len(impls) + len(mine))]
    keys = sorted({(r["mode"], r["causal"], r["seq"]) for r in rows}, key=lambda t: (t[0] != "fwd", t[1], t[2]))
    for mode, causal, seq in keys:
        cell = {r["impl"]: r for r in rows if (r["mode"], r["causal"], r["seq"]) == (mode, causal, seq)}
        tflops = {name: cell[name].get("tflops") if name in cell else None for name in impls}
        base = tflops.get(against)
        shown = [f"{tflops[n] / base:.2f}" if tflops.get(n) and base else "—" for n in mine]
        path = cell.get("ejkernel-xla", {}).get("path", "")
        lines.append(f"| {mode} | {'yes' if causal else 'no'} | {seq} | {path} | "
                     + " | ".join(f"{t:.0f}" if t else "—" for t in tflops.values()) + " | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--causal", default="no,yes")
    p.add_argument("--impls", default="ejkernel-xla,ejkernel-xla[blockwise],xla",
                   help="comma-separated, of: ejkernel-xla (the default config), ejkernel-xla[blockwise], "
                        "ejkernel-xla[dense] (forced), ejkernel-xla[dense:selects] (forced, the old empty-row "
                        "guard: ejkernel_xla._dense.EMPTY_ROW_GUARDS, one call), ejkernel-xla[dense:one-call] "
                        "(forced, no causal query chunks), ejkernel-xla[dense:selects+chunks] (the old guard, "
                        "chunked), xla, cudnn (jax.nn implementations)")
    p.add_argument("--causal-only-impls", default="", help="comma-separated impls measured only in causal cases "
                   "(variants that differ from the default only there)")
    p.add_argument("--fwd-only-impls", default="", help="comma-separated impls measured only in mode fwd")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--sets", type=int, default=2, help="input sets rotated through (beat the L2 cache)")
    p.add_argument("--errors", default="2048", help="seq lengths at which to measure numerics ('' for none)")
    p.add_argument("--errors-impls", default="", help="comma-separated impls whose numerics to measure "
                   "('' = all of --impls)")
    p.add_argument("--memory-seqs", default="16384,32768,65536", help="'' skips the memory part")
    p.add_argument("--tag", default="", help="suffix of the JSON's name (several runs on one day)")
    p.add_argument("--out", default=str(bench.RESULTS_DIR))
    args = p.parse_args(argv)

    device = jax.devices()[0]
    device_kind = getattr(device, "device_kind", device.platform)
    now = dt.datetime.now(dt.timezone.utc)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = out_dir / f"{device_kind.lower().replace(' ', '-')}-{now:%Y-%m-%d}-xla-flash{tag}.json"
    dtype = jnp.dtype(args.dtype)
    from ejkernel_xla.flash_attention import dense_budget_bytes

    budget = dense_budget_bytes()
    doc = dict(device=device_kind, date=now.isoformat(timespec="seconds"), versions=bench.versions(),
               dense_budget_bytes=budget,
               setup=dict(tokens=args.tokens, heads=args.heads, head_dim=args.head_dim, dtype=str(dtype),
                          warmup=args.warmup, reps=args.reps, calls=args.calls, input_sets=args.sets),
               memory=None, results=[], ratios=[], numerics=[])

    def save():
        doc["ratios"] = ratios(doc["results"])
        path.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"# {device_kind}, {now:%Y-%m-%d %H:%M} UTC; dense budget "
          f"{'none' if budget is None else f'{budget / GiB:.1f} GiB'}", flush=True)
    if args.memory_seqs:
        try:
            def save_memory(part):
                doc["memory"] = part
                save()

            doc["memory"] = memory([int(s) for s in args.memory_seqs.split(",")],
                                   max(int(s) for s in args.memory_seqs.split(",")), args.heads, args.head_dim, dtype,
                                   save=save_memory)
        except Exception as exc:  # noqa: BLE001 -- the speed part still runs
            traceback.print_exc()
            doc["memory"] = dict(error=failure(exc))
        save()

    impls = xla_impls([s for s in args.impls.split(",") if s])
    error_seqs = {int(s) for s in args.errors.split(",") if s}
    error_impls = set(filter(None, args.errors_impls.split(","))) or {i.name for i in impls}
    causal_only = set(filter(None, args.causal_only_impls.split(",")))
    fwd_only = set(filter(None, args.fwd_only_impls.split(",")))
    key = jax.random.key(0)
    for seq in (int(s) for s in args.seqs.split(",") if s):
        batch = max(1, args.tokens // seq)
        key, sub = jax.random.split(key)
        inputs = bench.random_inputs(sub, batch, seq, args.heads, args.head_dim, dtype, args.sets)
        for causal in (c == "yes" for c in args.causal.split(",")):
            for impl in impls:
                if not causal and impl.name in causal_only:
                    continue
                if seq in error_seqs and impl.name in error_impls:
                    try:
                        doc["numerics"].append(dict(impl=impl.name, seq=seq, causal=causal,
                                                    **bench.errors(impl, *inputs[0], causal)))
                    except Exception as exc:  # noqa: BLE001
                        doc["numerics"].append(dict(impl=impl.name, seq=seq, causal=causal, error=failure(exc)))
                for mode in args.modes.split(","):
                    if mode != "fwd" and impl.name in fwd_only:
                        continue
                    row = dict(impl=impl.name, seq=seq, batch=batch, causal=causal, mode=mode)
                    if impl.name == "ejkernel-xla":
                        row["path"] = rule_path(batch, seq, args.heads, args.head_dim, dtype, mode, causal)
                    elif impl.name.startswith("ejkernel-xla["):
                        row["path"] = "blockwise" if "blockwise" in impl.name else "dense"
                    try:
                        step = bench.make_step(impl, causal, mode)
                        start = time.perf_counter()  # the first call: compile (autotuning included) + one run
                        jax.block_until_ready(step(*(inputs[0] if mode == "fwd+bwd" else inputs[0][:3])))
                        row["first_call_s"] = time.perf_counter() - start
                        secs = bench.time_step(step, inputs, mode, args.warmup, args.reps, args.calls)
                        flops = bench.attention_flops(batch, args.heads, seq, args.head_dim, causal, mode)
                        row.update(ms=secs * 1e3, tflops=flops / secs / 1e12)
                    except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: the row says so
                        row["error"] = failure(exc)
                    doc["results"].append(row)
                    save()
                    shown = (f"{row['tflops']:7.1f} TFLOP/s {row['ms']:8.3f} ms "
                             f"(first call {row['first_call_s']:5.1f} s)" if "tflops" in row else row["error"])
                    print(f"S={seq:5d} B={batch:2d} {'causal' if causal else 'full  '} {mode:7s} {impl.name:28s} "
                          f"{shown}", flush=True)
        del inputs

    save()
    print()
    if doc["results"]:
        print(ratio_table(doc["results"]))
    for n in doc["numerics"]:
        if "error" not in n:
            print(f"errors S={n['seq']} causal={n['causal']} {n['impl']:28s} out {n['out']:.2e} dq {n['dq']:.2e} "
                  f"dk {n['dk']:.2e} dv {n['dv']:.2e}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
