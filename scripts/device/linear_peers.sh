#!/usr/bin/env bash
# lightning_attention and recurrent_attention (scalar gates) against fla's chunk kernels, and varlen batches
# of all three linear operations (issue #12's remaining targets). ON THE DEVICE, from the repo root, after
# `EXTRA_WHEELS="fla-core==0.6.0 einops==0.8.1" bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/linear_peers.sh            # lightning + recurrent at T = 1k, 4k, 16k (~ 8 min)
#   PART=varlen bash scripts/device/linear_peers.sh  # gla, recurrent, lightning over 8 packed sequences
#
# fla autotunes on its first call of each kernel: TRITON_CACHE_AUTOTUNING keeps the results in
# .fla_autotune/ (git-ignored; the device keeps it between calls of one warm machine). Writes the
# benchmark JSON/PNG and a log per operation under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/linear_peers.sh "$@"
fi
OUT=${OUT:-/tmp/out}
export FLA_TRITON_CACHE_DIR=$PWD/.fla_autotune TRITON_CACHE_AUTOTUNING=1
export XDG_CACHE_HOME=/tmp/xdg-cache TRITON_HOME=/tmp/triton-home
mkdir -p "$FLA_TRITON_CACHE_DIR" "$XDG_CACHE_HOME" "$TRITON_HOME"
B="python3 benchmarks/linear_attention.py --out $OUT --xla-seqs '' --reps 5 --calls 5"
if [ "${PART:-}" = varlen ]; then
    for op in gla recurrent lightning; do
        eval timeout 170 $B --op $op --varlen 8 --seqs 4096 --no-numerics >"$OUT/varlen-$op.log" 2>&1
        grep -E "^\| 4096" "$OUT/varlen-$op.log" | sed "s/^/$op varlen: /"
    done
else
    for op in lightning recurrent; do
        eval timeout 260 $B --op $op --seqs 4096,1024,16384 >"$OUT/$op.log" 2>&1
        grep -E "^\| [0-9]+ \||errors vs" "$OUT/$op.log" | sed "s/^/$op: /"
    done
fi
