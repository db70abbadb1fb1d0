#!/usr/bin/env bash
# Where the linear-attention time goes at T=16k (B=4 H=8 K=V=128 bf16): each kernel's time under Nsight
# Compute (benchmarks/experiments/kernel_times.py). ON THE DEVICE, from the repo root, after
# `bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/profile_linear.sh lightning:fwd-16384 gla:fwd-16384 lightning:fwd+bwd-16384
#   SECTIONS=1 bash scripts/device/profile_linear.sh lightning:fwd-16384   # + ncu sections of the main kernels
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/profile_linear.sh "$@"
fi
OUT=${OUT:-/tmp/out}
export XDG_CACHE_HOME=/tmp/xdg-cache TRITON_HOME=/tmp/triton-home
KT=benchmarks/experiments/kernel_times.py
for item in "$@"; do
    op=${item%%:*} variant=${item#*:}
    csv="$OUT/ncu-$op-$variant.csv"
    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 $KT --case "$op" --only "$variant" \
        >"$csv" 2>"$OUT/ncu-$op-$variant.err"
    python3 $KT --case "$op" --only "$variant" --summarize "$csv" | sed "s/^/$op /"
    if [ -n "${SECTIONS:-}" ]; then
        ncu --clock-control none -k regex:"_state_kernel|_output_kernel|_carried_output_kernel" -s 3 -c 3 \
            --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
            python3 $KT --case "$op" --only "$variant" --calls 1 >"$OUT/ncu-sections-$op-$variant.txt" 2>&1
        grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Eligible Warps|Grid Size" \
            "$OUT/ncu-sections-$op-$variant.txt"
    fi
done
