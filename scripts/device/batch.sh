#!/usr/bin/env bash
# Several device scripts in ONE device call (a machine start costs minutes of the session's device time),
# ON THE DEVICE (through the device tool's `run`, after `bash scripts/device/prepare.sh` here, with
# `carry: [".whl"]`), from the repo root:
#
#   BATCH_LIMIT_S=150 bash scripts/device/batch.sh linear serving xla_flash
#
# Runs scripts/device/<topic>.sh for each topic in turn, each under `timeout ${BATCH_LIMIT_S}` (default 150 s),
# with $OUT shared (each script writes under $OUT/<topic>/) and its output in $OUT/<topic>.log. A topic that
# fails or runs out of time does not stop the next. Prints one line per topic at the end; exit status 1 if
# any topic failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/batch.sh "$@"
fi

OUT=${OUT:-/tmp/out}
LIMIT=${BATCH_LIMIT_S:-150}
mkdir -p "$OUT"
summary=()
failed=0
for topic in "$@"; do
    script=scripts/device/$topic.sh
    if [ ! -f "$script" ]; then
        summary+=("$topic: no $script")
        failed=1
        continue
    fi
    start=$(date +%s)
    timeout --kill-after=10 "$LIMIT" bash "$script" >"$OUT/$topic.log" 2>&1
    status=$?
    took=$(($(date +%s) - start))
    summary+=("$topic: exit $status in ${took} s")
    [ "$status" -eq 0 ] || failed=1
    tail -n 25 "$OUT/$topic.log"
done
echo "== batch summary =="
printf '%s\n' "${summary[@]}"
exit "$failed"
