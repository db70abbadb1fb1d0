"""Type variables of the kernel framework."""

from __future__ import annotations

from typing import TypeVar

Cfg = TypeVar("Cfg")
"""A kernel's configuration type (a frozen dataclass such as ``KernelConfig``)."""
Out = TypeVar("Out")
"""A kernel's output type (an array or a pytree of arrays)."""

__all__ = ["Cfg", "Out"]
