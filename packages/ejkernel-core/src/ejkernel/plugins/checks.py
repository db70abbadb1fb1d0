"""Small availability checks that backend plugins compose in ``BackendInfo.check_usable``.

Each returns a human-readable reason when the requirement is not met, or None when it is. They import
nothing heavy unless asked to look at devices.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re


def missing_module(module: str, distribution: str | None = None) -> str | None:
    """``"triton is not installed"`` when ``module`` cannot be imported (without importing it)."""
    if importlib.util.find_spec(module) is None:
        return f"{distribution or module} is not installed"
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:4])


def version_below(distribution: str, minimum: str) -> str | None:
    """``"jax-triton 0.2.0 < 0.3.1 required"`` when the installed version is older than ``minimum``."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} is not installed"
    if _version_tuple(installed) < _version_tuple(minimum):
        return f"{distribution} {installed} < {minimum} required"
    return None


def no_device(*kinds: str) -> str | None:
    """``"no GPU visible"`` when jax sees no device of any of ``kinds`` (``"gpu"``, ``"tpu"``)."""
    import jax

    for kind in kinds:
        try:
            if jax.devices(kind):
                return None
        except RuntimeError:
            continue
    return "no " + " or ".join(k.upper() for k in kinds) + " visible"


def first_reason(*checks) -> str | None:
    """Run zero-argument checks in order; return the first reason found."""
    for check in checks:
        reason = check()
        if reason:
            return reason
    return None


def distribution_version(distribution: str) -> str:
    """Installed version of ``distribution``; ``"0.0.0+unknown"`` when running from an uninstalled tree."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


UNVERIFIED_ENV = "EJKERNEL_UNVERIFIED_KERNELS"


def unverified_requested() -> bool:
    """Whether kernels no GPU run has checked yet should be registered (``EJKERNEL_UNVERIFIED_KERNELS=1``:
    the device run that verifies them, ``scripts/device/gpu_tests.sh``). A backend keeps them in a separate
    mapping and registers them only then, so a user never gets an unchecked kernel."""
    import os

    return os.environ.get(UNVERIFIED_ENV, "0") not in ("", "0")

