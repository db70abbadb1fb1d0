"""Device and sharding fingerprints: the parts of a cache key that describe where a kernel runs.

A config tuned on one GPU model, or under another jax/jaxlib/driver version, may be wrong or slow
elsewhere, so the device fingerprint names the device kind, the platform and those versions. It is a
plain string, identical in every process on the same machine and software.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

__all__ = [
    "device_fingerprint",
    "device_kind",
    "device_model",
    "get_device_platform",
    "sharding_fingerprint",
]

_PLATFORM_OF_KIND = {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}


def _device(device: Any = None) -> Any:
    if device is not None:
        return device
    return _default_device()


@functools.cache
def _default_device() -> Any:
    import jax

    return jax.devices()[0]


def device_kind(device: Any = None) -> str:
    """The hardware family of ``device`` (default: jax's first device): ``"gpu"``, ``"tpu"`` or ``"cpu"``."""
    platform = _device(device).platform.lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform == "tpu":
        return "tpu"
    return "cpu"


def device_model(device: Any = None) -> str:
    """The exact device model as jax names it (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``)."""
    return str(getattr(_device(device), "device_kind", device_kind(device)))


def get_device_platform(device: Any = None) -> str:
    """The kernel platform preferred on ``device``: ``"triton"`` (GPU), ``"pallas"`` (TPU) or ``"xla"``."""
    if device is None:
        platform = _defaults.get("platform")
        if platform is None:
            platform = _defaults["platform"] = _PLATFORM_OF_KIND[device_kind()]
        return platform
    return _PLATFORM_OF_KIND[device_kind(device)]


@functools.cache
def _fingerprint_of(device: Any) -> str:
    import jax
    import jaxlib

    try:
        backend_version = str(device.client.platform_version)
    except Exception:  # some PJRT plugins do not expose it
        backend_version = "unknown"
    parts = (
        f"kind={device_kind(device)}",
        f"model={device_model(device)}",
        f"platform={device.platform}",
        f"jax={jax.__version__}",
        f"jaxlib={jaxlib.__version__}",
        f"backend={backend_version}",
    )
    return "|".join(part.replace("|", "/") for part in parts)


def device_fingerprint(device: Any = None) -> str:
    """A stable string naming the device model, platform and jax/jaxlib/backend versions.

    ``"kind=gpu|model=NVIDIA H100 80GB HBM3|platform=gpu|jax=0.11.2|jaxlib=0.11.2|backend=cuda 12080"``
    """
    if device is None:  # the per-call path: one dict lookup
        fingerprint = _defaults.get("fingerprint")
        if fingerprint is None:
            fingerprint = _defaults["fingerprint"] = _fingerprint_of(_default_device())
        return fingerprint
    return _fingerprint_of(device)


_defaults: dict[str, str] = {}


def sharding_fingerprint(array: Any) -> str | None:
    """A stable description of how ``array`` is laid out over devices; None when it lives on one device.

    Tracers and abstract values (no concrete sharding) give None: inside ``jit`` the layout is decided
    by the caller's shardings, which the outer program already keys on.
    """
    sharding = getattr(array, "sharding", None)
    if sharding is None or isinstance(array, _abstract_types()):
        return None
    try:
        if len(sharding.device_set) <= 1:
            return None
    except Exception:
        return None
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        axes = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
        return f"mesh({axes})spec{tuple(spec)!r}"
    # Other shardings: describe by their per-device index map (stable, independent of device ids).
    indices = sharding.devices_indices_map(tuple(array.shape))
    layout = sorted(repr(index) for index in indices.values())
    return f"{type(sharding).__name__}:{hashlib.sha256(repr(layout).encode()).hexdigest()[:16]}"


@functools.cache
def _abstract_types() -> tuple[type, ...]:
    import jax

    return (jax.core.Tracer, jax.ShapeDtypeStruct)

