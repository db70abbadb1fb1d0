"""Kernel registry: platforms, backends and the process-wide ``kernel_registry``."""

from ejkernel.kernels._registry import (
    Backend,
    KernelRegistry,
    KernelSpec,
    LazyImplementation,
    Platform,
    current_backend,
    declare_platform,
    kernel_registry,
)

__all__ = [
    "Backend",
    "KernelRegistry",
    "KernelSpec",
    "LazyImplementation",
    "Platform",
    "current_backend",
    "declare_platform",
    "kernel_registry",
]
