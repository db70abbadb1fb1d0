"""Where the time of ejkernel-cuda's paged forward goes: a timeline of its work items (each item's SM, kind, key
blocks, start and end on the GPU's global timer), from a build of the library with ``-DEJK_PAGED_TIMELINE``
(``csrc/flash_attention/paged_forward.cu`` writes the records into its split-K scratch; the package's build
leaves them out).

    # here (nvcc; the build's Python requirements: nvidia-cutlass, jaxlib, hatchling), into the carried .whl/:
    uv run --no-project --with "nvidia-cutlass>=4.2" --with jaxlib==0.11.2 --with numpy --with hatchling \\
        python benchmarks/experiments/cuda_paged_timeline.py --build .whl/timeline
    # on the device (bash scripts/device/run.sh ..., carry [".whl"]):
    python3 benchmarks/experiments/cuda_paged_timeline.py --library .whl/timeline/libejkernel_cuda.so \\
        [--parts mixed,decode,prefill] [--share 3] [--sets 2] [--calls 20] [--out $OUT/PREFIX]

First run on an H200 on 2026-11-27 (packages/ejkernel-cuda/NOTES.md, "Where the mixed step's time goes").

Per part it runs `--calls` calls back to back over `--sets` input sets and prints one JSON line: the last call's
span (first item's start to last item's end), per kind of item (query tiles, packed tiles) the count, median and
total time, the medians of an item's three phases (from its dealing to its first key block's arrival, the dealer's
key loop, and what follows it: merge, staging, stores, the item's barriers), the packed tiles' K/V rate per SM
(64 KB per 128-key block over the item's time), how many SMs held each kind over the span; across the calls, the
median gap between one call's last item and the next one's first (launches, combine, table), the period
(globaltimer, per call), the host's and the wall time per call, and each call's span and median SM clock (clock64
cycles over globaltimer ns per item).
``--out`` writes PREFIX.json (with the last call's records) and PREFIX.png (its items per SM over time).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packages" / "ejkernel-cuda"
sys.path.insert(0, str(ROOT / "benchmarks"))

RECORDS = 32768  # paged_forward.cu's kTimelineRecords
RECORD = np.dtype([("start", "<i8"), ("end", "<i8"), ("sm", "<i4"), ("packed", "<i4"), ("blocks", "<i4"),
                   ("cycles", "<i4"), ("first_block", "<i4"), ("loop_end", "<i4")])
BLOCK_BYTES = 128 * 128 * 2 * 2  # a 128-key block of K and V at D = 128, 16-bit


def build(directory: Path) -> Path:
    """The library with the timeline compiled in, from this checkout's sources (the package's build flags)."""
    sys.path.insert(0, str(PACKAGE))
    import hatch_build

    nvcc = hatch_build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel)")
    hatch_build.NVCC_FLAGS = (*hatch_build.NVCC_FLAGS, "-DEJK_PAGED_TIMELINE")
    library = directory / "libejkernel_cuda.so"
    with tempfile.TemporaryDirectory() as objects:  # only the library goes where it is carried
        hatch_build.build_library(PACKAGE / "csrc", library, Path(objects), nvcc)
    return library


def records_of(partials, work) -> np.ndarray:
    """The items' records from the scratch results of one call."""
    count = min(int(np.asarray(work)[3]), RECORDS)
    raw = np.asarray(partials).reshape(-1)[-RECORDS * RECORD.itemsize // 4:]
    return np.frombuffer(raw.tobytes(), RECORD)[:count]


def summary(records: np.ndarray) -> dict:
    t0 = records["start"].min()
    span = (records["end"].max() - t0) / 1e3
    clock = records["cycles"] / np.maximum(records["end"] - records["start"], 1)  # SM cycles per ns
    out = {"span_us": span, "items": len(records), "sm_clock_ghz_median": float(np.median(clock))}
    grid = np.arange(0.0, span, 1.0)
    for kind, name in ((0, "query_tiles"), (1, "packed_tiles")):
        mine = records[records["packed"] == kind]
        if not len(mine):
            continue
        us = (mine["end"] - mine["start"]) / 1e3
        start, end = (mine["start"] - t0) / 1e3, (mine["end"] - t0) / 1e3
        busy = ((start[None, :] <= grid[:, None]) & (grid[:, None] < end[None, :])).sum(axis=1)
        entry = {"count": len(mine), "median_us": float(np.median(us)), "sm_us": float(us.sum()),
                 "sms_median": float(np.median(busy)), "sms_max": int(busy.max()),
                 # an item's three phases (medians, us): to its first key block, the key loop, the rest
                 "to_first_block_us": float(np.median(mine["first_block"])) / 1e3,
                 "key_loop_us": float(np.median(mine["loop_end"] - mine["first_block"])) / 1e3,
                 "after_loop_us": float(np.median(mine["end"] - mine["start"] - mine["loop_end"])) / 1e3}
        if kind == 1:
            rate = mine["blocks"] * BLOCK_BYTES / (us * 1e3)  # GB/s
            entry.update(gbps_per_sm_median=float(np.median(rate)),
                         gbps_total=float(mine["blocks"].sum() * BLOCK_BYTES / (span * 1e3)))
        out[name] = entry
    return out


def plot(prefix: str, parts: dict, device: str, date: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(parts), 1, figsize=(11, 3.2 * len(parts)), squeeze=False)
    for ax, (part, records) in zip(axes[:, 0], parts.items()):
        t0 = records["start"].min()
        for kind, color in ((0, "tab:blue"), (1, "tab:orange")):
            mine = records[records["packed"] == kind]
            ax.barh(mine["sm"], (mine["end"] - mine["start"]) / 1e3, left=(mine["start"] - t0) / 1e3, height=0.9,
                    color=color, label=("query tiles", "packed tiles")[kind])
        ax.set_xlabel("us since the first item")
        ax.set_ylabel("SM")
        ax.set_title(f"{part}: {device}, {date}", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(f"{prefix}.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--build", help="DIR: compile the library with the timeline into DIR and stop")
    p.add_argument("--library", help="the timeline build of libejkernel_cuda.so to run")
    p.add_argument("--parts", default="mixed,decode,prefill")
    p.add_argument("--share", type=int, default=None, help="CudaPagedConfig.packed_share (default: the package's)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--sets", type=int, default=1,
                   help="input sets the warm-up calls rotate over (2: the caches not in L2 from the call before)")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls; the last one's records are plotted")
    p.add_argument("--out", default="", help="PREFIX: PREFIX.json and PREFIX.png")
    args = p.parse_args()
    if args.build:
        print(build(Path(args.build).resolve()))
        return
    if not args.library:
        raise SystemExit("--library (a build made with --build) or --build")

    import jax
    import jax.numpy as jnp
    from decode import MIXED, MIXED_ARGUMENTS, mixed_inputs, mixed_sequences
    from ejkernel_cuda import _native
    from ejkernel_cuda import ragged_page_attention as paged

    _native.LIBRARY_PATH = Path(args.library).resolve()
    _native.ensure_registered()
    heads, kv_heads, d = 32, 8, 128
    if args.share is None:
        args.share = paged.PACKED_SHARE
    device = jax.devices()[0].device_kind
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    found = {}
    report = {"device": device, "date": date, "share": args.share, "sets": args.sets, "mixed": MIXED, "parts": {}}
    for part in args.parts.split(","):
        sequences = mixed_sequences(part, **MIXED)
        sets = [mixed_inputs(jax.random.key(i), sequences, heads, kv_heads, d, args.page_size, jnp.bfloat16, i)[0]
                for i in range(args.sets)]
        no_sinks = jnp.zeros((heads, 1), jnp.float32)  # the plain variant: no soft cap, window or sinks
        step = jax.jit(lambda *a: paged.paged_ffi_call(*a, no_sinks, scale=1 / math.sqrt(d), packed_share=args.share))
        calls = args.calls
        jax.block_until_ready(step(*(sets[0][n] for n in MIXED_ARGUMENTS)))  # compiled
        dispatched = time.perf_counter()
        outputs = [step(*(sets[index % args.sets][n] for n in MIXED_ARGUMENTS))[1:] for index in range(calls)]
        host = (time.perf_counter() - dispatched) / calls  # the host's time per call (if it runs ahead)
        jax.block_until_ready(outputs)
        wall = (time.perf_counter() - dispatched) / calls  # as benchmarks time it (dispatch to the last result)
        spans = [records_of(partials, work) for work, partials in outputs]  # back to back, as in a model's step
        records = spans[-1]
        found[part] = records
        report["parts"][part] = summary(records)
        # between one call's last item and the next call's first: the launches, the combine and the prologue
        gaps = [float(after["start"].min() - before["end"].max()) / 1e3 for before, after in zip(spans, spans[1:])]
        period = float(spans[-1]["end"].max() - spans[0]["end"].max()) / 1e3 / (calls - 1)
        # per call in order: the span and the SM clock (does a long run slow down, and is it the clock?)
        per_call = [summary(one) for one in spans]
        report["parts"][part].update(gap_us_median=float(np.median(gaps)), period_us=period,
                                     host_us_per_call=host * 1e6, wall_us_per_call=wall * 1e6,
                                     spans_us=[round(c["span_us"], 1) for c in per_call],
                                     sm_clock_ghz=[round(c["sm_clock_ghz_median"], 3) for c in per_call])
        print(json.dumps({"part": part, **report["parts"][part]}), flush=True)
    if args.out:
        report["records"] = {part: records.tolist() for part, records in found.items()}
        report["record_fields"] = list(RECORD.names)
        Path(f"{args.out}.json").write_text(json.dumps(report))
        plot(args.out, found, device, date)


if __name__ == "__main__":
    main()
