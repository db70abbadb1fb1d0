"""The hooks a backend plugin implements.

A backend distribution declares one entry point in the ``ejkernel.backends`` group pointing at a module
(or object) whose functions are decorated with :data:`ejkernel.hookimpl`. Hooks must be cheap: import
nothing heavy (no triton, no kernels) and compile nothing; register implementations lazily by import path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ejkernel.kernels._registry import KernelRegistry

PROJECT_NAME = "ejkernel"
ENTRY_POINT_GROUP = "ejkernel.backends"
PLUGIN_API_VERSION = 1
"""Bumped when a hook changes incompatibly; a plugin built for another version is refused with a reason."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What a backend plugin says about itself (returned by :func:`ejkernel_backend_info`)."""

    name: str
    """Short name shown by ``ejkernel list-backends`` (``"triton"``)."""
    distribution: str
    """The pip distribution that ships it (``"ejkernel-triton"``)."""
    version: str
    platforms: tuple[str, ...]
    """Platforms it implements: first-party :class:`ejkernel.kernels.Platform` values, or new names (lower-case
    identifiers), which loading the plugin declares (:func:`ejkernel.kernels.declare_platform`) so that its
    implementations can be registered for them and users can pass ``platform="<name>"``."""
    targets: tuple[str, ...]
    """Hardware it targets (values of :class:`ejkernel.kernels.Backend`)."""
    check_usable: Callable[[], str | None] | None = None
    """Returns why the backend cannot run here (``"triton is not installed"``), or None when it can.

    Called lazily (by the CLI and the dispatcher), never at import: it may import jax and look at devices.
    """
    description: str = ""
    check_parts: Callable[[], dict[str, str | None]] | None = None
    """Parts of a usable backend that can be unusable on their own (a kernel needing a newer GPU or a built
    library beside the backend's main path): ``{part: why it cannot run here, or None}``. Called lazily, like
    :attr:`check_usable`; ``ejkernel list-backends`` shows each part's status."""
    api_version: int = PLUGIN_API_VERSION

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"BackendInfo.name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "platforms", tuple(self.platforms))
        object.__setattr__(self, "targets", tuple(self.targets))


class BackendHookSpec:
    """Hook specifications of the ``ejkernel`` project."""

    @hookspec(firstresult=True)
    def ejkernel_backend_info(self) -> BackendInfo:
        """Describe this backend. Required."""

    @hookspec
    def ejkernel_register_kernels(self, registry: KernelRegistry, plugin: str) -> None:
        """Register implementations, normally with ``registry.register_lazy(..., plugin=plugin)``."""

    @hookspec
    def ejkernel_shipped_configs(self, algorithm: str, platform: str, device_kind: str) -> Any:
        """Tuned configs this plugin ships for ``algorithm`` on ``platform`` and a device model.

        ``device_kind`` is jax's device model name (``"NVIDIA H100 80GB HBM3"``). Return None or a mapping
        ``{signature: config}``: ``signature`` is :attr:`ejkernel.ops.Invocation.signature` (the abstract
        call: array shapes/dtypes and static arguments, free of kernel, device and jax versions, so a file
        of them survives upgrades), or ``"*"`` for every call of this algorithm on this device. ``config``
        is a config object or its typed JSON (:func:`ejkernel.ops.to_json`). ``ejkernel cache export
        --shipped`` writes such a table from a tuned cache. Called at most once per (algorithm, platform,
        device kind), only when a config is needed; must not compile anything.
        """
