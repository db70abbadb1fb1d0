"""Config selection: the order in which a call's config is found.

Order (first hit wins): explicit ``cfg=`` (handled by the executor; never cached) -> overlays
(:func:`overlay_cache`) -> in-memory :class:`ConfigCache` -> :class:`PersistentCache` -> configs shipped
by a backend plugin for this device kind -> autotuning (when the :class:`AutotunePolicy` allows and the
kernel has a config space) -> the kernel's heuristic.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ejkernel.ops.config.cache import ConfigCache, _overlays
from ejkernel.ops.config.persistent import PersistentCache
from ejkernel.ops.config.policy import AutotunePolicy, effective_policy, policy_override
from ejkernel.ops.execution.tuning import Tuner
from ejkernel.ops.utils.fingerprint import device_model
from ejkernel.ops.utils.serialize import from_json, from_jsonable

if TYPE_CHECKING:
    from ejkernel.ops.core.invocation import Invocation

__all__ = [
    "AutotunePolicy",
    "ConfigSelectorChain",
    "Selection",
    "effective_policy",
    "match_shipped",
    "policy_override",
]


class Selection(NamedTuple):
    """A chosen config and the level that provided it."""

    cfg: Any
    source: str
    """``"overlay"``, ``"cache"``, ``"persistent"``, ``"shipped"``, ``"autotune"`` or ``"heuristic"``."""


_MISS = object()
_MAX_SETTLED = 1 << 16
ShippedProvider = Callable[["Invocation"], Any]


class ConfigSelectorChain:
    """Finds the config of a call by consulting, in order, the levels described in this module.

    Args:
        cache: in-memory cache (a fresh :class:`ConfigCache` by default).
        persistent: on-disk cache, or None for none.
        policy: the :class:`AutotunePolicy`; by default autotuning is off unless ``autotune=True``.
        tuner: the :class:`Tuner` that benchmarks candidates (default ``Tuner()``).
        autotune: shorthand for the policy's ``allow_autotune``.
        shipped: True to consult configs shipped by backend plugins (the default), False for none, or a
            callable ``(invocation) -> config | None``.
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | None = None,
        policy: AutotunePolicy | None = None,
        tuner: Tuner | None = None,
        *,
        autotune: bool | None = None,
        shipped: bool | ShippedProvider = True,
    ):
        if cache is not None and not isinstance(cache, ConfigCache):
            raise TypeError(f"cache must be a ConfigCache, got {type(cache).__name__}")
        if persistent is not None and not isinstance(persistent, PersistentCache):
            raise TypeError(f"persistent must be a PersistentCache or None, got {type(persistent).__name__}")
        if policy is not None and not isinstance(policy, AutotunePolicy):
            raise TypeError(f"policy must be an AutotunePolicy, got {type(policy).__name__}")
        if autotune is not None and not isinstance(autotune, bool):
            raise TypeError(f"autotune must be a bool, got {autotune!r}")
        if not (isinstance(shipped, bool) or callable(shipped)):
            raise TypeError(f"shipped must be a bool or a callable(invocation), got {type(shipped).__name__}")
        if tuner is None:
            tuner = Tuner()
        self.cache = cache if cache is not None else ConfigCache()
        self.persistent = persistent
        base = policy if policy is not None else AutotunePolicy(allow_autotune=bool(autotune))
        self.policy = base if autotune is None else dataclasses.replace(base, allow_autotune=autotune)
        self.tuner = tuner
        self.shipped = shipped
        self._heuristics: dict[str, Any] = {}
        self._shipped_found: dict[str, Any] = {}
        self._untunable: set[str] = set()
        self._settled: dict[str, tuple[Any, int]] = {}  # key -> (heuristic, persistent generation)

    def choose(self, inv: Invocation) -> Any:
        """The config for ``inv`` (see :meth:`select`)."""
        key = inv.cache_key
        if not _overlays.get():
            cfg = self.cache._entries.get(key)  # the per-call fast path: a memory-cache hit
            if cfg is not None:
                return cfg
            # The steady state of the heuristics policy: nothing on disk or shipped for this key (unless
            # the persistent cache changed since) and autotuning still not allowed.
            settled = self._settled.get(key)
            if (
                settled is not None
                and settled[1] == self._persistent_generation()
                and not effective_policy(self.policy).allow_autotune
            ):
                return settled[0]
        return self._select(inv)[0]

    def _persistent_generation(self) -> int:
        return -1 if self.persistent is None else self.persistent.generation

    def select(self, inv: Invocation) -> Selection:
        """The config for ``inv`` and which level provided it."""
        return Selection(*self._select(inv))

    def _select(self, inv: Invocation) -> tuple[Any, str]:
        key = inv.cache_key
        for overlay in _overlays.get():
            cfg = overlay.get(key)
            if cfg is not None:
                return cfg, "overlay"
        cfg = self.cache.get(key)
        if cfg is not None:
            return cfg, "cache"
        if self.persistent is not None:
            cfg = self.persistent.get(key)
            if cfg is not None:
                self.cache.put(key, cfg)
                return cfg, "persistent"
        if self.shipped:
            cfg = self._shipped_config(inv)
            if cfg is not None:
                self.cache.put(key, cfg)
                return cfg, "shipped"
        heuristic = self.heuristic(inv)
        policy = effective_policy(self.policy)
        if policy.allow_autotune and key not in self._untunable:
            tuned = self._autotune(inv, heuristic, policy)
            if tuned is not None:
                return tuned, "autotune"
        elif not policy.allow_autotune and len(self._settled) < _MAX_SETTLED:
            self._settled[key] = (heuristic, self._persistent_generation())
        return heuristic, "heuristic"

    def heuristic(self, inv: Invocation) -> Any:
        """The kernel's heuristic config for ``inv`` (computed once per key)."""
        key = inv.cache_key
        cfg = self._heuristics.get(key, _MISS)
        if cfg is _MISS:
            cfg = inv.kernel.heuristic_cfg(inv)
            self._heuristics[key] = cfg
        return cfg

    def store(self, inv: Invocation | str, cfg: Any, *, persist: bool = True) -> None:
        """Record a tuned config in the memory cache (and the persistent one when ``persist``)."""
        self.cache.put(inv, cfg)
        if persist and self.persistent is not None:
            self.persistent.put(inv, cfg)

    def _autotune(self, inv: Invocation, heuristic: Any, policy: AutotunePolicy) -> Any:
        try:
            candidates = list(inv.kernel.config_space(inv))
            if not candidates:
                return None
            result = self.tuner.tune(inv, candidates, heuristic=heuristic, policy=policy)
        except Exception as exc:  # a broken config space or tuner must not break the user's call
            warnings.warn(
                f"autotuning {inv.kernel.name!r} failed ({type(exc).__name__}: {exc}); using its heuristic config",
                RuntimeWarning,
                stacklevel=4,
            )
            self._untunable.add(inv.cache_key)
            return None
        if result.best is None:
            self._untunable.add(inv.cache_key)  # nothing ran: do not retry this key on every call
            return None
        self.store(inv, result.best, persist=policy.persist)
        return result.best

    def _shipped_config(self, inv: Invocation) -> Any:
        key = inv.cache_key
        cfg = self._shipped_found.get(key, _MISS)
        if cfg is _MISS:
            cfg = self._lookup_shipped(inv)
            self._shipped_found[key] = cfg
        return cfg

    def _lookup_shipped(self, inv: Invocation) -> Any:
        if callable(self.shipped):
            return self.shipped(inv)
        from ejkernel.plugins import shipped_configs  # loads the plugins only when a config is needed

        table = shipped_configs(inv.kernel.name, inv.platform, device_model(inv.device))
        return match_shipped(table, inv)

    def __repr__(self) -> str:
        return (
            f"ConfigSelectorChain(cache={self.cache!r}, persistent={self.persistent!r}, policy={self.policy!r}, "
            f"shipped={self.shipped!r})"
        )


def match_shipped(table: Mapping[str, Any] | None, inv: Invocation) -> Any:
    """The shipped config for ``inv`` in a ``{signature: config}`` table (``"*"`` matches any call).

    Values are config objects or typed JSON (as :func:`ejkernel.ops.to_json` writes them).
    """
    if not table:
        return None
    value = table.get(inv.signature)
    if value is None:
        value = table.get("*")
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)):
        try:
            return from_json(value) if isinstance(value, (str, bytes)) else from_jsonable(value)
        except Exception as exc:
            warnings.warn(
                f"shipped config for {inv.kernel.name!r} cannot be decoded ({exc}); ignoring it",
                UserWarning,
                stacklevel=2,
            )
            return None
    return value
