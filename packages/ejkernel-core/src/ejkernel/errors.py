"""Exceptions shared by core and every backend plugin.

Backends raise :class:`UnsupportedFeature` for a call they cannot take (a feature, dtype or shape they
do not implement). The dispatcher treats it as "try the next implementation", so an automatic
platform choice falls back instead of failing, and an explicit ``platform=`` gets a clear error.
"""

from __future__ import annotations


class EjkernelError(Exception):
    """Base class of every error ejkernel raises on purpose."""


class UnsupportedFeature(EjkernelError, NotImplementedError):
    """An implementation cannot take this call; the dispatcher may fall back to another one.

    Raise it before compiling anything (at trace time, from shapes, dtypes and static arguments).
    """


class KernelNotFoundError(EjkernelError, ValueError):
    """No registered implementation matches the requested algorithm/platform/backend."""


class EjkernelRuntimeError(EjkernelError, RuntimeError):
    """A kernel failed while running for a reason the caller cannot fix by changing arguments."""


class PluginError(EjkernelError):
    """A backend plugin failed to load, failed its requirements, or raised in a hook."""
