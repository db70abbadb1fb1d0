"""How much `import ejkernel` (with every installed backend plugin discovered) costs over `import jax`.

Each run is a fresh interpreter that imports jax, then ejkernel, timing each step in-process (so the
machine's load between processes does not leak into the difference). Reports medians over the runs.
Usage: .venv/bin/python benchmarks/import_time.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = """
import json, time
start = time.perf_counter()
import jax
middle = time.perf_counter()
import ejkernel
backends = ejkernel.plugins.backends()
end = time.perf_counter()
print(json.dumps({"jax": middle - start, "ejkernel": end - middle, "backends": sorted(backends)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    runs = []
    for _ in range(args.runs + 1):  # the first run warms the file cache and is dropped
        output = subprocess.run([sys.executable, "-c", PROBE], check=True, env=env, capture_output=True, text=True)
        runs.append(json.loads(output.stdout))
    runs = runs[1:]
    jax_ms = statistics.median(r["jax"] for r in runs) * 1000
    ejkernel_ms = statistics.median(r["ejkernel"] for r in runs) * 1000
    print(f"backends discovered: {', '.join(runs[0]['backends'])}")
    print(f"import jax:                        {jax_ms:8.1f} ms (median of {len(runs)})")
    print(f"import ejkernel after jax:         {ejkernel_ms:8.1f} ms (budget 300 ms)")


if __name__ == "__main__":
    main()
