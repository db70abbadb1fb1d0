#!/usr/bin/env bash
# XLA flash attention against jax.nn (xla, cudnn) on the GPU, issue #14's speed target, ON THE DEVICE
# (through the device tool's `run`, after `bash scripts/device/prepare.sh` here, with `carry: [".whl"]`),
# from the repo root; ~130 s on one H100 (2026-11-23, 20:49 UTC), compile included:
#
#   bash scripts/device/xla_flash.sh                 # alone
#   bash scripts/device/batch.sh xla_flash ...       # with other topics
#
# bf16, D=128, 16 heads, batch*S = 16384, S = 2048, 8192, 16384. Two parts, each under its own timeout (one
# failing or running out of time does not stop the next; every measurement is saved as it is taken):
#   1. speed, one process, per S: causal (then not), forward and forward+backward, for
#      ejkernel-xla               the default config (the rule: dense at these S; calls in query chunks,
#                                 ejkernel_xla._dense.query_chunk_count: causal ones over the keys each
#                                 chunk sees, others above 8192 queries in rows of 8192),
#      ejkernel-xla[dense:one-call]  forward only: the dense path as one call (no query chunks),
#      ejkernel-xla[dense:selects+chunks]  the chunks with the old empty-row guard (causal only; on the
#                                 H200 the old guard's unfused softmax beat XLA's fused masked one),
#      xla, cudnn                 jax.nn.dot_product_attention's implementations.
#      XLA_FLASH_IMPLS=... adds the variants measured in the H200 batch 1 run (2026-11-23 18:35,
#      benchmarks/results/logs/nvidia-h200-2026-11-23-batch1-xla_flash.log): ejkernel-xla[dense:selects]
#      (last session's forward: one call, old guard; causal fwd only);
#   2. memory: compiled temp bytes of the default config's forward+backward at S=32k and 64k (B=1, causal;
#      the blockwise path there, O(S)) and one S=64k forward+backward run (device peak bytes).
# Writes under $OUT/xla_flash/: <device>-<date>-xla-flash-{speed,memory}.json (benchmarks/xla_flash.py's
# documents: rows with first_call_s = compile + one run, `ratios` = ejkernel TFLOP/s / xla TFLOP/s per
# case; numerics are the conformance suite's job, scripts/device/gpu_tests.sh), ratios.json
# (every ejkernel row's ratio to xla and to cudnn; target_met: ejkernel-xla >= 1.0 x xla wherever xla
# ran), speed.log, memory.log; prints the ratio table and a summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ -z "${EJKERNEL_DEVICE_READY:-}" ]; then
    exec bash scripts/device/run.sh bash scripts/device/xla_flash.sh "$@"
fi

OUT=${OUT:-/tmp/out}
DIR=$OUT/xla_flash
mkdir -p "$DIR"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the memory part reads the device's peak; the rule reads bytes_limit

SEQS=2048,8192,16384 TOKENS=16384 HEADS=16 MEMORY_SEQS=32768,65536
if [ -n "${XLA_FLASH_SMOKE:-}" ]; then
    # a check of the script itself on a CPU (JAX_PLATFORMS=cpu XLA_FLASH_SMOKE=1 EJKERNEL_DEVICE_READY=1 ...)
    SEQS=128,256 TOKENS=256 HEADS=2 MEMORY_SEQS=512,1024
else
    unset JAX_PLATFORMS  # JAX picks the GPU
fi
COMMON=(--seqs "$SEQS" --causal yes,no --tokens "$TOKENS" --heads "$HEADS" --head-dim 128 --dtype bfloat16
        --warmup 1 --reps 3 --calls 2 --sets 2 --memory-seqs "" --out "$DIR")
status=0

echo "== 1/2 speed: forward, then forward+backward, per S (causal first) =="
# one process: XLA's autotuning results carry over between the programs that share GEMM shapes
timeout --kill-after=5 "${XLA_FLASH_SPEED_S:-200}" python3 benchmarks/xla_flash.py "${COMMON[@]}" --modes fwd,fwd+bwd \
    --tag speed --impls "${XLA_FLASH_IMPLS:-ejkernel-xla,ejkernel-xla[dense:one-call],ejkernel-xla[dense:selects+chunks],xla,cudnn}" \
    --causal-only-impls "ejkernel-xla[dense:selects+chunks],ejkernel-xla[dense:selects]" \
    --fwd-only-impls "ejkernel-xla[dense:one-call],ejkernel-xla[dense:selects]" --errors "" 2>&1 | tee "$DIR/speed.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2/2 memory at S=32k, 64k (B=1, causal, default config) =="
timeout --kill-after=5 "${XLA_FLASH_MEMORY_S:-38}" python3 benchmarks/xla_flash.py --seqs "" --memory-seqs "$MEMORY_SEQS" \
    --heads "$HEADS" --head-dim 128 --dtype bfloat16 --out "$DIR" --tag memory 2>&1 | tee "$DIR/memory.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== summary =="
python3 - "$DIR" <<'EOF' || status=1
import glob, json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows, docs = [], {}
for path in sorted(glob.glob(str(out / "*-xla-flash-*.json"))):
    doc = json.load(open(path))
    docs[Path(path).name] = doc
    rows += doc.get("results", [])
ratios = []
cells = {}
for r in rows:
    cells.setdefault((r["mode"], r["causal"], r["seq"]), {})[r["impl"]] = r
for (mode, causal, seq), cell in sorted(cells.items(), key=lambda kv: (kv[0][0] != "fwd", not kv[0][1], kv[0][2])):
    for name, r in cell.items():
        if not name.startswith("ejkernel") or not r.get("tflops"):
            continue
        entry = dict(mode=mode, causal=causal, seq=seq, impl=name, path=r.get("path"), tflops=r["tflops"],
                     first_call_s=r.get("first_call_s"), xla_first_call_s=cell.get("xla", {}).get("first_call_s"))
        for against in ("xla", "cudnn"):
            base = cell.get(against, {})
            entry[f"vs_{against}"] = r["tflops"] / base["tflops"] if base.get("tflops") else None
            if against == "xla" and "error" in base:
                entry["xla_error"] = base["error"][:120]
        ratios.append(entry)
device = next((d["device"] for d in docs.values()), "?")
target = [e for e in ratios if e["impl"] == "ejkernel-xla" and e["vs_xla"] is not None]
summary = dict(device=device, files=sorted(docs), ratios=ratios,
               target_met=bool(target) and all(e["vs_xla"] >= 1.0 for e in target),
               worst_vs_xla=min((e["vs_xla"] for e in target), default=None))
memory = next((d["memory"] for d in docs.values() if d.get("memory")), None)
summary["memory"] = memory
(out / "ratios.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"device: {device}")
print("| mode | causal | S | impl | path | TFLOP/s | / xla | / cudnn | first call s (xla's) |")
print("|---|---|---|---|---|---|---|---|---|")
for e in ratios:
    fmt = lambda x, f=".2f": "—" if x is None else format(x, f)
    print(f"| {e['mode']} | {'yes' if e['causal'] else 'no'} | {e['seq']} | {e['impl']} | {e['path']} | "
          f"{e['tflops']:.0f} | {fmt(e['vs_xla'])} | {fmt(e['vs_cudnn'])} | {fmt(e['first_call_s'], '.1f')} "
          f"({fmt(e['xla_first_call_s'], '.1f')}) |" + (f" xla: {e['xla_error']}" if "xla_error" in e else ""))
print(f"target (ejkernel-xla >= 1.0 x xla wherever xla ran): {'MET' if summary['target_met'] else 'NOT MET'}; "
      f"worst {summary['worst_vs_xla']}")
if memory and "compiled" in memory:
    for m in memory["compiled"]:
        print(f"memory S={m['seq']}: path {m['path']}, temp {m['temp_bytes'] / 2**30:.3f} GiB")
    run = memory.get("run", {})
    peak = run.get("peak_bytes_in_use")
    print(f"memory run S={run.get('seq')}: peak {'?' if peak is None else f'{peak / 2**30:.2f} GiB'}, finite {run.get('finite')}")
elif memory:
    print("memory:", memory)
EOF
echo "wrote $DIR"
exit "$status"
