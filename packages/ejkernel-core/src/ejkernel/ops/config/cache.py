"""In-memory config cache and context-local overlays.

Keys are cache-key strings (:attr:`ejkernel.ops.Invocation.cache_key`); an ``Invocation`` is accepted
wherever a key is and stands for its key.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ConfigCache", "active_overlays", "as_key", "overlay_cache"]


def as_key(key: Any) -> str:
    """The cache-key string for ``key`` (a string, or an Invocation standing for its key)."""
    if isinstance(key, str):
        return key
    cache_key = getattr(key, "cache_key", None)
    if isinstance(cache_key, str):
        return cache_key
    raise TypeError(f"cache key must be a string or an Invocation, got {type(key).__name__}")


class ConfigCache:
    """Thread-safe in-memory mapping from cache key to config (the fastest level of selection)."""

    def __init__(self, entries: Mapping[str, Any] | None = None):
        self._entries: dict[str, Any] = {}
        self._lock = threading.Lock()
        for key, cfg in (entries or {}).items():
            self.put(key, cfg)

    def get(self, key: Any, default: Any = None) -> Any:
        """The config stored under ``key``, else ``default`` (None)."""
        return self._entries.get(key if type(key) is str else as_key(key), default)

    def put(self, key: Any, cfg: Any) -> None:
        """Store ``cfg`` under ``key`` (replacing any previous config)."""
        if cfg is None:
            raise ValueError("ConfigCache.put: cfg is None (nothing to cache); use delete() to remove a key")
        with self._lock:
            self._entries[as_key(key)] = cfg

    def delete(self, key: Any) -> bool:
        """Forget ``key``; True if it was present."""
        with self._lock:
            return self._entries.pop(as_key(key), None) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def items(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._entries.items())

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: Any) -> bool:
        return as_key(key) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"ConfigCache({len(self)} entries)"


_overlays: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("ejkernel_ops_overlays", default=())


def active_overlays() -> tuple[Any, ...]:
    """The overlays in force in this context, innermost first."""
    return _overlays.get()


@contextlib.contextmanager
def overlay_cache(cache: ConfigCache | Mapping[str, Any]) -> Iterator[ConfigCache | Mapping[str, Any]]:
    """Within the block (this thread/task only), configs in ``cache`` win over every cache level.

    ``cache`` is a :class:`ConfigCache` or a mapping ``{cache_key: config}``; it is only read, never
    written (selected configs still go to the executor's own caches). Overlays nest; the innermost wins.
    """
    if not (isinstance(cache, ConfigCache) or isinstance(cache, Mapping)):
        raise TypeError(f"overlay_cache expects a ConfigCache or a mapping, got {type(cache).__name__}")
    token = _overlays.set((cache, *_overlays.get()))
    try:
        yield cache
    finally:
        _overlays.reset(token)
