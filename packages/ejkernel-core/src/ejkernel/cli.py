"""The ``ejkernel`` command: what is installed, what runs here, and the config cache.

    ejkernel list-backends [--json] [--check] [--verbose]  one row per discovered backend plugin
    ejkernel list-kernels [--json] [--markdown]            the live support matrix (algorithm x platform)
    ejkernel cache {path,list,clear,export,import} ...     the persistent config cache

``cache``: ``path`` (where the cache file is), ``list`` (entries), ``clear`` (remove entries), ``export``
(write entries to a file, e.g. to ship a tuned cache to a cluster; ``--shipped`` writes the ``{kernel:
{device model: {signature: config}}}`` table a backend plugin returns from ``ejkernel_shipped_configs``)
and ``import`` (merge an exported file into the cache); ``--path`` on ``cache`` picks another cache.
Also runs as ``python -m ejkernel.cli``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ejkernel.kernels._registry import Platform, kernel_registry
from ejkernel.plugins import backends

__all__ = ["PLATFORM_ORDER", "build_parser", "main", "register_cache_cli", "split_key", "support_matrix"]

PLATFORM_ORDER = [p.value for p in (Platform.XLA, Platform.TRITON, Platform.PALLAS, Platform.CUDA, Platform.CUTE)]
"""Column order of the support matrix (platforms that plugins declare come after these, by name)."""


def _terminal_width() -> int:
    """The terminal's width (``$COLUMNS`` first; 80 when not a terminal), never under 40."""
    return max(40, shutil.get_terminal_size(fallback=(80, 24)).columns)


def _table(headers: list[str], rows: list[list[str]], width: int | None = None, wrap: Sequence[int] = ()) -> str:
    """Columns separated by two spaces. With ``width``, cells wrap onto more lines until the table fits:
    first those of the ``wrap`` columns (indices), widest first, then, if still too wide, any column's;
    a column never gets narrower than its header (or 8)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    floors = [max(len(header), 8) for header in headers]
    excess = 0 if width is None else sum(widths) + 2 * (len(widths) - 1) - width
    for columns in (list(wrap), range(len(widths))):
        while excess > 0:
            narrowable = [i for i in columns if widths[i] > floors[i]]
            if not narrowable:
                break
            widths[max(narrowable, key=widths.__getitem__)] -= 1
            excess -= 1
    lines = []
    for number, row in enumerate([headers, *rows]):
        cells = [textwrap.wrap(str(cell), w) or [""] for cell, w in zip(row, widths)]
        for part in range(max(map(len, cells))):
            parts = [cell[part] if part < len(cell) else "" for cell in cells]
            lines.append("  ".join(text.ljust(w) for text, w in zip(parts, widths)).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- list-backends -----------------------------------------------------------------------------------


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=\.)\s+", text, maxsplit=1)[0]


def _backend_notes(records: list[dict], width: int, verbose: bool) -> list[str]:
    """One wrapped ``name: status`` paragraph per backend that is not ok (unavailable: first sentence), and
    one ``name: part: status`` paragraph per part a backend declares (``BackendInfo.check_parts``)."""
    notes, shortened = [], False
    for record in records:
        statuses = [] if record["status"] == "ok" else [(f"{record['name']}: ", record["status"])]
        statuses += [(f"{record['name']}: {part}: ", status) for part, status in record.get("parts", {}).items()]
        for label, status in statuses:
            if not verbose and status.startswith("unavailable:"):
                short = _first_sentence(status)
                shortened = shortened or short != status
                status = short
            notes.append(textwrap.fill(status, width, initial_indent=label, subsequent_indent="  ",
                                       break_on_hyphens=False))
    if shortened:
        notes.append("(ejkernel list-backends --verbose prints the whole reasons)")
    return notes


def list_backends(args: argparse.Namespace) -> int:
    found = backends()
    records = [backend.as_dict() for backend in sorted(found.values(), key=lambda b: b.name)]
    if args.json:
        print(json.dumps(records, indent=2))
    elif not records:
        print("No ejkernel backend plugins are installed (try: pip install ejkernel-xla).")
    else:
        width = _terminal_width()
        rows = [
            [
                r["name"],
                f"{r['distribution'] or '?'} {r['version'] or ''}".strip(),
                ",".join(r["platforms"]) or "-",
                ",".join(r["targets"]) or "-",
                str(r["implementations"]),
                r["status"].split(":", 1)[0],
            ]
            for r in records
        ]
        headers = ["backend", "distribution", "platforms", "targets", "kernels", "status"]
        print(_table(headers, rows, width, wrap=(1, 3, 2)))  # names, counts and statuses stay whole
        notes = _backend_notes(records, width, args.verbose)
        if notes:
            print()
            print("\n".join(notes))
    broken = [r for r in records if r["status"].startswith("error")]
    if args.check and broken:
        names = ", ".join(r["name"] for r in broken)
        print(f"ejkernel: broken backend plugin(s): {names}", file=sys.stderr)
        return 1
    return 0


# ---- list-kernels ------------------------------------------------------------------------------------


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
    if not matrix:
        print("No kernels are registered (is any backend plugin installed? see: ejkernel list-backends).")
        return 0
    present = {platform for row in matrix.values() for platform in row}
    platforms = [p for p in PLATFORM_ORDER if p in present] + sorted(present - set(PLATFORM_ORDER))

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
        print(_table(headers, rows, _terminal_width(), wrap=range(1, len(headers))))
    return 0


# ---- cache -------------------------------------------------------------------------------------------

_FINGERPRINT_PARTS = 6


def split_key(key: str) -> dict[str, str]:
    """The parts of a cache key: kernel, version, device fields and the call signature."""
    parts = key.split("|", 1 + _FINGERPRINT_PARTS)
    if len(parts) != 2 + _FINGERPRINT_PARTS:
        return {"kernel": key.split("|", 1)[0], "signature": ""}
    kernel, _, version = parts[0].rpartition("@")
    fields = dict(part.split("=", 1) for part in parts[1:-1] if "=" in part)
    return {"kernel": kernel or parts[0], "version": version, **fields, "signature": parts[-1]}


def _cache(args: argparse.Namespace):
    from ejkernel.ops.config.persistent import PersistentCache  # the execution framework, loaded when used

    return PersistentCache(args.path)


def _selected(entries: dict[str, dict], kernel: str | None) -> dict[str, dict]:
    if kernel is None:
        return entries
    return {key: entry for key, entry in entries.items() if split_key(key)["kernel"] == kernel}


def _cmd_path(args: argparse.Namespace) -> int:
    cache = _cache(args)
    print(cache.path)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    entries = _selected(_cache(args).entries(), args.kernel)
    if args.json:
        print(json.dumps(entries, indent=1, sort_keys=True))
        return 0
    if not entries:
        print("(no entries)")
        return 0
    for key in sorted(entries):
        parts, entry = split_key(key), entries[key]
        config = json.dumps(entry.get("config"), sort_keys=True)
        print(f"{parts['kernel']} v{parts.get('version', '?')} on {parts.get('model', '?')}: {parts['signature']}")
        print(f"    config {config}  (saved {entry.get('saved', '?')})")
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    cache = _cache(args)
    doomed = list(_selected(cache.entries(), args.kernel))
    if args.kernel is None:
        cache.clear()
    else:
        for key in doomed:
            cache.delete(key)
    print(f"removed {len(doomed)} entr{'y' if len(doomed) == 1 else 'ies'} from {cache.path}")
    return 0


def shipped_table(entries: dict[str, dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{kernel: {device model: {signature: typed config}}}`` from stored entries."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for key, entry in sorted(entries.items()):
        parts = split_key(key)
        model = parts.get("model")
        if model is None:
            continue
        table.setdefault(parts["kernel"], {}).setdefault(model, {})[parts["signature"]] = entry["config"]
    return table


def _cmd_export(args: argparse.Namespace) -> int:
    from ejkernel.ops.config.persistent import SCHEMA_VERSION

    entries = _selected(_cache(args).entries(), args.kernel)
    if args.shipped:
        document: dict[str, Any] = {"schema": SCHEMA_VERSION, "shipped": shipped_table(entries)}
    else:
        document = {"schema": SCHEMA_VERSION, "entries": entries}
    text = json.dumps(document, indent=1, sort_keys=True)
    if args.destination == "-":
        print(text)
    else:
        destination = Path(args.destination).expanduser()
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text + "\n", encoding="utf-8")
        print(f"exported {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} to {destination}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from ejkernel.ops.config.persistent import SCHEMA_VERSION

    source = Path(args.source).expanduser()
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    entries = document.get("entries") if isinstance(document, dict) else None
    if not isinstance(entries, dict) or document.get("schema") != SCHEMA_VERSION:
        print(f"error: {source} is not an exported ejkernel config cache (schema {SCHEMA_VERSION})", file=sys.stderr)
        return 2
    valid = {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, dict) and "config" in v}
    cache = _cache(args)
    added = cache.update_entries(valid, overwrite=not args.keep_existing)
    skipped = len(entries) - len(valid)
    note = f" ({skipped} malformed skipped)" if skipped else ""
    print(f"imported {added} entr{'y' if added == 1 else 'ies'} into {cache.path}{note}")
    return 0


def register_cache_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cache`` command (path/list/clear/export/import) to an argparse sub-parsers object.

    Each leaf sets ``handler`` (``handler(args) -> exit status``) in its defaults.
    """
    cache = subparsers.add_parser(
        "cache",
        help="inspect, clear, export and import the persistent config cache",
        description=(
            "Inspect and move the persistent config cache: path, list, clear, export (e.g. to ship a tuned "
            "cache to a cluster, or --shipped for a backend plugin) and import."
        ),
    )
    cache.add_argument(
        "--path", default=None, help="cache directory or .json file (default: $EJKERNEL_CACHE_DIR, XDG cache dir)"
    )
    cache.set_defaults(handler=lambda args: (cache.print_help(), 2)[1])
    commands = cache.add_subparsers(dest="cache_command", metavar="COMMAND")

    path = commands.add_parser("path", help="print the cache file's path", description="Print the cache file's path.")
    path.set_defaults(handler=_cmd_path)

    listing = commands.add_parser("list", help="list cached configs", description="List cached configs.")
    listing.add_argument("--kernel", help="only this kernel's entries")
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    listing.set_defaults(handler=_cmd_list)

    clear = commands.add_parser("clear", help="remove cached configs", description="Remove cached configs.")
    clear.add_argument("--kernel", help="only this kernel's entries")
    clear.set_defaults(handler=_cmd_clear)

    export = commands.add_parser(
        "export", help="write cached configs to a file", description="Write cached configs to a file ('-': stdout)."
    )
    export.add_argument("destination", help="output file, or - for stdout")
    export.add_argument("--kernel", help="only this kernel's entries")
    export.add_argument(
        "--shipped",
        action="store_true",
        help="write a {kernel: {device model: {signature: config}}} table for a backend plugin to ship",
    )
    export.set_defaults(handler=_cmd_export)

    importing = commands.add_parser(
        "import", help="merge an exported file into the cache", description="Merge an exported file into the cache."
    )
    importing.add_argument("source", help="a file written by 'ejkernel cache export'")
    importing.add_argument("--keep-existing", action="store_true", help="do not overwrite entries already present")
    importing.set_defaults(handler=_cmd_import)
    return cache


# ---- the command -------------------------------------------------------------------------------------


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
    backends_parser.add_argument(
        "--verbose", "-v", action="store_true", help="print the whole reason a backend cannot run, not its first sentence"
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

    register_cache_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
