#!/usr/bin/env bash
# ON THE DEVICE (inside scripts/device/run.sh): Nsight Compute reports of the native CUDA flash-attention
# kernels and FlashAttention-3's at one shape, into $OUT/ncu/ (the .ncu-rep, the details page, and the
# per-instruction SASS page of each), as one ncu.tar.gz. SEQ (8192) and CAUSAL (empty / --causal) pick the shape.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/out}/ncu
mkdir -p "$OUT"
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
 --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats
 --section InstructionStats --section SourceCounters"
profile() {  # name impl kernel-regex launch-skip launch-count
    ncu --clock-control none --target-processes all -k "regex:$3" --launch-skip "$4" --launch-count "$5" \
        $SECTIONS --import-source no -f -o "$OUT/$1" \
        python3 benchmarks/experiments/cuda_flash_ncu.py --seq "${SEQ:-8192}" ${CAUSAL:-} --impls "$2" \
        > "$OUT/$1.log" 2>&1
    tail -3 "$OUT/$1.log"
    ncu -i "$OUT/$1.ncu-rep" --page details > "$OUT/$1.details.txt" 2>&1
    ncu -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1.sass.csv" 2>&1
    grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
        "$OUT/$1.details.txt" | head -40
}
# PROFILES picks among: native-bwd fa3-bwd native-fwd fa3-fwd (default: all four)
for name in ${PROFILES:-native-bwd fa3-bwd native-fwd fa3-fwd}; do
    case $name in
        native-bwd) profile native-bwd native 'flash_backward_kernel' 2 1 ;;
        fa3-bwd) profile fa3-bwd flash-attn3 'device_kernel' 4 4 ;;  # a step: forward, then the backward's three
        native-fwd) profile native-fwd native 'flash_forward_kernel' 2 1 ;;
        fa3-fwd) profile fa3-fwd flash-attn3 'device_kernel' 8 1 ;;
    esac
done
tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" ncu && rm -rf "$OUT"  # the device tool returns 8 files
