"""Small availability checks that backend plugins compose in ``BackendInfo.check_usable``.

Each returns a human-readable reason when the requirement is not met, or None when it is. They import
nothing heavy unless asked to look at devices.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)  # asked at every dispatch by kernels that need a GPU generation
def first_gpu():
    """This process's first local GPU (``jax.local_devices(backend="gpu")[0]``), or None: no GPU visible, or
    no GPU plugin. Looked up once: the devices do not change under a process."""
    import jax

    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:  # JAX_PLATFORMS without a GPU, or no CUDA plugin
        return None
    return devices[0] if devices else None


def gpu_compute_capability() -> str | None:
    """``"9.0"`` (say) of :func:`first_gpu`, ``"unknown"`` where the device does not tell, None without one."""
    device = first_gpu()
    return None if device is None else str(getattr(device, "compute_capability", "unknown"))


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

