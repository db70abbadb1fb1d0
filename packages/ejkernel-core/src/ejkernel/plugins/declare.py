"""Declare a backend plugin as data instead of writing its two hooks by hand.

    BACKEND = DeclaredBackend(
        name="mybackend", distribution="my-dist", platform="xla", targets=("cpu", "gpu"),
        implementations={"flash_attention": "my_pkg.attention:flash_attention"}, priority=50,
    )
    ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()

An implementation key is an algorithm (registered for every backend in ``register_for``) or an
``(algorithm, backend)`` pair. Everything is registered lazily, by import path. ``unverified``: kernels no
GPU run has checked yet, registered only when ``include_unverified()`` says so (by default
``EJKERNEL_UNVERIFIED_KERNELS=1``, set by the device run that verifies them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ejkernel.plugins.checks import distribution_version, unverified_requested
from ejkernel.plugins.hookspecs import BackendInfo, hookimpl


@dataclasses.dataclass(frozen=True)
class DeclaredBackend:
    name: str
    distribution: str
    platform: str
    targets: tuple[str, ...]
    """Hardware the backend targets (shown by ``ejkernel list-backends``)."""
    implementations: Mapping[str | tuple[str, str], str]
    register_for: tuple[str, ...] | None = None
    """Registry backends for plain algorithm keys; defaults to ``targets``."""
    priority: int = 0
    check_usable: Callable[[], str | None] | None = None
    description: str = ""
    check_parts: Callable[[], dict[str, str | None]] | None = None
    """``BackendInfo.check_parts``: the backend's parts that can be unusable on their own."""
    unverified: Mapping[str | tuple[str, str], str] = dataclasses.field(default_factory=dict)
    include_unverified: Callable[[], bool] = unverified_requested

    def info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            distribution=self.distribution,
            version=distribution_version(self.distribution),
            platforms=(self.platform,),
            targets=self.targets,
            check_usable=self.check_usable,
            description=self.description,
            check_parts=self.check_parts,
        )

    def register(self, registry, plugin: str) -> None:
        implementations = {**self.implementations, **(self.unverified if self.include_unverified() else {})}
        for key, target in implementations.items():
            algorithm, backends = (key[0], (key[1],)) if isinstance(key, tuple) else (key, self.register_for or self.targets)
            for backend in backends:
                registry.register_lazy(algorithm, self.platform, backend, target, priority=self.priority, plugin=plugin)

    def hooks(self) -> tuple[Callable, Callable]:
        """``(ejkernel_backend_info, ejkernel_register_kernels)`` to export from the plugin module."""

        @hookimpl
        def ejkernel_backend_info() -> BackendInfo:
            return self.info()

        @hookimpl
        def ejkernel_register_kernels(registry, plugin: str) -> None:
            self.register(registry, plugin)

        return ejkernel_backend_info, ejkernel_register_kernels
