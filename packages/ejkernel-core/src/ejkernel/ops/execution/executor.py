"""The executor: selects a config for each call and runs the kernel with it; the process-wide default
executor; batch autotuning of recorded calls into an executor's caches.

Under ``jax.jit`` the executor runs at trace time: the config is chosen from abstract shapes and the
traced program contains only the chosen implementation, so selection costs nothing at run time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Generic, Protocol, runtime_checkable

from ejkernel.ops.config.cache import ConfigCache
from ejkernel.ops.config.persistent import PersistentCache
from ejkernel.ops.config.policy import AutotunePolicy, effective_policy
from ejkernel.ops.config.selection import ConfigSelectorChain
from ejkernel.ops.core.invocation import Invocation, call_identity, require_kernel
from ejkernel.ops.core.types import Cfg, Out
from ejkernel.ops.execution.runner import run_with_config
from ejkernel.ops.execution.tuning import Tuner
from ejkernel.ops.recording import get_invocations, record_invocation, recording_enabled
from ejkernel.ops.utils.labels import OpLabel

__all__ = ["ConfigChooser", "Executor", "autotune_recorded", "get_default_executor", "set_default_executor"]


@runtime_checkable
class ConfigChooser(Protocol):
    """Anything that picks a config for an invocation (:class:`ConfigSelectorChain` is one)."""

    def choose(self, inv: Invocation) -> Any: ...


class Executor(Generic[Cfg, Out]):
    """Runs kernels: ``executor(kernel, *args, cfg=None, **kwargs)``.

    Per call: ``kernel.prepare`` (when defined) validates/normalizes the arguments, an :class:`Invocation`
    is built, the config is ``cfg`` when given (used exactly, for this call only, never cached) or the
    chooser's pick, and ``run_<platform>`` (else ``run``) runs with it. An explicit ``platform=`` keyword
    is passed through untouched and picks ``run_<platform>``.
    """

    def __init__(self, chooser: ConfigChooser | None = None):
        if chooser is None:
            chooser = ConfigSelectorChain()
        if not callable(getattr(chooser, "choose", None)):
            raise TypeError(f"Executor needs a chooser with a choose(invocation) method, got {type(chooser).__name__}")
        self.chooser = chooser
        self._keys: dict[tuple, tuple[str, str]] = {}  # call identity -> (signature, cache key)

    def __call__(self, kernel: Any, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        args, kwargs = _prepared(kernel, args, kwargs)
        if cfg is None:
            inv = self._invocation(kernel, args, kwargs)
            cfg = self.chooser.choose(inv)
        else:  # the key is built only if recording or a stamp needs it
            inv = Invocation._of_call(kernel, args, kwargs)
        if recording_enabled():
            record_invocation(kernel, inv)
        return run_with_config(kernel, inv.args, inv.kwargs, cfg, inv=inv)

    def invocation(self, kernel: Any, *args: Any, **kwargs: Any) -> Invocation:
        """The :class:`Invocation` this executor would build for ``kernel(*args, **kwargs)``."""
        args, kwargs = _prepared(kernel, args, kwargs)
        return self._invocation(kernel, args, kwargs)

    def _invocation(self, kernel: Any, args: tuple, kwargs: dict) -> Invocation:
        identity = call_identity(kernel, args, kwargs)
        if identity is None:
            return Invocation._of_call(kernel, args, kwargs)
        try:
            known = self._keys.get(identity)
        except TypeError:  # an unhashable scalar subclass value
            return Invocation._of_call(kernel, args, kwargs)
        inv = Invocation._of_call(kernel, args, kwargs)
        if known is not None:
            inv._signature, inv._key = known
            return inv
        if len(self._keys) < _MAX_MEMOIZED_KEYS:
            self._keys[identity] = (inv.signature, inv.cache_key)
        return inv

    def choose(self, kernel: Any, *args: Any, **kwargs: Any) -> Cfg:
        """The config this executor would use for ``kernel(*args, **kwargs)`` (nothing runs)."""
        return self.chooser.choose(self.invocation(kernel, *args, **kwargs))

    def __repr__(self) -> str:
        return f"Executor({self.chooser!r})"


def _prepared(kernel: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``kernel.prepare(*args, **kwargs)`` when the kernel defines it, else the call as given."""
    kernel_type = type(kernel)
    prepares = _prepares.get(kernel_type)
    if prepares is None:  # once per kernel class
        require_kernel(kernel, "Executor")
        prepares = _prepares[kernel_type] = getattr(kernel_type, "prepare", None) is not None
    if not prepares:
        return args, kwargs
    prepared = kernel.prepare(*args, **kwargs)
    if not (isinstance(prepared, tuple) and len(prepared) == 2):
        raise TypeError(f"{type(kernel).__qualname__}.prepare must return (args, kwargs), got {prepared!r}")
    return tuple(prepared[0]), dict(prepared[1])


_prepares: dict[type, bool] = {}
_MAX_MEMOIZED_KEYS = 4096
_default: Executor | None = None
_default_lock = threading.Lock()


def _build_default() -> Executor:
    # Heuristics unless EJKERNEL_AUTOTUNE_POLICY=autotune: autotuning every new shape inside a user's
    # training loop is slow and surprising. Persisted and shipped configs are used either way; when
    # autotuning is switched on, the per-key budget stays small.
    policy = AutotunePolicy(allow_autotune=False, max_candidates=8, time_budget_s=20.0)
    chain = ConfigSelectorChain(cache=ConfigCache(), persistent=PersistentCache(), policy=policy, tuner=Tuner())
    return Executor(chain)


def get_default_executor() -> Executor:
    """The process-wide executor used by ``Kernel.__call__`` and the public operations (built lazily)."""
    global _default
    executor = _default
    if executor is None:
        with _default_lock:
            if _default is None:
                _default = _build_default()
            executor = _default
    return executor


def set_default_executor(executor: Executor | None) -> Executor | None:
    """Replace the process-wide executor (None: rebuild lazily on next use); returns the previous one."""
    global _default
    if executor is not None and not isinstance(executor, Executor):
        raise TypeError(f"set_default_executor expects an Executor or None, got {type(executor).__name__}")
    with _default_lock:
        previous, _default = _default, executor
    return previous


def autotune_recorded(invocations: Iterable[Any] | None = None, *, executor: Executor | None = None) -> dict[str, Any]:
    """Autotune each invocation (default: every recorded one) and store the winners in ``executor``'s caches.

    Items may be :class:`Invocation`s or HLO labels (``OpLabel``) of hash stamps made in this process.
    Autotuning happens even when the policy says heuristics (this is an explicit request); the policy's
    candidate and time budgets still apply. Returns ``{cache key: config}`` of what was stored; kernels
    without a config space are skipped.
    """
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
