"""Choosing which registered implementation runs an operation, and falling back when one cannot.

``platform="auto"`` walks the implementations registered for the current hardware, best first (by their
priority for the call: ``Implementation.priority_for``, else the registered one), and takes the first one
whose backend plugin is usable here and whose ``supports(call)`` accepts the call; each one skipped is
logged with its reason. An explicit ``platform=`` is honoured or refused with a clear error, never silently
replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from ejkernel.errors import KernelNotFoundError, UnsupportedFeature
from ejkernel.kernels._registry import (
    Backend,
    KernelSpec,
    Platform,
    _as_platform,
    current_backend,
    kernel_registry,
)

logger = logging.getLogger("ejkernel.dispatch")


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The implementation chosen for a call, and what was passed over on the way."""

    spec: KernelSpec
    skipped: tuple[tuple[str, str], ...] = ()
    """(platform, reason) for each better-ranked implementation that could not take the call."""

    @property
    def platform(self) -> str:
        return self.spec.platform.value

    @property
    def implementation(self) -> Callable:
        return self.spec.implementation

    def describe(self) -> str:
        """``xla (from plugin 'xla'); passed over: triton (triton): no GPU visible``."""
        text = f"{self.platform}/{self.spec.backend.value}" + (
            f" from plugin {self.spec.plugin!r}" if self.spec.plugin else ""
        )
        if self.skipped:
            text += "; passed over: " + "; ".join(f"{name}: {why}" for name, why in self.skipped)
        return text


def _spec_label(spec: KernelSpec) -> str:
    return f"{spec.platform.value}" + (f" ({spec.plugin})" if spec.plugin else "")


def _unusable_reason(spec: KernelSpec) -> str | None:
    from ejkernel.plugins import usable_reason

    return usable_reason(spec.plugin)


def _unsupported_reason(spec: KernelSpec, call: Any) -> str | None:
    try:
        spec.implementation.supports(call)
    except UnsupportedFeature as exc:
        return str(exc) or type(exc).__name__
    return None


def _optional_attribute(implementation: Callable, name: str) -> Any:
    try:
        return getattr(implementation, name)
    except AttributeError:
        return None


def _candidates(algorithm: str, platform: Platform | None, backend: Backend) -> list[KernelSpec]:
    specs = kernel_registry.find(algorithm, platform, backend)
    if not specs and platform == Platform.XLA:
        specs = kernel_registry.find(algorithm, platform, Backend.ANY)
    return specs


def _ranked_for(specs: list[KernelSpec], call: Any) -> list[KernelSpec]:
    """``specs`` ordered for ``call``: each usable implementation's ``priority_for(call)`` where it gives one,
    else its registered priority (a stable sort: ties keep the registry's order). Unusable ones keep theirs
    (their code is not imported)."""

    def priority(spec: KernelSpec) -> int:
        if _unusable_reason(spec) is not None:
            return spec.priority
        hook = _optional_attribute(spec.implementation, "priority_for")
        ranked = hook(call) if hook is not None else None
        return spec.priority if ranked is None else ranked

    return sorted(specs, key=lambda spec: -priority(spec))


def _install_hint(algorithm: str) -> str:
    from ejkernel.plugins import FIRST_PARTY, backends

    if "xla" in backends():
        return ""
    return (
        f" {FIRST_PARTY['xla']} implements {algorithm!r} on every machine (CPU, GPU, TPU): "
        f"pip install {FIRST_PARTY['xla']}."
    )


def _elsewhere_reason(spec: KernelSpec, backend: Backend) -> str:
    """Why an implementation registered for other hardware does not run here (the plugin's reason first)."""
    return _unusable_reason(spec) or f"it targets {spec.backend.value}, and jax runs on {backend.value} here"


def resolve(algorithm: str, platform: str | Platform | None, call: Any) -> Resolution:
    """Pick the implementation of ``algorithm`` for this call (see the module docstring)."""
    requested = _as_platform(platform)
    backend = current_backend()
    candidates = _candidates(algorithm, requested, backend)
    if requested is not None:
        if not candidates:
            elsewhere = kernel_registry.find(algorithm, requested, None)
            if elsewhere:
                raise KernelNotFoundError(
                    f"{algorithm}: platform={requested.value!r} cannot run here: "
                    f"{_elsewhere_reason(elsewhere[0], backend)}. Use platform='auto' to let ejkernel pick what "
                    "runs here." + _install_hint(algorithm)
                )
            kernel_registry.get(algorithm, requested, backend)  # raises with the registry's full explanation
        spec = candidates[0]
        reason = _unusable_reason(spec)
        if reason is not None:
            raise KernelNotFoundError(
                f"{algorithm}: platform={requested.value!r} cannot run here: {reason}."
                " Use platform='auto' to fall back to what runs here." + _install_hint(algorithm)
            )
        reason = _unsupported_reason(spec, call)
        if reason is not None:
            raise UnsupportedFeature(f"{algorithm}: platform={requested.value!r} cannot take this call: {reason}")
        return Resolution(spec)

    skipped: list[tuple[str, str]] = []
    for spec in _ranked_for(candidates, call):
        reason = _unusable_reason(spec) or _unsupported_reason(spec, call)
        if reason is None:
            # Better-ranked kernels for other hardware (a GPU backend on a CPU-only machine) are passed
            # over too: say so, so a user wondering why the fast path did not run finds the reason.
            candidate_set = set(map(id, candidates))
            skipped.extend(
                (_spec_label(other), _elsewhere_reason(other, backend))
                for other in kernel_registry.list_implementations(algorithm)
                if id(other) not in candidate_set and other.priority > spec.priority
                and (requested is None or other.platform == requested)
            )
            skipped = list(dict.fromkeys(skipped))  # one line per backend and reason
            for skipped_platform, why in skipped:
                _log_fallback(algorithm, skipped_platform, spec.platform.value, why)
            return Resolution(spec, tuple(skipped))
        skipped.append((_spec_label(spec), reason))
    registered = kernel_registry.list_implementations(algorithm)
    if not registered:
        raise KernelNotFoundError(
            kernel_registry._not_found_message(algorithm, None, None) + _install_hint(algorithm)
        )
    elsewhere = [s for s in registered if s not in candidates]
    skipped.extend((_spec_label(s), _elsewhere_reason(s, backend)) for s in elsewhere)
    details = "; ".join(f"{name}: {why}" for name, why in dict.fromkeys(skipped))
    raise KernelNotFoundError(
        f"{algorithm}: no implementation can take this call here ({details})." + _install_hint(algorithm)
    )


_logged: set[tuple[str, str, str]] = set()
_logged_lock = threading.Lock()


def _log_fallback(algorithm: str, skipped: str, chosen: str, reason: str) -> None:
    """INFO the first time a (kernel, reason) is passed over, DEBUG after that (no log spam per call)."""
    key = (algorithm, skipped, reason)
    with _logged_lock:
        first = key not in _logged
        _logged.add(key)
    logger.log(logging.INFO if first else logging.DEBUG, "%s: using %s instead of %s: %s", algorithm, chosen, skipped, reason)
