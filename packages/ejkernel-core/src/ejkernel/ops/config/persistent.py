"""On-disk config cache shared by processes and sessions.

One readable JSON file::

    {"schema": 1, "entries": {"<cache key>": {"kernel": "...", "config": <typed JSON>, "saved": "..."}}}

Default location: ``$EJKERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ejkernel``, else ``~/.cache/ejkernel``
(file ``configs.json``); nothing is created until the first write. Every write takes an exclusive lock
(a ``.lock`` file beside it), re-reads the file, merges, and replaces it atomically, so processes writing
different keys at the same time lose nothing and a reader never sees half a file. A corrupt or truncated
file gives one :class:`CacheWarning`, is renamed aside (``configs.json.corrupt-<time>-<pid>``) and is
rewritten by the next write; the cache never raises into the user's program for I/O or decoding trouble.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ejkernel.ops.config.cache import as_key
from ejkernel.ops.utils.serialize import from_jsonable, to_jsonable

__all__ = ["SCHEMA_VERSION", "CacheWarning", "PersistentCache", "default_cache_dir", "default_cache_file"]

SCHEMA_VERSION = 1
FILENAME = "configs.json"


class CacheWarning(UserWarning):
    """The persistent config cache could not be read or written; ejkernel carried on without it."""


def default_cache_dir() -> Path:
    """``$EJKERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ejkernel``, else ``~/.cache/ejkernel`` (not created)."""
    explicit = os.environ.get("EJKERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ejkernel"


def default_cache_file() -> Path:
    return default_cache_dir() / FILENAME


def _resolve_file(path: str | os.PathLike | None) -> Path:
    if path is None:
        return default_cache_file()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"PersistentCache path must be a str or path, got {type(path).__name__}")
    resolved = Path(path).expanduser()
    # A ``.json`` path names the file itself; anything else is a directory holding configs.json.
    return resolved if resolved.suffix == ".json" else resolved / FILENAME


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; atomic replace still keeps the file whole
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class PersistentCache:
    """Disk-backed ``{cache key: config}`` with the :class:`ConfigCache` interface (``get``/``put``/``in``).

    ``path`` is a directory (the file is ``<path>/configs.json``) or a ``.json`` file; None means the
    default location. Reads are served from memory after the first load; :meth:`reload` picks up what
    other processes wrote since.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = _resolve_file(path)
        self._raw: dict[str, dict] | None = None  # entries as stored (JSON data)
        self._decoded: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self.generation = 0
        """Bumped whenever the entries this object serves may have changed (writes, reloads)."""

    # ---- reading ------------------------------------------------------------------------------
    def _entries(self) -> dict[str, dict]:
        raw = self._raw
        if raw is None:
            with self._lock:
                if self._raw is None:
                    self._raw = self._read_file()
                raw = self._raw
        return raw

    def _read_file(self) -> dict[str, dict]:
        """The file's entries; a corrupt file is warned about once and set aside."""
        try:
            text = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # nothing written yet (a write will report trouble)
            return {}
        except OSError as exc:
            self._warn(f"cannot read config cache {self.path}: {exc}; continuing without it")
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("not an ejkernel config cache (no 'entries' object)")
            if data.get("schema") != SCHEMA_VERSION:
                raise ValueError(f"schema {data.get('schema')!r}, this ejkernel reads schema {SCHEMA_VERSION}")
            return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and "config" in v}
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{os.getpid()}")
            try:
                os.replace(self.path, aside)
                where = f"moved to {aside.name}"
            except OSError:
                where = "left in place"
            self._warn(f"config cache {self.path} is unreadable ({exc}); {where}, it will be rewritten")
            return {}

    def get(self, key: Any, default: Any = None) -> Any:
        """The config stored under ``key``, else ``default``. Undecodable entries count as missing."""
        key = key if type(key) is str else as_key(key)
        cfg = self._decoded.get(key)
        if cfg is not None:
            return cfg
        entry = self._entries().get(key)
        if entry is None:
            return default
        try:
            cfg = from_jsonable(entry["config"])
        except Exception as exc:
            self._warn(f"config cache entry {key!r} in {self.path} cannot be decoded ({exc}); ignoring it")
            return default
        self._decoded[key] = cfg
        return cfg

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._entries())

    def keys(self) -> list[str]:
        return list(self._entries())

    def entries(self) -> dict[str, dict]:
        """The stored entries as JSON data (``{"kernel", "config", "saved"}`` per key)."""
        return dict(self._entries())

    def items(self) -> list[tuple[str, Any]]:
        return [(key, cfg) for key in self.keys() if (cfg := self.get(key)) is not None]

    def reload(self) -> None:
        """Forget what was read; the next lookup re-reads the file (to see other processes' writes)."""
        with self._lock:
            self._raw = None
            self._decoded.clear()
            self.generation += 1

    # ---- writing ------------------------------------------------------------------------------
    def put(self, key: Any, cfg: Any) -> bool:
        """Store ``cfg`` under ``key`` on disk (merged with concurrent writers). False if it could not."""
        if cfg is None:
            raise ValueError("PersistentCache.put: cfg is None (nothing to cache)")
        key = as_key(key)
        try:
            config = to_jsonable(cfg)
        except TypeError as exc:
            self._warn(f"config {cfg!r} cannot be stored in {self.path} ({exc}); keeping it in memory only")
            self._decoded[key] = cfg
            self.generation += 1
            return False
        entry = {
            "kernel": key.split("|", 1)[0],
            "config": config,
            "saved": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        ok = self._update(lambda entries: entries.__setitem__(key, entry))
        with self._lock:
            self._decoded[key] = cfg
            if not ok:  # keep it for this process at least
                self._entries()[key] = entry
        return ok

    def update_entries(self, new: dict[str, dict], *, overwrite: bool = True) -> int:
        """Merge stored-form entries (as from :meth:`entries` or an exported file); returns how many."""
        added = [0]

        def merge(entries: dict[str, dict]) -> None:
            for key, entry in new.items():
                if overwrite or key not in entries:
                    entries[key] = entry
                    added[0] += 1

        self._update(merge)
        with self._lock:
            self._decoded.clear()
        return added[0]

    def delete(self, key: Any) -> bool:
        key = as_key(key)
        present = key in self._entries()
        self._update(lambda entries: entries.pop(key, None))
        with self._lock:
            self._decoded.pop(key, None)
        return present

    def clear(self) -> None:
        """Remove every entry (the file is rewritten empty)."""
        self._update(lambda entries: entries.clear())
        with self._lock:
            self._decoded.clear()

    def _update(self, change) -> bool:
        """Lock, re-read, apply ``change`` to the entries, write atomically. False (warned) on I/O errors."""
        with self._lock:
            self.generation += 1
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with _file_lock(self.path.with_name(self.path.name + ".lock")):
                    entries = self._read_file()
                    change(entries)
                    self._write_atomic(entries)
                self._raw = entries
                return True
            except OSError as exc:
                self._warn(f"cannot write config cache {self.path}: {exc}; keeping configs in memory only")
                return False

    def _write_atomic(self, entries: dict[str, dict]) -> None:
        text = json.dumps({"schema": SCHEMA_VERSION, "entries": entries}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _warn(self, message: str) -> None:
        if message in self._warned:
            return
        self._warned.add(message)
        warnings.warn(message, CacheWarning, stacklevel=4)

    def __repr__(self) -> str:
        return f"PersistentCache({str(self.path)!r})"
