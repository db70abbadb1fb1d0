"""Kernel registry: which implementation of an algorithm runs on which platform and hardware.

Implementations are registered under an algorithm name (case-insensitive) with a :class:`Platform`
(how it is written), a :class:`Backend` (what hardware it targets) and a priority. Lookup returns the
highest-priority match. Backend plugins register *lazily* (``register_lazy``): only the import path is
recorded, and the implementation module is imported on first call, so discovering plugins at
``import ejkernel`` costs no kernel imports.

Platforms are the five first-party ones plus any name a loaded backend plugin declares in
``BackendInfo.platforms`` (:func:`declare_platform`): ``Platform("mytpu")`` and ``platform="mytpu"`` work
once a plugin declared it, and name the declared platforms in their error otherwise.

This module imports nothing else of ejkernel but its errors: the plugin host (``ejkernel.plugins``)
builds on it, and installs the richer "which plugin would provide this" hint into the registry it loads
into (:attr:`KernelRegistry.provider_hint`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import threading
import warnings
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal, TypeVar

from ejkernel.errors import KernelNotFoundError

F = TypeVar("F", bound=Callable)

FIRST_PARTY = {"xla": "ejkernel-xla", "triton": "ejkernel-triton", "pallas": "ejkernel-pallas", "cuda": "ejkernel-cuda"}
"""Which first-party distribution provides each platform (for install hints)."""

_declared_platforms: set[str] = set()
_PLATFORM_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


class Platform(StrEnum):
    """How an implementation is written (and compiled): the first-party members, or a name a backend
    plugin declared (:func:`declare_platform`), which ``Platform(name)`` then accepts too."""

    TRITON = "triton"
    PALLAS = "pallas"
    CUDA = "cuda"
    CUTE = "cute"
    XLA = "xla"

    @classmethod
    def _missing_(cls, value: object) -> Platform | None:
        if not (isinstance(value, str) and value in _declared_platforms):
            return None
        member = str.__new__(cls, value)
        member._name_, member._value_ = value.upper(), value
        return cls._value2member_map_.setdefault(value, member)  # one object per name, like the members


def declare_platform(name: str) -> Platform:
    """Make ``name`` a :class:`Platform` (the plugin host does it for every ``BackendInfo.platforms`` entry).

    A platform name is a lower-case identifier (it appears in cache keys and ``run_<platform>``).
    """
    if not isinstance(name, str) or not _PLATFORM_NAME.match(name) or name == "auto":
        raise ValueError(
            f"platform name {name!r} must be a lower-case identifier (a-z, 0-9, _; not 'auto'), e.g. 'mytpu'"
        )
    _declared_platforms.add(name)
    return Platform(name)


def first_party_hint(platform: str, algorithm: str) -> str:
    """One sentence on which distribution provides ``platform`` (without looking at installed plugins)."""
    distribution = FIRST_PARTY.get(platform)
    if distribution:
        return f"Platform {platform!r} comes from the {distribution} distribution: pip install {distribution}."
    return f"No installed backend provides platform {platform!r}."


class Backend(StrEnum):
    """Which hardware an implementation targets; ``ANY`` matches every backend query."""

    GPU = "gpu"
    TPU = "tpu"
    CPU = "cpu"
    ANY = "any"


PlatformLike = Platform | Literal["triton", "pallas", "cuda", "cute", "xla", "auto"] | str
"""A platform, its name (first-party, or declared by a plugin), or ``"auto"`` where lookups allow it."""
BackendLike = Backend | Literal["gpu", "tpu", "cpu", "any"]


class LazyImplementation:
    """A callable standing for ``"package.module:attribute"``, imported on first use.

    Attribute access (``config_type``, ``supports``, ``heuristic_config`` ...) also resolves it.
    """

    def __init__(self, target: str, *, plugin: str | None = None):
        module, sep, attribute = target.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"lazy target must look like 'package.module:attribute', got {target!r}")
        self.target = target
        self.plugin = plugin
        self._resolved: Callable | None = None
        self._lock = threading.Lock()

    def resolve(self) -> Callable:
        if self._resolved is None:
            with self._lock:
                if self._resolved is None:
                    module_name, _, attribute = self.target.partition(":")
                    obj: Any = importlib.import_module(module_name)
                    for part in attribute.split("."):
                        obj = getattr(obj, part)
                    if not callable(obj):
                        raise TypeError(f"lazy target {self.target!r} resolved to non-callable {obj!r}")
                    self._resolved = obj
        return self._resolved

    @property
    def resolved(self) -> bool:
        return self._resolved is not None

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("target", "plugin", "_resolved", "_lock"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.resolve())

    def __repr__(self) -> str:
        return f"<lazy {self.target}>"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One registered implementation of an algorithm."""

    platform: Platform
    backend: Backend
    algorithm: str
    implementation: Callable
    priority: int = 0
    plugin: str | None = dataclasses.field(default=None, compare=False)
    """Name of the backend plugin that registered it (None for direct registrations)."""


def _as_platform(value: PlatformLike | None, *, argument: str = "platform") -> Platform | None:
    if value is None or value == "auto":
        return None
    try:
        return Platform(str(value).lower())
    except ValueError:
        choices = ", ".join(repr(p.value) for p in Platform)
        declared = sorted(_declared_platforms - {p.value for p in Platform})
        raise ValueError(
            f"{argument}={value!r} is not a platform; expected one of {choices} or 'auto', or a name a loaded "
            f"backend plugin declares in BackendInfo.platforms (declared: {', '.join(map(repr, declared)) or 'none'})"
        ) from None


def _as_backend(value: BackendLike | None, *, argument: str = "backend") -> Backend | None:
    if value is None:
        return None
    try:
        return Backend(str(value).lower())
    except ValueError:
        choices = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"{argument}={value!r} is not a backend; expected one of {choices}") from None


def current_backend() -> Backend:
    """The :class:`Backend` of ``jax.default_backend()`` (``cuda``/``rocm`` count as GPU)."""
    import jax

    name = jax.default_backend().lower()
    if name in ("gpu", "cuda", "rocm"):
        return Backend.GPU
    if name == "tpu":
        return Backend.TPU
    return Backend.CPU


def _normalize_annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        text = annotation
    else:
        text = getattr(annotation, "__qualname__", None) or repr(annotation)
    return text.replace("typing.", "").replace(" ", "")


def _types_are_equivalent(first: Any, second: Any) -> bool:
    """Annotations match when they are equal or render the same (string vs evaluated forms)."""
    return first == second or _normalize_annotation(first) == _normalize_annotation(second)


class KernelRegistry:
    """Stores :class:`KernelSpec` objects by algorithm and looks up the best match."""

    def __init__(self) -> None:
        self._registry: dict[str, list[KernelSpec]] = {}
        self._lock = threading.RLock()
        self.provider_hint: Callable[[str, str], str] = first_party_hint
        """``(platform, algorithm) -> sentence`` appended to not-found errors; the plugin host loading into
        this registry replaces it with one that knows the installed plugins."""

    # ---- registration -------------------------------------------------------------------------
    def _add(self, spec: KernelSpec) -> None:
        with self._lock:
            specs = self._registry.setdefault(spec.algorithm, [])
            specs.append(spec)
            specs.sort(key=lambda s: -s.priority)  # stable: equal priorities keep registration order

    def register(
        self,
        algorithm: str,
        platform: Platform | Literal["triton", "pallas", "cuda", "cute", "xla"] | str,
        backend: BackendLike,
        priority: int = 0,
        *,
        plugin: str | None = None,
    ) -> Callable[[F], F]:
        """Decorator registering ``func`` as an implementation of ``algorithm``; returns ``func``.

        ``plugin`` names the backend plugin registering it (so its availability is checked at dispatch).
        """
        algorithm_key, platform_value, backend_value = _registration_key("register", algorithm, platform, backend,
                                                                         priority)

        def decorator(func: F) -> F:
            if not callable(func):
                raise TypeError(f"register({algorithm!r}) decorates callables, got {func!r}")
            self._add(KernelSpec(platform_value, backend_value, algorithm_key, func, priority, plugin))
            return func

        return decorator

    def register_lazy(
        self,
        algorithm: str,
        platform: PlatformLike,
        backend: BackendLike,
        target: str,
        priority: int = 0,
        *,
        plugin: str | None = None,
    ) -> KernelSpec:
        """Register ``"package.module:function"`` without importing it (what plugins use)."""
        algorithm_key, platform_value, backend_value = _registration_key("register_lazy", algorithm, platform,
                                                                         backend, priority)
        spec = KernelSpec(
            platform_value, backend_value, algorithm_key, LazyImplementation(target, plugin=plugin), priority, plugin
        )
        self._add(spec)
        return spec

    def unregister_plugin(self, plugin: str) -> int:
        """Remove every implementation a plugin registered (used when its hook fails midway)."""
        removed = 0
        with self._lock:
            for algorithm in list(self._registry):
                kept = [s for s in self._registry[algorithm] if s.plugin != plugin]
                removed += len(self._registry[algorithm]) - len(kept)
                if kept:
                    self._registry[algorithm] = kept
                else:
                    del self._registry[algorithm]
        return removed

    # ---- lookup -------------------------------------------------------------------------------
    def find(
        self, algorithm: str, platform: PlatformLike | None = None, backend: BackendLike | None = None
    ) -> list[KernelSpec]:
        """Every spec matching the query, best first (no fallback rules applied)."""
        platform_value = _as_platform(platform)
        backend_value = _as_backend(backend)
        with self._lock:
            specs = list(self._registry.get(algorithm.lower(), ()))
        return [
            s
            for s in specs
            if (platform_value is None or s.platform == platform_value)
            and (backend_value is None or s.backend == backend_value or s.backend == Backend.ANY)
        ]

    def get(
        self, algorithm: str, platform: PlatformLike | None = None, backend: BackendLike | None = None
    ) -> Callable:
        """Best implementation for the query, with the spec's fallback rules.

        * ``Platform.XLA`` with no direct match retries with ``Backend.ANY``;
        * ``Backend.ANY`` with no match retries with ``jax.default_backend()``.
        """
        platform_value = _as_platform(platform)
        backend_value = _as_backend(backend)
        matches = self.find(algorithm, platform_value, backend_value)
        if not matches and platform_value == Platform.XLA:
            matches = self.find(algorithm, platform_value, Backend.ANY)
        if not matches and backend_value == Backend.ANY:
            matches = self.find(algorithm, platform_value, current_backend())
        if not matches:
            raise KernelNotFoundError(self._not_found_message(algorithm, platform_value, backend_value))
        return matches[0].implementation

    def _not_found_message(self, algorithm: str, platform: Platform | None, backend: Backend | None) -> str:
        query = f"algorithm={algorithm!r}"
        if platform is not None:
            query += f", platform={platform.value!r}"
        if backend is not None:
            query += f", backend={backend.value!r}"
        lines = [f"no kernel implementation registered for {query}."]
        registered = self.list_implementations(algorithm)
        if registered:
            lines.append("Registered for this algorithm: " + ", ".join(_describe(s) for s in registered) + ".")
        else:
            known = self.list_algorithms()
            lines.append(f"Nothing is registered for {algorithm!r}; known algorithms: {', '.join(known) or 'none'}.")
        if platform is not None:
            hint = self.provider_hint(platform.value, algorithm.lower())
            if hint:
                lines.append(hint)
        return " ".join(lines)

    def list_algorithms(self) -> list[str]:
        with self._lock:
            return sorted(self._registry)

    def list_implementations(self, algorithm: str) -> list[KernelSpec]:
        with self._lock:
            return list(self._registry.get(algorithm.lower(), ()))

    # ---- signature validation ---------------------------------------------------------------
    def validate_signatures(self, algorithm: str | None, verbose: bool = False) -> bool | None:
        """Warn (``UserWarning``) about each implementation that does not fit with the others; True when all do.

        Implementations of an operation are :class:`ejkernel.Implementation` objects (imported and checked
        here, lazy ones included): each must be one, its ``config_type`` a frozen dataclass, its methods
        the interface's (``__call__(call, config)``, ``supports(call)``, ``heuristic_config(call)``,
        ``candidate_configs(call)``), ``config`` annotated (if at all) with its own ``config_type``, and
        ``call`` with the same canonical-call type as the highest-priority one. Plain functions (no
        Implementation registered for the algorithm) are compared with the highest-priority one: parameter
        names, kinds, defaults and annotations. ``algorithm=None`` checks every algorithm (returns None).
        """
        if algorithm is None:
            for name in self.list_algorithms():
                self.validate_signatures(name, verbose=verbose)
            return None
        specs = self.list_implementations(algorithm)
        if not specs:
            raise ValueError(f"algorithm {algorithm!r} is not registered; known: {', '.join(self.list_algorithms())}")
        resolved = [(spec, _resolved(spec.implementation)) for spec in specs]
        if verbose:
            for spec, implementation in resolved:
                print(f"{_describe(spec)}: {_signature_text(implementation)}")
        from ejkernel.modules.operations._contract import Implementation

        if any(isinstance(implementation, Implementation) for _, implementation in resolved):
            problems = _contract_problems(resolved, Implementation)
        else:
            reference_spec, reference = specs[0], inspect.signature(resolved[0][1])
            problems = [
                (spec, f"differs from {_describe(reference_spec)}: {problem}")
                for spec, implementation in resolved[1:]
                for problem in _signature_differences(reference, inspect.signature(implementation))
            ]
        for spec, problem in problems:
            warnings.warn(f"{algorithm}: {_describe(spec)} {problem}", UserWarning, stacklevel=2)
        return not problems


def _resolved(implementation: Callable) -> Callable:
    return implementation.resolve() if isinstance(implementation, LazyImplementation) else implementation


def _signature_text(implementation: Any) -> str:
    target = type(implementation).__call__ if not inspect.isroutine(implementation) else implementation
    try:
        return f"{implementation!r}{inspect.signature(target)}"
    except (TypeError, ValueError):
        return repr(implementation)


_INTERFACE_METHODS = ("__call__", "supports", "heuristic_config", "candidate_configs")


def _evaluated_signature(function: Callable) -> inspect.Signature:
    """The signature with string annotations evaluated where they can be (else kept as strings)."""
    try:
        return inspect.signature(function, eval_str=True)
    except Exception:  # a name imported under TYPE_CHECKING only: compare the text
        return inspect.signature(function)


def _contract_problems(resolved: list[tuple[KernelSpec, Any]], interface: type) -> list[tuple[KernelSpec, str]]:
    """What makes each implementation deviate from the operation contract (see ``validate_signatures``)."""
    problems: list[tuple[KernelSpec, str]] = []
    call_types: list[tuple[KernelSpec, str]] = []
    for spec, implementation in resolved:
        if not isinstance(implementation, interface):
            problems.append((spec, f"is {implementation!r}, not an ejkernel.Implementation"))
            continue
        config_type = implementation.config_type
        params = getattr(config_type, "__dataclass_params__", None)
        if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type) and params.frozen):
            problems.append((spec, f"has config_type {config_type!r}, not a frozen dataclass"))
        for name in _INTERFACE_METHODS:
            expected = inspect.signature(getattr(interface, name))
            actual = inspect.signature(getattr(type(implementation), name))
            problems.extend(
                (spec, f"{name}{actual}: {problem}")
                for problem in _signature_differences(expected, actual, annotations=False)
            )
        call_signature = _evaluated_signature(type(implementation).__call__).parameters
        config_annotation = getattr(call_signature.get("config"), "annotation", inspect.Parameter.empty)
        if config_annotation is not inspect.Parameter.empty and not _types_are_equivalent(
            config_annotation, config_type
        ):
            problems.append(
                (spec, f"annotates config {_normalize_annotation(config_annotation)!r}, but its config_type is "
                       f"{_normalize_annotation(config_type)!r}")
            )
        call_annotation = getattr(call_signature.get("call"), "annotation", inspect.Parameter.empty)
        if call_annotation is not inspect.Parameter.empty:
            call_types.append((spec, _normalize_annotation(call_annotation)))
    for spec, call_type in call_types[1:]:
        if call_type != call_types[0][1]:
            problems.append(
                (spec, f"takes call: {call_type}, but {_describe(call_types[0][0])} takes call: {call_types[0][1]}")
            )
    return problems


def _signature_differences(
    reference: inspect.Signature, other: inspect.Signature, *, annotations: bool = True
) -> list[str]:
    problems = []
    ref_params = list(reference.parameters.values())
    other_params = list(other.parameters.values())
    if len(ref_params) != len(other_params):
        problems.append(f"{len(other_params)} parameters instead of {len(ref_params)}")
    for expected, actual in zip(ref_params, other_params):
        if expected.name != actual.name:
            problems.append(f"parameter {actual.name!r} where {expected.name!r} was expected")
            continue
        if expected.kind != actual.kind:
            problems.append(f"parameter {actual.name!r} is {actual.kind.description}, not {expected.kind.description}")
        if expected.default != actual.default and not (
            expected.default is inspect.Parameter.empty and actual.default is inspect.Parameter.empty
        ):
            problems.append(f"parameter {actual.name!r} defaults to {actual.default!r}, not {expected.default!r}")
        if annotations and not _types_are_equivalent(expected.annotation, actual.annotation):
            problems.append(
                f"parameter {actual.name!r} is annotated {_normalize_annotation(actual.annotation)!r}, "
                f"not {_normalize_annotation(expected.annotation)!r}"
            )
    return problems


def _describe(spec: KernelSpec) -> str:
    origin = f" from {spec.plugin}" if spec.plugin else ""
    return f"{spec.platform.value}/{spec.backend.value} (priority {spec.priority}{origin})"


def _check_algorithm(algorithm: str) -> str:
    if not isinstance(algorithm, str) or not algorithm.strip():
        raise ValueError(f"algorithm must be a non-empty string, got {algorithm!r}")
    return algorithm.strip().lower()


def _check_priority(priority: int) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r} ({type(priority).__name__})")


def _registration_key(caller: str, algorithm: str, platform: PlatformLike, backend: BackendLike,
                      priority: int) -> tuple[str, Platform, Backend]:
    """(algorithm, platform, backend) of a registration, checked: a concrete platform, a backend, an int
    priority (``caller`` names the registering method in the errors)."""
    algorithm_key = _check_algorithm(algorithm)
    platform_value = _as_platform(platform)
    if platform_value is None:
        raise ValueError(f"{caller}() needs a concrete platform, not 'auto'")
    backend_value = _as_backend(backend)
    if backend_value is None:
        raise ValueError(f"{caller}() needs a backend (use Backend.ANY for hardware-agnostic code)")
    _check_priority(priority)
    return algorithm_key, platform_value, backend_value


kernel_registry = KernelRegistry()
"""The process-wide registry every plugin registers into."""
