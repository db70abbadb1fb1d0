"""Cheap reads of ejkernel's environment variables on the per-call path.

``os.environ.get`` encodes the name and raises (and catches) a KeyError for an unset variable, which
costs about a microsecond; the executor reads several variables on every call. On POSIX, CPython keeps
the bytes environment in ``os.environ._data`` (updated by every ``os.environ`` assignment, including
pytest's monkeypatch), so a plain dict lookup there sees the same values at a fraction of the cost.
"""

from __future__ import annotations

import os

__all__ = ["env_flag", "env_get"]

_data = getattr(os.environ, "_data", None)
_fast = os.name == "posix" and isinstance(_data, dict)
_encoded: dict[str, bytes] = {}


def env_get(name: str) -> str | None:
    """``os.environ.get(name)``, fast."""
    if not _fast:
        return os.environ.get(name)
    key = _encoded.get(name)
    if key is None:
        key = _encoded[name] = os.fsencode(name)
    value = _data.get(key)
    return None if value is None else os.fsdecode(value)


def env_flag(name: str) -> bool:
    """True when the variable is set to anything but empty, ``0``, ``false`` or ``no``."""
    value = env_get(name)
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")
