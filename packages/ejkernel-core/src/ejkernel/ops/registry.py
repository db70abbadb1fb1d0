"""Invocation recording and batch autotuning of what was recorded.

With ``EJKERNEL_OPS_RECORD=1`` every executor call is recorded (abstractly: shapes, dtypes and static
arguments; no array is kept alive); :func:`record_invocation` records by hand. :func:`autotune_recorded`
then tunes each distinct call once and stores the winners in the executor's caches, which is how a
model is tuned offline: run it once with recording on, then tune everything it called.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ejkernel.ops.utils.env import env_flag

if TYPE_CHECKING:
    from ejkernel.ops.core.kernel import Invocation, Kernel
    from ejkernel.ops.execution.executor import Executor

__all__ = ["RECORD_ENV", "autotune_recorded", "clear_invocations", "get_invocations", "record_invocation"]

RECORD_ENV = "EJKERNEL_OPS_RECORD"
_recorded: dict[str, Invocation] = {}
_lock = threading.Lock()


def recording_enabled() -> bool:
    """True when ``EJKERNEL_OPS_RECORD`` is set to a true value."""
    return env_flag(RECORD_ENV)


def record_invocation(kernel: Kernel, inv: Invocation) -> None:
    """Remember ``inv`` (once per cache key) for :func:`autotune_recorded`."""
    from ejkernel.ops.core.kernel import Invocation

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


def get_invocations(kernel: Kernel | str | None = None) -> list[Invocation]:
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


def autotune_recorded(invocations: Iterable[Any] | None = None, *, executor: Executor | None = None) -> dict[str, Any]:
    """Autotune each invocation (default: every recorded one) and store the winners in ``executor``'s caches.

    Items may be :class:`Invocation`s or HLO labels (``OpLabel``) of hash stamps made in this process.
    Autotuning happens even when the policy says heuristics (this is an explicit request); the policy's
    candidate and time budgets still apply. Returns ``{cache key: config}`` of what was stored; kernels
    without a config space are skipped.
    """
    from ejkernel.ops.config.selection import ConfigSelectorChain, effective_policy
    from ejkernel.ops.core.kernel import Invocation
    from ejkernel.ops.execution.executor import get_default_executor
    from ejkernel.ops.utils.labels import OpLabel

    executor = executor if executor is not None else get_default_executor()
    chain = executor.chooser
    if not isinstance(chain, ConfigSelectorChain):
        raise TypeError(f"autotune_recorded needs an executor whose chooser is a ConfigSelectorChain, got {chain!r}")
    items = get_invocations() if invocations is None else list(invocations)
    results: dict[str, Any] = {}
    for item in items:
        inv = item.invocation if isinstance(item, OpLabel) else item
        if inv is None:
            continue  # a label from another process or a json stamp: no shapes to tune with
        if not isinstance(inv, Invocation):
            raise TypeError(f"autotune_recorded expects Invocations or OpLabels, got {type(item).__name__}")
        candidates = list(inv.kernel.config_space(inv))
        if not candidates:
            continue
        policy = effective_policy(chain.policy)
        result = chain.tuner.tune(inv, candidates, heuristic=chain.heuristic(inv), policy=policy)
        if result.best is not None:
            chain.store(inv, result.best, persist=policy.persist)
            results[inv.cache_key] = result.best
    return results
