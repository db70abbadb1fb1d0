"""``ejkernel cache``: inspect and move the persistent config cache.

Sub-commands: ``path`` (where the cache file is), ``list`` (entries), ``clear`` (remove entries),
``export`` (write entries to a file, e.g. to ship a tuned cache to a cluster; ``--shipped`` writes the
``{kernel: {device model: {signature: config}}}`` table a backend plugin returns from
``ejkernel_shipped_configs``) and ``import`` (merge an exported file into the cache). ``--path`` on the
``cache`` command picks a cache other than the default one.

Wired into ``ejkernel`` by :func:`register_cache_cli`; also runs standalone:
``python -m ejkernel.ops.cli cache list``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "register_cache_cli"]

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
    from ejkernel.ops.config.persistent import PersistentCache

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


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m ejkernel.ops.cli cache ...``."""
    parser = argparse.ArgumentParser(prog="python -m ejkernel.ops.cli")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_cache_cli(subparsers)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
