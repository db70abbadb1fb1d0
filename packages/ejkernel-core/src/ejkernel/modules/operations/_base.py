"""Base class of the public operations: a :class:`~ejkernel.ops.Kernel` whose implementations live in
the kernel registry, one per platform, contributed by backend plugins.

An operation subclass states its algorithm name and validates/normalizes arguments in ``validate``; this
class resolves the platform (``_dispatch.resolve``) in ``prepare`` -- so the executor's cache key holds the
chosen platform -- and forwards heuristics, the autotuning space and the call to that implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ejkernel.errors import KernelNotFoundError
from ejkernel.kernels._registry import KernelSpec, current_backend, kernel_registry
from ejkernel.modules.operations._dispatch import Resolution, _optional_attribute, resolve
from ejkernel.ops import Kernel


class RegistryOperation(Kernel):
    """An operation dispatched through ``kernel_registry`` (see the module docstring)."""

    algorithm: ClassVar[str]
    config_type: ClassVar[type | None] = None
    """Frozen dataclass of the operation's configs; its default instance is the fallback heuristic."""

    def __init__(self) -> None:
        super().__init__(name=self.algorithm)

    # ---- to override -----------------------------------------------------------------------
    def validate(self, *args, **kwargs) -> tuple[tuple, dict]:
        """Check and normalize the arguments (ValueError naming the argument); return them."""
        return args, kwargs

    # ---- executor hooks --------------------------------------------------------------------
    def prepare(self, *args, platform: Any = "auto", **kwargs) -> tuple[tuple, dict]:
        args, kwargs = self.validate(*args, **kwargs)
        resolution = resolve(self.algorithm, platform, args, kwargs)
        return args, {**kwargs, "platform": resolution.platform, "provider": resolution.spec.plugin or ""}

    def explain(self, *args, platform: Any = "auto", **kwargs) -> Resolution:
        """Which implementation would run this call here, and why better-ranked ones were passed over."""
        args, kwargs = self.validate(*args, **kwargs)
        return resolve(self.algorithm, platform, args, kwargs)

    def spec_for(self, platform: str, provider: str = "") -> KernelSpec:
        """The registered implementation ``prepare`` chose (by platform and providing plugin)."""
        for spec in kernel_registry.find(self.algorithm, platform, current_backend()) or kernel_registry.find(
            self.algorithm, platform, None
        ):
            if (spec.plugin or "") == provider:
                return spec
        raise KernelNotFoundError(f"{self.algorithm}: implementation {platform!r} from {provider or 'core'!r} vanished")

    def _implementation(self, kwargs: dict) -> Callable:
        return self.spec_for(kwargs["platform"], kwargs.get("provider", "")).implementation

    def heuristic_cfg(self, inv) -> Any:
        hook = _optional_attribute(self._implementation(inv.kwargs), "heuristic_cfg")
        if hook is not None:
            return hook(inv)
        return self.config_type() if self.config_type is not None else None

    def config_space(self, inv) -> list:
        hook = _optional_attribute(self._implementation(inv.kwargs), "config_space")
        return list(hook(inv)) if hook is not None else []

    def run(self, *args, cfg: Any = None, platform: str, provider: str = "", **kwargs) -> Any:
        return self.spec_for(platform, provider).implementation(*args, cfg=cfg, **kwargs)


def execute(operation: RegistryOperation, *args, **kwargs) -> Any:
    """Run ``operation`` through the process-wide default executor (what public functions call)."""
    from ejkernel.ops import get_default_executor

    return get_default_executor()(operation, *args, **kwargs)
