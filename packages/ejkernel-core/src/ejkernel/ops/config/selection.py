"""Config selection: the order in which a call's config is found, and the autotuning policy.

Order (first hit wins): explicit ``cfg=`` (handled by the executor; never cached) -> overlays
(:func:`overlay_cache`) -> in-memory :class:`ConfigCache` -> :class:`PersistentCache` -> configs shipped
by a backend plugin for this device kind -> autotuning (when the policy allows and the kernel has a
config space) -> the kernel's heuristic.

Policy precedence: :func:`policy_override` (context-local) > ``EJKERNEL_AUTOTUNE_POLICY``
(``autotune`` | ``heuristics``, the operator's process-wide switch) > the chain's :class:`AutotunePolicy`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ejkernel.ops.config.cache import ConfigCache, _overlays
from ejkernel.ops.config.persistent import PersistentCache
from ejkernel.ops.utils.env import env_get

if TYPE_CHECKING:
    from ejkernel.ops.core.kernel import Invocation
    from ejkernel.ops.execution.tuning import Tuner

__all__ = [
    "AUTOTUNE_POLICY_ENV",
    "AutotunePolicy",
    "ConfigSelectorChain",
    "Selection",
    "effective_policy",
    "policy_override",
]

AUTOTUNE_POLICY_ENV = "EJKERNEL_AUTOTUNE_POLICY"


@dataclasses.dataclass(frozen=True)
class AutotunePolicy:
    """When and how much to autotune a call whose config is in no cache."""

    allow_autotune: bool = True
    """Benchmark the kernel's config space for new keys (else use the heuristic)."""
    max_candidates: int = 16
    """Candidates tried per new key (the heuristic is always one of them); the rest are pruned up front."""
    time_budget_s: float = 60.0
    """Stop trying further candidates of one key after this many seconds (the best so far wins)."""
    validate: bool = True
    """Reject candidates whose outputs (and gradients) differ from the heuristic config's."""
    persist: bool = True
    """Write autotuned configs to the persistent cache (when the chain has one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow_autotune, bool):
            raise TypeError(f"allow_autotune must be a bool, got {self.allow_autotune!r}")
        if not isinstance(self.max_candidates, int) or self.max_candidates < 1:
            raise ValueError(f"max_candidates must be an int >= 1, got {self.max_candidates!r}")
        if not isinstance(self.time_budget_s, (int, float)) or self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be a positive number of seconds, got {self.time_budget_s!r}")


_policy_overrides: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "ejkernel_ops_policy_overrides", default=types.MappingProxyType({})
)
_POLICY_FIELDS = frozenset(field.name for field in dataclasses.fields(AutotunePolicy))


@contextlib.contextmanager
def policy_override(**changes: Any) -> Iterator[None]:
    """Change the autotuning policy within the block, for this thread/task only.

    Takes :class:`AutotunePolicy` fields (``allow_autotune=False``, ``max_candidates=4`` ...);
    ``autotune=`` is shorthand for ``allow_autotune=``. Nested overrides combine, innermost winning.
    """
    if "autotune" in changes:
        if "allow_autotune" in changes:
            raise TypeError("policy_override: pass autotune= or allow_autotune=, not both")
        changes["allow_autotune"] = changes.pop("autotune")
    unknown = sorted(set(changes) - _POLICY_FIELDS)
    if unknown:
        raise TypeError(
            f"policy_override got unknown field(s) {', '.join(unknown)}; expected some of "
            f"{', '.join(sorted(_POLICY_FIELDS | {'autotune'}))}"
        )
    dataclasses.replace(AutotunePolicy(), **changes)  # validates values now, not at first use
    token = _policy_overrides.set({**_policy_overrides.get(), **changes})
    try:
        yield
    finally:
        _policy_overrides.reset(token)


_warned_env: set[str] = set()


def env_allows_autotune() -> bool | None:
    """``EJKERNEL_AUTOTUNE_POLICY`` as a bool (None when unset or unrecognized, with one warning)."""
    value = env_get(AUTOTUNE_POLICY_ENV)
    if value is None:
        return None
    normalized = value.strip().lower()
    if normalized in ("autotune", "1", "true"):
        return True
    if normalized in ("heuristics", "heuristic", "0", "false", "none"):
        return False
    if value not in _warned_env:
        _warned_env.add(value)
        warnings.warn(
            f"{AUTOTUNE_POLICY_ENV}={value!r} is not understood (expected 'autotune' or 'heuristics'); ignored",
            UserWarning,
            stacklevel=3,
        )
    return None


def effective_policy(base: AutotunePolicy) -> AutotunePolicy:
    """``base`` with the environment switch and the context's overrides applied."""
    overrides = _policy_overrides.get()
    from_env = env_allows_autotune()
    if from_env is None and not overrides:
        return base
    memo_key = (base, from_env, tuple(sorted(overrides.items())))
    policy = _effective.get(memo_key)
    if policy is None:  # dataclasses.replace validates and costs microseconds: once per combination
        changes: dict[str, Any] = {}
        if from_env is not None:
            changes["allow_autotune"] = from_env
        changes.update(overrides)
        policy = dataclasses.replace(base, **changes)
        if len(_effective) < 256:
            _effective[memo_key] = policy
    return policy


_effective: dict[tuple, AutotunePolicy] = {}


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
            from ejkernel.ops.execution.tuning import Tuner

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
        from ejkernel.ops.utils.fingerprint import device_model
        from ejkernel.plugins import shipped_configs

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
        from ejkernel.ops.utils.serialize import from_json, from_jsonable

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
