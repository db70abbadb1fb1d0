#!/usr/bin/env bash
# lightning_attention and recurrent_attention (scalar gates) against fla's chunk kernels, and varlen batches
# of the linear operations (issue #12's remaining targets). ON THE DEVICE, from the repo root, after
# `EXTRA_WHEELS="fla-core==0.6.0 einops==0.8.1" bash scripts/device/prepare.sh` here (carry: [".whl"]):
#
#   bash scripts/device/linear_peers.sh tests lightning   # GPU linear tests; lightning at T = 4k, 1k, 16k
#   bash scripts/device/linear_peers.sh recurrent varlen  # scalar-gate recurrent; 8 packed sequences (3 ops)
#   CONFIGS="state_num_stages=3,num_warps=4" bash scripts/device/linear_peers.sh lightning  # + configs at 16k
#   CONFIGS="carried_varlen=1" bash scripts/device/linear_peers.sh varlen   # + configs on the same packed batch
#   VARLEN=2 CONFIGS="carried_varlen=1" bash scripts/device/linear_peers.sh varlen   # 2 long packed sequences
#
# fla autotunes on its first call of each kernel (~150 s): TRITON_CACHE_AUTOTUNING keeps the results in
# .fla_autotune/ (git-ignored; a warm device keeps it between calls). Writes each part's log and the
# benchmark JSON/PNG under $OUT and prints the tables.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/linear_peers.sh "$@"
fi
OUT=${OUT:-/tmp/out}
export FLA_TRITON_CACHE_DIR=$PWD/.fla_autotune TRITON_CACHE_AUTOTUNING=1
export XDG_CACHE_HOME=/tmp/xdg-cache TRITON_HOME=/tmp/triton-home
mkdir -p "$FLA_TRITON_CACHE_DIR" "$XDG_CACHE_HOME" "$TRITON_HOME"
bench() { timeout "$1" python3 benchmarks/linear_attention.py --out "$OUT" --xla-seqs "" --reps 5 --calls 5 "${@:2}"; }
configs=()
[ -n "${CONFIGS:-}" ] && configs=(--configs "$CONFIGS" --config-seq 16384)
for part in "$@"; do
    case $part in
        tests)
            XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 timeout 150 python3 -m pytest -m gpu -n 8 -q -rfEs -p no:cacheprovider \
                packages/ejkernel-triton/tests/test_linear_attention_gpu.py >"$OUT/tests.log" 2>&1
            tail -3 "$OUT/tests.log" ;;
        lightning|recurrent|gla)
            bench 280 --op "$part" --seqs 4096,1024,16384 "${configs[@]}" >"$OUT/$part.log" 2>&1
            grep -E "^\| |errors vs" "$OUT/$part.log" | sed "s/^/$part: /" ;;
        varlen)
            varlen_configs=()
            [ -n "${CONFIGS:-}" ] && varlen_configs=(--configs "$CONFIGS" --config-seq 4096)
            for op in gla recurrent lightning; do
                bench 150 --op $op --varlen "${VARLEN:-8}" --seqs 4096 --no-numerics "${varlen_configs[@]}" \
                    >"$OUT/varlen-$op.log" 2>&1
                grep -E "^\|.*\| 4096 \||^\| 4096" "$OUT/varlen-$op.log" | sed "s/^/$op varlen: /"
            done ;;
        *) echo "unknown part $part" >&2 ;;
    esac
done
