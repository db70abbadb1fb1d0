"""Base class of the public operations: a :class:`~ejkernel.ops.Kernel` whose implementations live in
the kernel registry, one per platform, contributed by backend plugins.

An operation subclass states its algorithm name and turns the public keywords into its frozen canonical
call in ``validate`` (see ``_contract``); this class resolves the platform (``_dispatch.resolve``) in
``prepare`` -- so the executor's cache key holds the chosen platform -- and forwards the heuristic config,
the autotuning candidates and the call to that implementation (an :class:`Implementation`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ejkernel.errors import KernelNotFoundError
from ejkernel.kernels._registry import KernelSpec, current_backend, kernel_registry
from ejkernel.modules.operations._contract import is_canonical_call
from ejkernel.modules.operations._dispatch import Resolution, _optional_attribute, resolve
from ejkernel.ops import Kernel


class RegistryOperation(Kernel):
    """An operation dispatched through ``kernel_registry`` (see the module docstring)."""

    algorithm: ClassVar[str]

    def __init__(self) -> None:
        super().__init__(name=self.algorithm)

    # ---- to override -----------------------------------------------------------------------
    def validate(self, *args, **kwargs) -> Any:
        """Check and normalize the arguments (ValueError naming the argument); return the canonical call."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement validate()")

    def _call(self, args: tuple, kwargs: dict) -> Any:
        call = self.validate(*args, **kwargs)
        if not is_canonical_call(call):
            raise TypeError(f"{type(self).__qualname__}.validate must return a canonical call, got {type(call).__name__}")
        return call

    # ---- executor hooks --------------------------------------------------------------------
    def prepare(self, *args, platform: Any = "auto", **kwargs) -> tuple[tuple, dict]:
        call = self._call(args, kwargs)
        resolution = resolve(self.algorithm, platform, call)
        return (call,), {"platform": resolution.platform, "provider": resolution.spec.plugin or ""}

    def explain(self, *args, platform: Any = "auto", **kwargs) -> Resolution:
        """Which implementation would run this call here, and why better-ranked ones were passed over."""
        return resolve(self.algorithm, platform, self._call(args, kwargs))

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
        (call,) = inv.args
        return self._implementation(inv.kwargs).heuristic_config(call)

    def config_space(self, inv) -> list:
        (call,) = inv.args
        return list(self._implementation(inv.kwargs).candidate_configs(call))

    def run(self, call: Any, *, cfg: Any = None, platform: str, provider: str = "") -> Any:
        implementation = self.spec_for(platform, provider).implementation
        config_type = implementation.config_type
        if not isinstance(cfg, config_type):
            raise TypeError(
                f"{self.algorithm}: cfg must be a {config_type.__module__}.{config_type.__qualname__} for "
                f"platform={platform!r}, got {cfg!r}"
            )
        return implementation(call, cfg)


def execute(operation: RegistryOperation, /, *args, platform: Any = "auto", cfg: Any = None, **kwargs) -> Any:
    """Run ``operation`` through the process-wide default executor (what public functions call).

    A public function's signature is the only place its operation's keywords are spelled out: its body is
    ``return execute(Op(), **locals())`` (after ``del``-eting parameters kept only for compatibility), so
    every parameter reaches ``Op.validate`` by name, and ``platform``/``cfg`` land here.
    A ``cfg`` is one implementation's config type: with ``platform="auto"`` it picks that implementation.
    """
    from ejkernel.ops import get_default_executor

    if cfg is not None and (platform is None or platform == "auto"):
        platform = platform_of_config(operation.algorithm, cfg)
    return get_default_executor()(operation, *args, platform=platform, cfg=cfg, **kwargs)


def platform_of_config(algorithm: str, cfg: Any) -> str:
    """The platform of the implementation of ``algorithm`` whose config type ``cfg`` is."""
    for spec in kernel_registry.list_implementations(algorithm):
        try:
            config_type = _optional_attribute(spec.implementation, "config_type")
        except Exception:  # noqa: BLE001 -- a plugin that fails to import is reported at dispatch
            continue
        if config_type is not None and type(cfg) is config_type:
            return spec.platform.value
    raise TypeError(
        f"{algorithm}: cfg {cfg!r} is no registered implementation's config type; pass the config of the "
        "implementation you want (e.g. ejkernel_xla.flash_attention.XlaFlashConfig for platform='xla')"
    )
