"""Shared configuration of kernel modules, platform detection, and the (deprecated) default executor."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

from ejkernel.errors import KernelNotFoundError
from ejkernel.kernels._registry import Backend, Platform, _as_backend, _as_platform, current_backend, kernel_registry

PlatformName = Platform | Literal["triton", "pallas", "cuda", "xla", "auto"]
BackendName = Backend | Literal["gpu", "tpu", "cpu", "any"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch parameters shared by kernel modules (see the spec for each field)."""

    block_q: int = 128
    block_k: int = 128
    block_d: int = 64
    num_warps: int = 4
    num_stages: int = 2
    platform: PlatformName = "auto"
    backend: BackendName = Backend.ANY
    algorithm: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k", "block_d", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        if self.platform != "auto":
            _as_platform(self.platform, argument="KernelConfig.platform")
        _as_backend(self.backend, argument="KernelConfig.backend")


def detect_platform(algorithm: str, platform: PlatformName | None = "auto", maybe_pallas: bool = False) -> Platform:
    """The platform that would run ``algorithm`` here.

    An explicit platform is returned if it is registered for the algorithm (else ``ValueError``). With
    ``"auto"`` it is the best-ranked registered platform for the current hardware whose backend plugin is
    installed and usable on this machine. ``maybe_pallas`` prefers Pallas over Triton on GPUs.
    """
    from ejkernel.modules.operations._dispatch import _candidates, _unusable_reason

    requested = _as_platform(platform)
    if requested is not None:
        if not kernel_registry.find(algorithm, requested):
            registered = sorted({s.platform.value for s in kernel_registry.list_implementations(algorithm)})
            raise KernelNotFoundError(
                f"platform {requested.value!r} is not available for {algorithm!r}; registered: {registered or 'none'}"
            )
        return requested
    # the dispatcher's candidates and usability; without a call, their registered priorities rank them
    usable = [spec for spec in _candidates(algorithm, None, current_backend()) if _unusable_reason(spec) is None]
    if not usable:
        raise KernelNotFoundError(
            f"no usable implementation of {algorithm!r} for {current_backend().value}; "
            f"registered: {[f'{s.platform.value}/{s.backend.value}' for s in kernel_registry.list_implementations(algorithm)]}"
        )
    if maybe_pallas:
        for spec in usable:
            if spec.platform == Platform.PALLAS:
                return spec.platform
    return usable[0].platform


def create_default_executor(
    persistent_cache_path: str | None = None,
    enable_autotuning: bool = True,
    warmup_iterations: int = 2,
    timing_iterations: int = 5,
):
    """Deprecated: build ``Executor(ConfigSelectorChain(...))`` directly (see the spec's example)."""
    warnings.warn(
        "create_default_executor() is deprecated; build Executor(ConfigSelectorChain(cache=ConfigCache(), "
        "policy=AutotunePolicy(...), tuner=Tuner(...), persistent=PersistentCache(path))) instead",
        DeprecationWarning,
        stacklevel=2,
    )
    from ejkernel.ops import AutotunePolicy, ConfigCache, ConfigSelectorChain, Executor, PersistentCache, Tuner

    return Executor(
        ConfigSelectorChain(
            cache=ConfigCache(),
            policy=AutotunePolicy(allow_autotune=enable_autotuning),
            tuner=Tuner(warmup=warmup_iterations, iters=timing_iterations),
            persistent=PersistentCache(persistent_cache_path) if persistent_cache_path else None,
        )
    )
