"""Invocation recording: the table :func:`ejkernel.ops.autotune_recorded` tunes.

With ``EJKERNEL_OPS_RECORD=1`` every executor call is recorded (abstractly: shapes, dtypes and static
arguments; no array is kept alive); :func:`record_invocation` records by hand. ``autotune_recorded``
(in ``execution/executor.py``) then tunes each distinct call once and stores the winners in the
executor's caches, which is how a model is tuned offline: run it once with recording on, then tune
everything it called.
"""

from __future__ import annotations

import threading
from typing import Any

from ejkernel.ops.core.invocation import Invocation
from ejkernel.ops.utils.env import env_flag

__all__ = ["RECORD_ENV", "clear_invocations", "get_invocations", "record_invocation", "recording_enabled"]

RECORD_ENV = "EJKERNEL_OPS_RECORD"
_recorded: dict[str, Invocation] = {}
_lock = threading.Lock()


def recording_enabled() -> bool:
    """True when ``EJKERNEL_OPS_RECORD`` is set to a true value."""
    return env_flag(RECORD_ENV)


def record_invocation(kernel: Any, inv: Invocation) -> None:
    """Remember ``inv`` (once per cache key) for ``autotune_recorded``."""
    if not isinstance(inv, Invocation):
        raise TypeError(f"record_invocation expects an Invocation, got {type(inv).__name__}")
    if inv.kernel is not kernel:
        raise ValueError(f"record_invocation: the invocation belongs to kernel {inv.kernel.name!r}, not {kernel!r}")
    key = inv.cache_key
    if key in _recorded:
        return
    abstract = inv.abstracted()
    with _lock:
        _recorded.setdefault(key, abstract)


def get_invocations(kernel: Any = None) -> list[Invocation]:
    """Recorded invocations in recording order (only ``kernel``'s, by object or name, when given)."""
    with _lock:
        invocations = list(_recorded.values())
    if kernel is None:
        return invocations
    name = kernel if isinstance(kernel, str) else kernel.name
    return [inv for inv in invocations if inv.kernel.name == name]


def clear_invocations() -> None:
    with _lock:
        _recorded.clear()
