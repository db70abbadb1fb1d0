"""Where two kernels' warps wait: Nsight Compute's per-instruction stall samples of two kernels side by side.

Reads the SASS source pages that ``benchmarks/experiments/cuda_flash_ncu.sh`` writes (``ncu -i REPORT --page
source --csv --print-source sass``), picks one kernel from each by a substring of its name, and prints, per stall
reason, the samples as a share of each kernel's total converted into microseconds of its duration (so kernels
sampled at different rates compare), then the executed-instruction counts per opcode where they differ most.

    python3 benchmarks/experiments/ncu_stall_compare.py ours.sass.csv flash_backward 694.5 \\
        fa3.sass.csv FlashAttnBwdSm90 626.1

Samples not attributed to any listed reason (mostly at the first wgmma of a group: the warpgroup waiting to issue
to the tensor cores) are shown as "(wgmma issue)". Where the page lists a kernel twice (it did for FA3's backward),
only its first listing is read.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def kernel_rows(path: str, name_part: str) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    kernel, header, taken = None, None, False
    with open(path, newline="") as file:
        for record in csv.reader(file):
            if not record:
                continue
            if record[0] == "Kernel Name":
                if taken and rows:
                    break  # the first listing of the kernel is complete
                kernel, header = record[1], None
                continue
            if record[0] == "Address":
                header = record
                continue
            if header and kernel and name_part in kernel:
                taken = True
                rows.append(dict(zip(header, record)))
    if not rows:
        raise SystemExit(f"{path}: no kernel whose name contains {name_part!r}")
    return rows


def opcode(source: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0]


def stall_microseconds(rows: list[dict[str, str]], duration_us: float) -> dict[str, float]:
    reasons = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    totals: collections.Counter[str] = collections.Counter()
    samples = 0
    for row in rows:
        count = int(row[ALL_SAMPLES] or 0)
        attributed = 0
        for reason in reasons:
            value = int(row[reason] or 0)
            totals[reason.removeprefix("stall_")] += value
            attributed += value
        totals["(wgmma issue)"] += count - attributed
        samples += count
    return {reason: duration_us * value / samples for reason, value in totals.items()}


def instruction_counts(rows: list[dict[str, str]]) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for row in rows:
        counts[opcode(row["Source"])] += int(row["Instructions Executed"] or 0)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for side in ("a", "b"):
        parser.add_argument(f"csv_{side}")
        parser.add_argument(f"kernel_{side}", help="a substring of the kernel's name")
        parser.add_argument(f"duration_{side}", type=float, help="the kernel's duration in us (ncu's details page)")
    parser.add_argument("--opcodes", type=int, default=20, help="opcodes to list (largest count differences)")
    args = parser.parse_args()
    a, b = kernel_rows(args.csv_a, args.kernel_a), kernel_rows(args.csv_b, args.kernel_b)
    stalls_a, stalls_b = stall_microseconds(a, args.duration_a), stall_microseconds(b, args.duration_b)
    print(f"stall reason: us of the duration, {args.kernel_a} / {args.kernel_b} / difference")
    for reason in sorted(stalls_a, key=lambda r: -stalls_a[r]):
        if stalls_a[reason] >= 0.5 or stalls_b.get(reason, 0) >= 0.5:
            print(f"  {reason:20s} {stalls_a[reason]:7.1f} {stalls_b.get(reason, 0):7.1f} "
                  f"{stalls_a[reason] - stalls_b.get(reason, 0):+7.1f}")
    counts_a, counts_b = instruction_counts(a), instruction_counts(b)
    print(f"instructions executed (warp level, millions): {sum(counts_a.values()) / 1e6:.1f} / "
          f"{sum(counts_b.values()) / 1e6:.1f}")
    for op in sorted(set(counts_a) | set(counts_b), key=lambda o: -abs(counts_a[o] - counts_b[o]))[: args.opcodes]:
        print(f"  {op:28s} {counts_a[op] / 1e6:8.2f} {counts_b[op] / 1e6:8.2f}")


if __name__ == "__main__":
    main()
