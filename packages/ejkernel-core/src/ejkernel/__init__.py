"""ejkernel: attention and friends for JAX, with backends shipped as plugins.

``import ejkernel`` discovers the installed backend plugins (cheaply: implementations are registered by
import path and loaded on first call). The heavy parts -- ``ejkernel.modules`` (operations),
``ejkernel.ops`` (execution framework) and ``ejkernel.testing`` -- load on first attribute access.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from ejkernel.errors import (
    EjkernelError,
    EjkernelRuntimeError,
    KernelNotFoundError,
    PluginError,
    UnsupportedFeature,
)
from ejkernel.kernels import Backend, KernelRegistry, KernelSpec, Platform, kernel_registry
from ejkernel.modules.operations._contract import Implementation, NoConfig, array_field, canonical_call
from ejkernel.plugins import BackendInfo, hookimpl

try:
    __version__ = _dist_version("ejkernel-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

_LAZY_SUBMODULES = ("modules", "ops", "testing", "cli")

__all__ = [
    "Backend",
    "BackendInfo",
    "EjkernelError",
    "EjkernelRuntimeError",
    "Implementation",
    "KernelNotFoundError",
    "KernelRegistry",
    "KernelSpec",
    "NoConfig",
    "Platform",
    "PluginError",
    "UnsupportedFeature",
    "__version__",
    "array_field",
    "canonical_call",
    "hookimpl",
    "kernel_registry",
    *_LAZY_SUBMODULES,
]


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"ejkernel.{name}")
    raise AttributeError(f"module 'ejkernel' has no attribute {name!r}")


def _discover_plugins() -> None:
    from ejkernel.plugins import discover

    discover()


_discover_plugins()
