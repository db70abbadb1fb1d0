"""Base class of the public operations: a :class:`~ejkernel.ops.Kernel` whose implementations live in
the kernel registry, one per platform, contributed by backend plugins.

An operation subclass states its algorithm name and turns the public arguments into its frozen canonical
call (see ``_contract``); this class resolves the platform (``_dispatch.resolve``) in ``prepare`` -- so the
executor's cache key holds the chosen platform -- and forwards the heuristic config, the autotuning
candidates and the call to that implementation (an :class:`Implementation`).

**The keywords appear once per operation: in its public function's signature.** An operation is written

    class MyOp(RegistryOperation):
        algorithm = "my_op"

        def canonicalize(self, args: Arguments) -> MyOpCall:   # args.x, args.scale, ... (defaults applied)
            check_array("x", args.x, rank=2)
            return args.build(MyOpCall, scale=resolve_scale(args.scale, args.x))  # other fields as given

    @public_function(MyOp)   # type-checked; MyOp.signature := my_op's signature less platform and cfg
    def my_op(x, scale=None, *, platform="auto", cfg=None):
        return execute(MyOp(), **locals())

``MyOp().validate(*args, **kwargs)`` (what the executor, other operations and tests call) binds the
arguments to that signature, applies its defaults and passes them to ``canonicalize`` as one
:class:`Arguments`; an operation built on another one forwards them whole
(``Other().validate(**args)``). An operation that still overrides ``validate`` with its own keyword list
keeps working; adopting the mechanism means renaming it ``canonicalize(self, args)``, reading ``args.<name>``
and decorating the public function with ``@public_function(Op)`` instead of ``@typechecked``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from ejkernel.errors import KernelNotFoundError
from ejkernel.kernels._registry import KernelSpec, current_backend, kernel_registry
from ejkernel.modules.operations._contract import is_canonical_call
from ejkernel.modules.operations._dispatch import Resolution, _optional_attribute, resolve
from ejkernel.modules.operations._validation import typechecked
from ejkernel.ops import Kernel


F = TypeVar("F", bound=Callable)
CallT = TypeVar("CallT")

_DISPATCH_PARAMETERS = ("platform", "cfg")
"""Parameters of every public function that choose the implementation; no part of the canonical call."""


class Arguments(Mapping[str, Any]):
    """A public call's arguments by name, every default applied: read ``args.name`` (or ``args["name"]``);
    ``Other().validate(**args)`` forwards them all."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no argument {name!r} (arguments: {', '.join(self._values)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Arguments are read-only; pass normalized values to build()")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Arguments({', '.join(self._values)})"

    def without(self, *names: str) -> dict[str, Any]:
        """The arguments less ``names`` (to forward to an operation that lacks them)."""
        return {name: value for name, value in self._values.items() if name not in names}

    def build(self, call_type: type[CallT], /, **normalized: Any) -> CallT:
        """``call_type`` from ``normalized`` for the fields given there and the arguments as passed for the
        others (a field that is neither is a TypeError: the operation forgot to normalize it)."""
        values = {}
        for field in dataclasses.fields(call_type):
            if field.name in normalized:
                values[field.name] = normalized.pop(field.name)
            elif field.name in self._values:
                values[field.name] = self._values[field.name]
            else:
                raise TypeError(f"{call_type.__name__}.{field.name} is neither an argument nor normalized")
        if normalized:
            raise TypeError(f"{call_type.__name__} has no field(s) {', '.join(normalized)}")
        return call_type(**values)


def public_function(operation: type[RegistryOperation]) -> Callable[[F], F]:
    """Declare the decorated function the public function of ``operation``: its signature, less
    ``platform`` and ``cfg``, becomes ``operation.signature``, the one list of the operation's arguments
    that ``operation.validate`` binds every call to (see the module docstring). Returns the function
    :func:`~ejkernel.modules.operations._validation.typechecked` (its annotations checked on every call)."""

    def declare(function: F) -> F:
        signature = inspect.signature(function)
        # positional-only ones stay so in the public function; the body forwards every argument by name
        parameters = [
            p.replace(kind=p.POSITIONAL_OR_KEYWORD) if p.kind is p.POSITIONAL_ONLY else p
            for name, p in signature.parameters.items()
            if name not in _DISPATCH_PARAMETERS
        ]
        operation.signature = _Signature(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))
        return typechecked(function)

    return declare


class _Signature:
    """A public signature and a binder for it: ``inspect.Signature.bind`` + ``apply_defaults`` costs tens of
    microseconds per eager call; this does the same checks in a few."""

    def __init__(self, signature: inspect.Signature) -> None:
        params = list(signature.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise TypeError(f"a public function lists its parameters (no *args/**kwargs): {signature}")
        self.signature = signature
        self.positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.names = frozenset(p.name for p in params if p.kind is not p.POSITIONAL_ONLY)
        self.required = tuple(p.name for p in params if p.default is p.empty)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The arguments by name, in no particular order, every default applied (TypeError like Python's)."""
        if len(args) > len(self.positional):
            raise TypeError(f"takes {len(self.positional)} positional arguments but {len(args)} were given")
        values = {**self.defaults, **dict(zip(self.positional, args))}
        for name, value in kwargs.items():
            if name not in self.names:
                raise TypeError(f"got an unexpected keyword argument {name!r}")
            if name in self.positional[: len(args)]:
                raise TypeError(f"got multiple values for argument {name!r}")
            values[name] = value
        missing = [name for name in self.required if name not in values]
        if missing:
            raise TypeError(f"missing required argument(s) {', '.join(map(repr, missing))}")
        return values

    def __repr__(self) -> str:
        return str(self.signature)


class RegistryOperation(Kernel):
    """An operation dispatched through ``kernel_registry`` (see the module docstring)."""

    algorithm: ClassVar[str]
    signature: ClassVar[_Signature | None] = None
    """The public function's parameters, less platform/cfg (set by :func:`public_function`)."""

    def __init__(self) -> None:
        super().__init__(name=self.algorithm)

    # ---- to override -----------------------------------------------------------------------
    def canonicalize(self, args: Arguments) -> Any:
        """Check and normalize ``args`` (ValueError naming the argument); return the canonical call."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement canonicalize(args)")

    def validate(self, *args, **kwargs) -> Any:
        """The canonical call of the public call ``(*args, **kwargs)`` (the public function's arguments,
        less ``platform``/``cfg``): bound to :attr:`signature`, defaults applied, then :meth:`canonicalize`."""
        signature = type(self).signature
        if signature is None:
            raise NotImplementedError(
                f"{type(self).__qualname__} has no signature: decorate its public function with @public_function"
            )
        try:
            arguments = signature.bind(args, kwargs)
        except TypeError as error:
            raise TypeError(f"{self.algorithm}: {error}") from None
        return self.canonicalize(Arguments(arguments))

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
