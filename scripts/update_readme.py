"""Regenerates the README's support matrix from the live kernel registry (`ejkernel list-kernels`).

Usage: .venv/bin/python scripts/update_readme.py [--check]   (--check: exit 1 if the README is stale)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ejkernel.cli import PLATFORM_ORDER, support_matrix

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
HARDWARE = {"any": "CPU/GPU/TPU", "gpu": "GPU", "tpu": "TPU", "cpu": "CPU"}


def render() -> str:
    matrix = support_matrix()
    platforms = [p for p in PLATFORM_ORDER if any(p in row for row in matrix.values())]
    lines = ["| operation | " + " | ".join(platforms) + " |", "|---|" + "---|" * len(platforms)]
    for algorithm, row in sorted(matrix.items()):
        cells = []
        for platform in platforms:
            entries = row.get(platform, [])
            targets = sorted({HARDWARE[e["backend"]] for e in entries})
            cells.append(("✅ " + ", ".join(targets)) if entries else "—")
        lines.append(f"| `{algorithm}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the README is current")
    args = parser.parse_args()
    text = README.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    updated = f"{before}{START}\n{render()}\n{END}{after}"
    if args.check:
        if updated != text:
            print("README.md's support matrix is stale: run scripts/update_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
