"""Backend plugin discovery, isolation and status.

Backends are found through the ``ejkernel.backends`` entry-point group when ``ejkernel`` is imported.
A plugin that fails to import, speaks another plugin API version, or raises in a hook is recorded with
its error and warned about once; it never breaks ``import ejkernel`` or another plugin.

Environment controls (read at discovery):

* ``EJKERNEL_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (use :func:`load_plugin` by hand).
* ``EJKERNEL_PLUGINS=xla,triton``: load only these backends (by entry-point name).
* ``EJKERNEL_BLOCK_PLUGINS=cuda``: never load these backends.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import threading
import warnings
from typing import Any

import pluggy

from ejkernel.errors import PluginError
from ejkernel.kernels._registry import FIRST_PARTY, KernelRegistry, declare_platform, first_party_hint, kernel_registry
from ejkernel.plugins.hookspecs import (
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    PROJECT_NAME,
    BackendHookSpec,
    BackendInfo,
    hookimpl,
    hookspec,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY",
    "BackendInfo",
    "LoadedBackend",
    "PluginWarning",
    "backends",
    "discover",
    "get_backend",
    "hookimpl",
    "hookspec",
    "PluginHost",
    "host",
    "load_plugin",
    "plugin_manager",
    "provider_hint",
    "shipped_configs",
    "usable_reason",
]

class PluginWarning(UserWarning):
    """A backend plugin was skipped because it is broken."""


@dataclasses.dataclass
class LoadedBackend:
    """A discovered backend plugin and what happened when it was loaded."""

    name: str
    distribution: str | None
    version: str | None
    info: BackendInfo | None = None
    error: str | None = None
    """Why loading failed (import error, API mismatch, hook exception); None when it loaded."""
    implementations: int = 0
    _usable: tuple[str | None] | None = dataclasses.field(default=None, repr=False)
    _parts: dict[str, str] | None = dataclasses.field(default=None, repr=False)

    @property
    def platforms(self) -> tuple[str, ...]:
        return self.info.platforms if self.info else ()

    @property
    def targets(self) -> tuple[str, ...]:
        return self.info.targets if self.info else ()

    def unusable_reason(self) -> str | None:
        """None when usable here; else why not. Computed once (it may look at devices)."""
        if self.error is not None:
            return f"error: {self.error}"
        if self._usable is None:
            reason = None
            if self.info is not None and self.info.check_usable is not None:
                try:
                    reason = self.info.check_usable()
                except Exception as exc:  # a broken check must not break the caller
                    reason = f"availability check raised {type(exc).__name__}: {exc}"
            self._usable = (reason,)
        return self._usable[0]

    @property
    def status(self) -> str:
        if self.error is not None:
            return f"error: {self.error}"
        reason = self.unusable_reason()
        return "ok" if reason is None else f"unavailable: {reason}"

    def part_statuses(self) -> dict[str, str]:
        """``{part: "ok" or "unavailable: why"}`` of the backend's parts (``BackendInfo.check_parts``; empty
        when it declares none). Computed once."""
        if self._parts is None:
            check = self.info.check_parts if self.info is not None else None
            try:
                reasons = check() if check is not None else {}
            except Exception as exc:  # a broken check must not break the caller
                reasons = {"parts": f"availability check raised {type(exc).__name__}: {exc}"}
            self._parts = {part: "ok" if reason is None else f"unavailable: {reason}"
                           for part, reason in reasons.items()}
        return self._parts

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "platforms": list(self.platforms),
            "targets": list(self.targets),
            "status": self.status,
            "implementations": self.implementations,
            "parts": self.part_statuses(),
        }


class PluginHost:
    """Loads backend plugins into a registry and remembers what happened to each.

    The process has one (:func:`host`) bound to ``kernel_registry``; tests and embedders can make their own.
    The registry's not-found errors get this host's :meth:`provider_hint`.
    """

    def __init__(self, registry: KernelRegistry) -> None:
        self.registry = registry
        registry.provider_hint = self.provider_hint
        self.manager = pluggy.PluginManager(PROJECT_NAME)
        self.manager.add_hookspecs(BackendHookSpec)
        self.backends: dict[str, LoadedBackend] = {}
        self.discovered = False
        self._lock = threading.RLock()
        self._warned: set[tuple[str, str]] = set()
        self._shipped: dict[tuple[str, str, str], dict] = {}

    # ---- loading ------------------------------------------------------------------------------
    def discover(self, entry_points=None) -> dict[str, LoadedBackend]:
        """Load every backend plugin from entry points once (idempotent); honours the env controls."""
        with self._lock:
            if self.discovered:
                return self.backends
            self.discovered = True
            if os.environ.get("EJKERNEL_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("", "0", "false", "False"):
                return self.backends
            only = _env_names("EJKERNEL_PLUGINS")
            blocked = _env_names("EJKERNEL_BLOCK_PLUGINS") or set()
            if entry_points is None:
                entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            for entry_point in entry_points:
                if entry_point.name in blocked or (only is not None and entry_point.name not in only):
                    continue
                if entry_point.name in self.backends:
                    self._warn_once(
                        self.backends[entry_point.name],
                        f"a second entry point named {entry_point.name!r} ({_dist_label(entry_point)}) was ignored",
                    )
                    continue
                self._load_entry_point(entry_point)
            return self.backends

    def _load_entry_point(self, entry_point: importlib.metadata.EntryPoint) -> None:
        dist = entry_point.dist
        backend = LoadedBackend(
            name=entry_point.name,
            distribution=dist.name if dist is not None else None,
            version=dist.version if dist is not None else None,
        )
        self.backends[backend.name] = backend
        try:
            plugin = entry_point.load()
        except BaseException as exc:  # noqa: BLE001 - a plugin calling sys.exit() at import is broken too
            if isinstance(exc, KeyboardInterrupt):
                raise
            backend.error = f"import of {entry_point.value!r} failed: {type(exc).__name__}: {exc}"
            self._warn_once(backend, backend.error)
            return
        self._register(backend, plugin)

    def load_plugin(self, plugin: Any, name: str | None = None) -> LoadedBackend:
        """Load a plugin object or module by hand (when autoload is disabled, or in tests)."""
        with self._lock:
            label = name or getattr(plugin, "__name__", None) or repr(plugin)
            backend = LoadedBackend(name=label, distribution=None, version=None)
            self._register(backend, plugin)
            self.backends[backend.name] = backend
            return backend

    def _register(self, backend: LoadedBackend, plugin: Any) -> None:
        try:
            self.manager.register(plugin, name=backend.name)
        except Exception as exc:
            backend.error = f"not a valid plugin: {type(exc).__name__}: {exc}"
            self._warn_once(backend, backend.error)
            return
        try:
            info_impl = getattr(plugin, "ejkernel_backend_info", None)
            if info_impl is None:
                raise PluginError("it does not implement the required hook ejkernel_backend_info")
            info = info_impl()
            if not isinstance(info, BackendInfo):
                raise PluginError(f"ejkernel_backend_info returned {type(info).__name__}, expected BackendInfo")
            if info.api_version != PLUGIN_API_VERSION:
                raise PluginError(
                    f"built for ejkernel plugin API {info.api_version}; this ejkernel-core speaks {PLUGIN_API_VERSION}"
                )
            for platform in info.platforms:  # before registering: the hook may use the new names
                declare_platform(platform)
            backend.info = info
            backend.distribution = backend.distribution or info.distribution
            backend.version = backend.version or info.version
            register_impl = getattr(plugin, "ejkernel_register_kernels", None)
            if register_impl is not None:
                before = _count(self.registry)
                register_impl(registry=self.registry, plugin=backend.name)
                backend.implementations = _count(self.registry) - before
        except Exception as exc:
            self.registry.unregister_plugin(backend.name)
            self.manager.unregister(name=backend.name)
            backend.implementations = 0
            backend.error = f"{type(exc).__name__}: {exc}"
            self._warn_once(backend, backend.error)

    def _warn_once(self, backend: LoadedBackend, message: str) -> None:
        key = (backend.name, message)
        if key in self._warned:
            return
        self._warned.add(key)
        origin = f" ({backend.distribution} {backend.version})" if backend.distribution else ""
        warnings.warn(
            f"ejkernel backend plugin {backend.name!r}{origin} was skipped: {message}", PluginWarning, stacklevel=4
        )

    # ---- queries ------------------------------------------------------------------------------
    def usable_reason(self, plugin: str | None) -> str | None:
        """Why the plugin that registered an implementation cannot run here; None if it can.

        Implementations registered directly (no plugin) are taken as usable.
        """
        if plugin is None:
            return None
        backend = self.discover().get(plugin)
        return None if backend is None else backend.unusable_reason()

    def provider_hint(self, platform: str, algorithm: str) -> str:
        """One sentence on which plugin would provide ``platform`` (installed, broken or missing).

        Looks only at the plugins loaded so far (a not-found error must not load plugins).
        """
        providers = [b for b in self.backends.values() if platform in b.platforms]
        for backend in providers:
            if backend.error is not None:
                return f"Backend {backend.name!r} ({backend.distribution}) is installed but broken: {backend.error}."
        if providers:
            names = ", ".join(f"{b.name!r} ({b.distribution} {b.version})" for b in providers)
            return f"Installed backend(s) {names} provide platform {platform!r} but implement no {algorithm!r}."
        broken = self.backends.get(platform)
        if platform in FIRST_PARTY and broken is not None and broken.error is not None:
            return f"Backend {platform!r} ({broken.distribution}) is installed but broken: {broken.error}."
        return first_party_hint(platform, algorithm)

    def shipped_configs(self, algorithm: str, platform: str, device_kind: str) -> dict:
        """Merged ``{signature: config}`` tables that loaded plugins ship for this device model.

        A plugin whose hook raises or returns something other than a mapping is warned about and
        skipped; on a conflict the plugin registered first keeps its entry.
        """
        from collections.abc import Mapping

        key = (algorithm, platform, device_kind)
        with self._lock:
            if key in self._shipped:
                return self._shipped[key]
            merged: dict = {}
            for impl in self.manager.hook.ejkernel_shipped_configs.get_hookimpls():
                backend = self.backends.get(impl.plugin_name) or LoadedBackend(impl.plugin_name, None, None)
                try:
                    result = impl.function(algorithm=algorithm, platform=platform, device_kind=device_kind)
                except Exception as exc:
                    self._warn_once(backend, f"ejkernel_shipped_configs raised {type(exc).__name__}: {exc}")
                    continue
                if result is None:
                    continue
                if not isinstance(result, Mapping):
                    self._warn_once(
                        backend, f"ejkernel_shipped_configs returned {type(result).__name__}, expected a mapping"
                    )
                    continue
                for signature, config in result.items():
                    merged.setdefault(signature, config)
            self._shipped[key] = merged
            return merged


def _env_names(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _dist_label(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"{dist.name} {dist.version}" if dist is not None else entry_point.value


def _count(registry: KernelRegistry) -> int:
    return sum(len(registry.list_implementations(a)) for a in registry.list_algorithms())


_host = PluginHost(kernel_registry)


def host() -> PluginHost:
    """The process-wide plugin host (bound to ``kernel_registry``)."""
    return _host


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every loaded backend plugin."""
    return _host.manager


def discover() -> dict[str, LoadedBackend]:
    """Load the installed backend plugins into ``kernel_registry`` (once; later calls are free)."""
    return _host.discover()


def load_plugin(plugin: Any, name: str | None = None) -> LoadedBackend:
    """Load a plugin object or module by hand into the process-wide host."""
    return _host.load_plugin(plugin, name)


def backends() -> dict[str, LoadedBackend]:
    """Every discovered backend by name (loaded or broken)."""
    return dict(_host.discover())


def get_backend(name: str) -> LoadedBackend | None:
    return _host.discover().get(name)


def usable_reason(plugin: str | None) -> str | None:
    return _host.usable_reason(plugin)


def provider_hint(platform: str, algorithm: str) -> str:
    return _host.provider_hint(platform, algorithm)


def shipped_configs(algorithm: str, platform: str, device_kind: str) -> dict:
    return _host.shipped_configs(algorithm, platform, device_kind)
