"""``Kernel`` (an operation with configs) and ``Invocation`` (one call of it, as config selection sees it).

A kernel implements ``run`` (and optionally ``run_<platform>``), proposes a default config
(``heuristic_cfg``) and candidates for autotuning (``config_space``). The executor turns a call into an
:class:`Invocation`, whose :attr:`Invocation.cache_key` names the call by everything a config may depend
on -- kernel name and version, abstract shapes/dtypes and static arguments (never array values), the
device fingerprint -- and nothing else, so the same call in another process gets the same key.

Custom gradients, either form (both compose with ``jit``, ``grad`` and ``vmap``):

* ``custom_vjp(self, primals, cfg, kwargs, cotangents) -> grads``: the forward is ``run``; ``primals``
  are the positional arguments, ``cotangents`` a tuple (one entry per output of a tuple output, else one).
* ``fwd_with_residuals(self, *args, cfg, **kwargs) -> (out, residuals)`` with
  ``vjp(self, residuals, cotangent, *, cfg, **static_kwargs) -> grads``: ``cotangent`` has the output's
  structure; ``vjp`` receives the static (non-array) keyword arguments only.

``grads`` is a tuple with one entry per positional argument (None for "no gradient"). Keyword array
arguments get no gradient: pass differentiable inputs positionally. A kernel with neither form is
differentiated by JAX through ``run`` (implementations usually carry their own ``jax.custom_vjp``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Generic

from ejkernel.ops.core.types import Cfg, Out
from ejkernel.ops.utils.fingerprint import device_fingerprint, get_device_platform
from ejkernel.ops.utils.serialize import stable_json

__all__ = ["Invocation", "Kernel", "is_array_like", "is_inexact"]


def is_array_like(value: Any) -> bool:
    """Arrays, tracers and ``ShapeDtypeStruct``s: anything with a ``shape`` and a ``dtype``."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def is_inexact(dtype: Any) -> bool:
    """Floating or complex, bfloat16 and fp8 included (numpy alone does not know those are floats)."""
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.inexact))


class Kernel(Generic[Cfg, Out]):
    """Base class of a configurable operation. Subclass it and implement ``run`` and ``heuristic_cfg``.

    Class attributes a subclass may set:

    * ``version``: part of the cache key; bump it when configs tuned for an older implementation no
      longer apply.
    * ``static_argnames``: keyword arguments that are static even when they look like arrays (they go
      into the cache key by value).
    * ``array_argnames``: keyword arguments that are dynamic even when they are plain Python values
      (kept out of the key by value, traced through the custom VJP).
    * ``key_includes_sharding``: put the layout of arrays spread over several devices into the cache key
      (for kernels whose best config depends on it; tracers carry no layout and are keyed by shape).
    """

    version: ClassVar[str] = "1"
    static_argnames: ClassVar[tuple[str, ...]] = ()
    array_argnames: ClassVar[tuple[str, ...]] = ()
    key_includes_sharding: ClassVar[bool] = False

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"Kernel name must be a non-empty string, got {name!r}")
        self.name = name
        self.op_id = name

    # ---- what subclasses implement --------------------------------------------------------------
    def prepare(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Validate and normalize a call before anything else (resolve ``platform="auto"`` here)."""
        return args, kwargs

    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        """The implementation used when no ``run_<platform>`` matches."""
        raise NotImplementedError(f"kernel {self.name!r} ({type(self).__qualname__}) implements no run()")

    def heuristic_cfg(self, inv: Invocation[Cfg, Out]) -> Cfg:
        """The default config for this call, from shapes, dtypes and static arguments."""
        raise NotImplementedError(f"kernel {self.name!r} ({type(self).__qualname__}) implements no heuristic_cfg()")

    def config_space(self, inv: Invocation[Cfg, Out]) -> Iterable[Cfg]:
        """Candidate configs for autotuning this call (none by default: nothing to tune)."""
        return ()

    # ---- helpers ---------------------------------------------------------------------------------
    @property
    def has_custom_vjp(self) -> bool:
        """True when the kernel defines a backward (either custom-VJP form)."""
        return callable(getattr(self, "custom_vjp", None)) or (
            callable(getattr(self, "fwd_with_residuals", None)) and callable(getattr(self, "vjp", None))
        )

    def __call__(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        """Run through the process-wide default executor (:func:`ejkernel.ops.get_default_executor`)."""
        from ejkernel.ops.execution.executor import get_default_executor

        return get_default_executor()(self, *args, cfg=cfg, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(name={getattr(self, 'name', None)!r}, version={self.version!r})"


class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: its arguments and what config selection derives from them.

    ``args``/``kwargs`` hold what the caller passed (concrete arrays, tracers, or ``ShapeDtypeStruct``s
    for recorded calls). Everything derived is computed on first use and kept.
    """

    __slots__ = ("_key", "_signature", "args", "device", "include_sharding", "kernel", "kwargs", "metadata")

    def __init__(
        self,
        kernel: Kernel[Cfg, Out],
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
        self.include_sharding = kernel.key_includes_sharding if include_sharding is None else include_sharding
        self.device = device
        self._signature: str | None = None
        self._key: str | None = None

    @property
    def op_id(self) -> str:
        return self.kernel.name

    @property
    def abstract_args(self) -> tuple:
        """``args`` with every array replaced by a ``jax.ShapeDtypeStruct`` (other leaves unchanged)."""
        return _abstractify(self.args)

    @property
    def abstract_kwargs(self) -> dict[str, Any]:
        """``kwargs`` with array values replaced by ``jax.ShapeDtypeStruct``s."""
        static = set(self.kernel.static_argnames)
        return {k: (v if k in static else _abstractify(v)) for k, v in self.kwargs.items()}

    @property
    def static_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that are static: not arrays (or declared static by the kernel)."""
        static, dynamic = set(self.kernel.static_argnames), set(self.kernel.array_argnames)
        return {k: v for k, v in self.kwargs.items() if k in static or (k not in dynamic and not _has_array_leaf(v))}

    @classmethod
    def _of_call(cls, kernel: Kernel, args: tuple, kwargs: dict) -> Invocation:
        """The executor's constructor: takes ownership of ``kwargs``, skips checks done by the caller."""
        inv = cls.__new__(cls)
        inv.kernel, inv.args, inv.kwargs, inv.metadata = kernel, args, kwargs, {}
        inv.include_sharding, inv.device = kernel.key_includes_sharding, None
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
            static, dynamic = self.kernel.static_argnames, self.kernel.array_argnames  # short tuples
            sharding = self.include_sharding
            positional = ",".join([_describe(arg, sharding) for arg in self.args])
            named = []
            for name in sorted(self.kwargs) if len(self.kwargs) > 1 else self.kwargs:
                value = self.kwargs[name]
                if name in static:
                    text = _describe_static(value)
                elif name in dynamic and not _has_array_leaf(value):
                    text = f"dyn:{type(value).__name__}"
                else:
                    text = _describe(value, sharding)
                named.append(f"{name}={text}")
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

    def make_key(self) -> str:
        return self.cache_key

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
            from ejkernel.ops.utils.fingerprint import sharding_fingerprint

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


def call_identity(kernel: Kernel, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable stand-in for a simple call's cache key, or None when the call is not simple.

    Simple: every argument is an array of a type already seen or a plain scalar, and the kernel declares
    no static/array keywords and no sharding keys. Two calls with equal identities have equal cache keys
    (arrays contribute dtype and shape, scalars their type and value), so the executor can memoize the
    key's text, whose construction is most of the per-call cost. Keyword order is part of the identity:
    a different order only costs a separate memo entry.
    """
    if kernel.static_argnames or kernel.array_argnames or kernel.key_includes_sharding:
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


def _has_array_leaf(value: Any) -> bool:
    if is_array_like(value):
        return True
    if type(value) in _SCALARS:
        return False
    import jax

    return any(is_array_like(leaf) for leaf in jax.tree_util.tree_leaves(value))


def _abstractify(tree: Any) -> Any:
    import jax

    def leaf(value: Any) -> Any:
        if is_array_like(value) and not isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)
        return value

    return jax.tree_util.tree_map(leaf, tree)
