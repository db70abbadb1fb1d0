"""The autotuning policy: when and how much to autotune a call whose config is in no cache.

Precedence: :func:`policy_override` (context-local) > ``EJKERNEL_AUTOTUNE_POLICY`` (``autotune`` |
``heuristics``, the operator's process-wide switch) > the chain's :class:`AutotunePolicy`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from ejkernel.ops.utils.env import env_get

__all__ = ["AUTOTUNE_POLICY_ENV", "AutotunePolicy", "effective_policy", "env_allows_autotune", "policy_override"]

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
