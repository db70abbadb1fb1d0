"""The ``ejkernel`` command: what is installed, what runs here, and the config cache.

    ejkernel list-backends [--json] [--check]   one row per discovered backend plugin
    ejkernel list-kernels [--json] [--markdown]  the live support matrix (algorithm x platform)
    ejkernel cache ...                           the persistent config cache (see ``ejkernel cache --help``)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ejkernel.kernels._registry import Platform, kernel_registry
from ejkernel.plugins import backends

PLATFORM_ORDER = [p.value for p in (Platform.XLA, Platform.TRITON, Platform.PALLAS, Platform.CUDA, Platform.CUTE)]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def list_backends(args: argparse.Namespace) -> int:
    found = backends()
    records = [backend.as_dict() for backend in sorted(found.values(), key=lambda b: b.name)]
    if args.json:
        print(json.dumps(records, indent=2))
    elif not records:
        print("No ejkernel backend plugins are installed (try: pip install ejkernel-xla).")
    else:
        rows = [
            [
                r["name"],
                f"{r['distribution'] or '?'} {r['version'] or ''}".strip(),
                ",".join(r["platforms"]) or "-",
                ",".join(r["targets"]) or "-",
                str(r["implementations"]),
                r["status"],
            ]
            for r in records
        ]
        print(_table(["backend", "distribution", "platforms", "targets", "kernels", "status"], rows))
    broken = [r for r in records if r["status"].startswith("error")]
    if args.check and broken:
        names = ", ".join(r["name"] for r in broken)
        print(f"ejkernel: broken backend plugin(s): {names}", file=sys.stderr)
        return 1
    return 0


def support_matrix() -> dict[str, dict[str, list[dict]]]:
    """``{algorithm: {platform: [{"backend", "priority", "plugin"}, ...]}}`` from the live registry."""
    matrix: dict[str, dict[str, list[dict]]] = {}
    for algorithm in kernel_registry.list_algorithms():
        row = matrix.setdefault(algorithm, {})
        for spec in kernel_registry.list_implementations(algorithm):
            row.setdefault(spec.platform.value, []).append(
                {"backend": spec.backend.value, "priority": spec.priority, "plugin": spec.plugin}
            )
    return matrix


def list_kernels(args: argparse.Namespace) -> int:
    matrix = support_matrix()
    if args.json:
        print(json.dumps(matrix, indent=2, sort_keys=True))
        return 0
    platforms = [p for p in PLATFORM_ORDER if any(p in row for row in matrix.values())]
    if not matrix:
        print("No kernels are registered (is any backend plugin installed? see: ejkernel list-backends).")
        return 0

    def cell(entries: list[dict] | None) -> str:
        if not entries:
            return "-"
        return ", ".join(f"{e['backend']} (p{e['priority']})" for e in entries)

    rows = [[algorithm] + [cell(row.get(p)) for p in platforms] for algorithm, row in sorted(matrix.items())]
    headers = ["algorithm", *platforms]
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print(_table(headers, rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ejkernel", description="ejkernel: installed backends, the kernel support matrix and the config cache."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    backends_parser = sub.add_parser(
        "list-backends",
        help="one row per backend plugin: distribution, platforms, targets, status, kernel count",
        description="List every discovered backend plugin and whether it can run on this machine.",
    )
    backends_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends_parser.add_argument(
        "--check", action="store_true", help="exit with status 1 if any installed backend plugin is broken"
    )
    backends_parser.set_defaults(handler=list_backends)

    kernels_parser = sub.add_parser(
        "list-kernels",
        help="the live support matrix: algorithm x platform, with backends and priorities",
        description="Print the support matrix read from the kernel registry.",
    )
    output = kernels_parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--markdown", action="store_true", help="print a Markdown table (used for the README)")
    kernels_parser.set_defaults(handler=list_kernels)

    try:
        from ejkernel.ops.cli import register_cache_cli
    except ImportError:  # the execution framework's CLI is optional for this command
        register_cache_cli = None
    if register_cache_cli is not None:
        register_cache_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
