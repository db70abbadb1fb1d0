"""``Invocation``: one call of a kernel, as config selection sees it, and the cache key naming it.

:attr:`Invocation.cache_key` names a call by everything a config may depend on -- kernel name and
version, abstract shapes/dtypes and static arguments (never array values), the device fingerprint -- and
nothing else, so the same call in another process gets the same key. An argument is an array when it has
a ``shape`` and a ``dtype``; everything else is static and keyed by value.

The executor, the tuner and the recording table only need a kernel's protocol (``name``, ``version``,
``run``, ``heuristic_cfg``, ``config_space``, optionally ``prepare``/``custom_vjp``/``run_<platform>``),
not the :class:`~ejkernel.ops.Kernel` base class, which sits above them (its ``__call__`` uses the default
executor).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Generic

from ejkernel.ops.core.types import Cfg, Out
from ejkernel.ops.utils.fingerprint import device_fingerprint, get_device_platform, sharding_fingerprint
from ejkernel.ops.utils.serialize import stable_json

__all__ = [
    "Invocation",
    "call_identity",
    "default_key_builder_with_sharding",
    "explicit_platform",
    "is_array_like",
    "is_inexact",
    "require_kernel",
]


def is_array_like(value: Any) -> bool:
    """Arrays, tracers and ``ShapeDtypeStruct``s: anything with a ``shape`` and a ``dtype``."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def is_inexact(dtype: Any) -> bool:
    """Floating or complex, bfloat16 and fp8 included (numpy alone does not know those are floats)."""
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.inexact))


def require_kernel(value: Any, caller: str) -> None:
    """TypeError unless ``value`` implements the kernel protocol (``run`` and ``heuristic_cfg``)."""
    if not (callable(getattr(value, "run", None)) and callable(getattr(value, "heuristic_cfg", None))):
        raise TypeError(f"{caller} expects a Kernel as first argument, got {type(value).__name__}")


class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: its arguments and what config selection derives from them.

    ``args``/``kwargs`` hold what the caller passed (concrete arrays, tracers, or ``ShapeDtypeStruct``s
    for recorded calls). Everything derived is computed on first use and kept.
    """

    __slots__ = ("_key", "_signature", "args", "device", "include_sharding", "kernel", "kwargs", "metadata")

    def __init__(
        self,
        kernel: Any,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        include_sharding: bool | None = None,
        device: Any = None,
    ):
        name = getattr(kernel, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"kernel must be a Kernel with a non-empty name, got {kernel!r} "
                "(did the subclass forget super().__init__(name=...)?)"
            )
        if not isinstance(args, tuple):
            raise TypeError(f"Invocation args must be a tuple, got {type(args).__name__}")
        self.kernel = kernel
        self.args = args
        self.kwargs = dict(kwargs) if kwargs is not None else {}
        self.metadata = dict(metadata) if metadata is not None else {}
        if include_sharding is None:
            include_sharding = getattr(kernel, "key_includes_sharding", False)
        self.include_sharding = include_sharding
        self.device = device
        self._signature: str | None = None
        self._key: str | None = None

    @property
    def abstract_args(self) -> tuple:
        """``args`` with every array replaced by a ``jax.ShapeDtypeStruct`` (other leaves unchanged)."""
        return _abstractify(self.args)

    @property
    def abstract_kwargs(self) -> dict[str, Any]:
        """``kwargs`` with array values replaced by ``jax.ShapeDtypeStruct``s."""
        return {k: _abstractify(v) for k, v in self.kwargs.items()}

    @classmethod
    def _of_call(cls, kernel: Any, args: tuple, kwargs: dict) -> Invocation:
        """The executor's constructor: takes ownership of ``kwargs``, skips checks done by the caller."""
        inv = cls.__new__(cls)
        inv.kernel, inv.args, inv.kwargs, inv.metadata = kernel, args, kwargs, {}
        inv.include_sharding, inv.device = getattr(kernel, "key_includes_sharding", False), None
        inv._signature = inv._key = None
        return inv

    @property
    def device_fingerprint(self) -> str:
        return device_fingerprint(self.device)

    @property
    def platform(self) -> str:
        """The platform this call runs on: an explicit ``platform=`` keyword, else the device's default."""
        explicit = explicit_platform(self.kwargs)
        return explicit if explicit is not None else get_device_platform(self.device)

    @property
    def signature(self) -> str:
        """The abstract call: shapes/dtypes of arrays, values of static arguments. Device-independent."""
        if self._signature is None:
            sharding = self.include_sharding
            positional = ",".join([_describe(arg, sharding) for arg in self.args])
            named = [
                f"{name}={_describe(self.kwargs[name], sharding)}"
                for name in (sorted(self.kwargs) if len(self.kwargs) > 1 else self.kwargs)
            ]
            self._signature = f"({positional}){{{','.join(named)}}}"
        return self._signature

    @property
    def cache_key(self) -> str:
        """``"<kernel>@<version>|<device fingerprint>|<signature>"``: stable across processes."""
        if self._key is None:
            try:
                name = self.kernel.name
            except AttributeError:
                raise TypeError(
                    f"{type(self.kernel).__qualname__} has no name: its __init__ must call super().__init__(name=...)"
                ) from None
            self._key = f"{name}@{self.kernel.version}|{self.device_fingerprint}|{self.signature}"
        return self._key

    def abstracted(self) -> Invocation[Cfg, Out]:
        """A copy holding ``ShapeDtypeStruct``s instead of arrays (safe to keep: pins no memory)."""
        inv = Invocation(
            self.kernel,
            self.abstract_args,
            self.abstract_kwargs,
            self.metadata,
            include_sharding=self.include_sharding,
            device=self.device,
        )
        inv._signature, inv._key = self._signature, self._key
        return inv

    def __repr__(self) -> str:
        return f"Invocation({self.kernel.name!r}, {self.signature})"


def explicit_platform(kwargs: Mapping[str, Any]) -> str | None:
    """The concrete ``platform=`` keyword of a call (``"triton"``), or None when absent or ``"auto"``."""
    value = kwargs.get("platform")
    if value is None:
        return None
    value = str(getattr(value, "value", value))
    return None if value == "auto" else value


# ---- abstract descriptions ------------------------------------------------------------------------
_dtype_names: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    # numpy computes ``dtype.name`` on every access (microseconds); the cache makes keys cheap.
    try:
        return _dtype_names[dtype]
    except KeyError:
        import numpy as np

        name = np.dtype(dtype).name
        _dtype_names[dtype] = name
        return name
    except TypeError:  # unhashable dtype-like
        return str(dtype)


_array_types: set[type] = set()
_array_texts: dict[tuple, str] = {}


def _describe(value: Any, include_sharding: bool = False) -> str:
    """Deterministic text of a (pytree) argument: arrays by shape/dtype, the rest by value."""
    kind = type(value)
    if kind in _SCALARS:
        return _describe_static(value)
    if kind in _array_types or (is_array_like(value) and not _array_types.add(kind)):
        # Memoized per (dtype, shape): building the text dominates the executor's per-call cost.
        signature = (value.dtype, value.shape)
        try:
            text = _array_texts[signature]
        except KeyError:
            text = f"{_dtype_name(value.dtype)}[{','.join(map(str, value.shape))}]"
            if len(_array_texts) < 4096:
                _array_texts[signature] = text
        except TypeError:  # unhashable dtype/shape objects
            text = f"{_dtype_name(value.dtype)}[{','.join(map(str, value.shape))}]"
        if include_sharding:
            sharding = sharding_fingerprint(value)
            if sharding is not None:
                text += "@" + sharding
        return text
    if isinstance(value, (tuple, list)):
        open_, close = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        return open_ + ",".join(_describe(v, include_sharding) for v in value) + close
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ",".join(f"{k}={_describe(value[k], include_sharding)}" for k in sorted(value)) + "}"
    if getattr(kind, "__ejkernel_call__", False):  # an operation's canonical call: every field by name
        return f"{kind.__qualname__}(" + ",".join(
            f"{name}={_describe(getattr(value, name), include_sharding)}" for name in kind.__dataclass_fields__
        ) + ")"
    leaves = _pytree_leaves(value)
    if leaves is not None:  # a registered pytree node (e.g. a dataclass of arrays)
        return f"{kind.__qualname__}(" + ",".join(_describe(v, include_sharding) for v in leaves) + ")"
    return _object_text(value)


_SCALARS = frozenset({type(None), bool, int, float, str})


def call_identity(kernel: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable stand-in for a simple call's cache key, or None when the call is not simple.

    Simple: every argument is an array of a type already seen or a plain scalar, and the kernel does not
    key on sharding. Two calls with equal identities have equal cache keys
    (arrays contribute dtype and shape, scalars their type and value), so the executor can memoize the
    key's text, whose construction is most of the per-call cost. Keyword order is part of the identity:
    a different order only costs a separate memo entry.
    """
    if getattr(kernel, "key_includes_sharding", False):
        return None
    parts: list[Any] = [kernel]
    add = parts.append
    for value in args:
        kind = type(value)
        if kind in _array_types:
            add(value.dtype)
            add(value.shape)
        elif kind in _SCALARS and not (kind is float and value == 0.0):  # 0.0 == -0.0, reprs differ
            add(kind)
            add(value)
        else:
            return None
    for name, value in kwargs.items():
        add(name)
        kind = type(value)
        if kind in _array_types:
            add(value.dtype)
            add(value.shape)
        elif kind in _SCALARS and not (kind is float and value == 0.0):
            add(kind)
            add(value)
        else:
            return None
    return tuple(parts)


def _pytree_leaves(value: Any) -> list | None:
    """The leaves of ``value`` if it is a pytree node holding an array; else None."""
    import jax

    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return None
    return leaves if any(is_array_like(leaf) for leaf in leaves) else None


_static_texts: dict[tuple, str] = {}


def _describe_static(value: Any) -> str:
    kind = type(value)
    if kind in _SCALARS and not (kind is float and value == 0.0):  # 0.0 == -0.0 would share a text
        try:
            return _static_texts[(kind, value)]
        except KeyError:
            text = _scalar_text(value)
            if len(_static_texts) < 4096:
                _static_texts[(kind, value)] = text
            return text
    if kind in _SCALARS:
        return _scalar_text(value)
    return _object_text(value)


def _scalar_text(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float:
        return repr(value) if math.isfinite(value) else json.dumps(value)
    return json.dumps(value)


def _object_text(value: Any) -> str:
    try:
        return stable_json(value)
    except TypeError:
        pass
    if is_array_like(value):  # an array declared static: by value
        import numpy as np

        return stable_json(np.asarray(value).tolist())
    # Callables and opaque objects: by qualified name (a repr would hold a memory address).
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"<{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}>"


def _abstractify(tree: Any) -> Any:
    import jax

    def leaf(value: Any) -> Any:
        if is_array_like(value) and not isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)
        return value

    return jax.tree_util.tree_map(leaf, tree)


def default_key_builder_with_sharding(kernel: Any, args: tuple, kwargs: dict | None = None) -> str:
    """The cache key of ``kernel(*args, **kwargs)`` including the sharding of every array argument."""
    return Invocation(kernel, tuple(args), dict(kwargs or {}), include_sharding=True).cache_key
