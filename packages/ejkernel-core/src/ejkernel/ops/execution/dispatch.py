"""Running a kernel with a chosen config: platform method, custom-VJP wiring, HLO stamps.

Shared by the executor and the tuner, so a candidate is timed exactly the way it will later run.
"""

from __future__ import annotations

from typing import Any

from ejkernel.ops.core.kernel import Kernel, explicit_platform, is_array_like, is_inexact
from ejkernel.ops.utils.fingerprint import get_device_platform
from ejkernel.ops.utils.labels import stamp_mode, stamp_name

__all__ = ["CallSplit", "platform_of", "run_kernel"]


def platform_of(kernel: Kernel, kwargs: dict, cfg: Any, device: Any = None) -> str:
    """The platform a call runs on: explicit ``platform=``, else the config's, else the device's."""
    platform = explicit_platform(kwargs) if "platform" in kwargs else None
    if platform is None:
        cfg_platform = getattr(cfg, "platform", None)
        if cfg_platform is not None:
            cfg_platform = str(getattr(cfg_platform, "value", cfg_platform))
            if cfg_platform != "auto":
                platform = cfg_platform
    if platform is None:
        platform = get_device_platform(device)
    return platform


def run_kernel(kernel: Kernel, args: tuple, kwargs: dict, cfg: Any, *, inv: Any = None) -> Any:
    """``kernel.run_<platform>(*args, cfg=cfg, **kwargs)`` (else ``run``), with VJP wiring and stamp."""
    mode = stamp_mode()
    if mode is None and _is_plain(type(kernel)):  # only run(), no custom VJP: nothing to decide
        return kernel.run(*args, cfg=cfg, **kwargs)
    platform = platform_of(kernel, kwargs, cfg)
    method = getattr(kernel, f"run_{platform}", None) or kernel.run
    if mode is None:
        return _call(kernel, method, args, kwargs, cfg)
    import jax

    cache_key = inv.cache_key if inv is not None else None
    abstract = inv.abstracted() if inv is not None and mode == "hash" else None
    scope = stamp_name(kernel.name, platform, cfg, mode, cache_key=cache_key, invocation=abstract)
    with jax.named_scope(scope):
        return _call(kernel, method, args, kwargs, cfg)


_plain: dict[type, bool] = {}


def _is_plain(kernel_type: type) -> bool:
    """True for kernel classes with neither ``run_<platform>`` methods nor a custom VJP."""
    try:
        return _plain[kernel_type]
    except KeyError:
        plain = _vjp_form(kernel_type) is None and not any(
            name.startswith("run_") and callable(getattr(kernel_type, name, None)) for name in dir(kernel_type)
        )
        _plain[kernel_type] = plain
        return plain


def _vjp_form(kernel_type: type) -> str | None:
    try:
        return _vjp_forms[kernel_type]
    except KeyError:
        form = _vjp_forms[kernel_type] = _find_vjp_form(kernel_type)
        return form


_vjp_forms: dict[type, str | None] = {}


def _find_vjp_form(kernel_type: type) -> str | None:
    if callable(getattr(kernel_type, "custom_vjp", None)):
        return "custom_vjp"
    if callable(getattr(kernel_type, "fwd_with_residuals", None)) and callable(getattr(kernel_type, "vjp", None)):
        return "residuals"
    return None


def _call(kernel: Kernel, method, args: tuple, kwargs: dict, cfg: Any) -> Any:
    form = _vjp_form(type(kernel))
    if form is None:
        return method(*args, cfg=cfg, **kwargs)
    return _call_with_vjp(kernel, form, method, args, kwargs, cfg)


class CallSplit:
    """A call's arguments split into dynamic leaves (arrays) and the static rest, and put back together.

    Leaves of ``static_argnames`` keywords are static; leaves of ``array_argnames`` keywords are dynamic;
    otherwise a leaf is dynamic when it has a shape and a dtype.
    """

    def __init__(self, kernel: Kernel, args: tuple, kwargs: dict):
        import jax

        static_names, array_names = set(kernel.static_argnames), set(kernel.array_argnames)
        arg_leaves, self._args_def = jax.tree_util.tree_flatten(args)
        self.arg_defs = [jax.tree_util.tree_structure(arg) for arg in args]
        self.kwarg_names = sorted(kwargs)
        kwarg_parts = [jax.tree_util.tree_flatten(kwargs[name]) for name in self.kwarg_names]
        self._kwarg_defs = [treedef for _, treedef in kwarg_parts]
        self.mask: list[bool] = [is_array_like(leaf) for leaf in arg_leaves]
        self.leaves: list[Any] = list(arg_leaves)
        for name, (leaves, _) in zip(self.kwarg_names, kwarg_parts, strict=True):
            if name in static_names:
                self.mask.extend(False for _ in leaves)
            elif name in array_names:
                self.mask.extend(True for _ in leaves)
            else:
                self.mask.extend(is_array_like(leaf) for leaf in leaves)
            self.leaves.extend(leaves)
        self.num_arg_leaves = len(arg_leaves)

    @property
    def dynamic(self) -> list[Any]:
        return [leaf for leaf, dynamic in zip(self.leaves, self.mask, strict=True) if dynamic]

    def rebuild(self, dynamic: list | tuple) -> tuple[tuple, dict]:
        values = iter(dynamic)
        leaves = [next(values) if is_dynamic else leaf for leaf, is_dynamic in zip(self.leaves, self.mask, strict=True)]
        args = self._args_def.unflatten(leaves[: self.num_arg_leaves])
        kwargs, offset = {}, self.num_arg_leaves
        for name, treedef in zip(self.kwarg_names, self._kwarg_defs, strict=True):
            kwargs[name] = treedef.unflatten(leaves[offset : offset + treedef.num_leaves])
            offset += treedef.num_leaves
        return tuple(args), kwargs

    def static_kwargs(self) -> dict[str, Any]:
        """Keyword arguments without a dynamic leaf."""
        kwargs, offset = {}, self.num_arg_leaves
        for name, treedef in zip(self.kwarg_names, self._kwarg_defs, strict=True):
            part = slice(offset, offset + treedef.num_leaves)
            if not any(self.mask[part]):
                kwargs[name] = treedef.unflatten(self.leaves[part])
            offset += treedef.num_leaves
        return kwargs

    def grads_to_dynamic(self, grads: Any, kernel_name: str) -> tuple:
        """Per-positional-argument gradients -> one cotangent (or None) per dynamic leaf."""
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.arg_defs):
            raise TypeError(
                f"kernel {kernel_name!r}: the backward must return a tuple with one gradient per positional "
                f"argument ({len(self.arg_defs)}), got {type(grads).__name__}"
                + (f" of length {len(grads)}" if isinstance(grads, (tuple, list)) else "")
            )
        per_leaf: list[Any] = []
        for grad, treedef in zip(grads, self.arg_defs, strict=True):
            if grad is None:
                per_leaf.extend([None] * treedef.num_leaves)
            else:
                per_leaf.extend(treedef.flatten_up_to(grad))
        per_leaf.extend([None] * (len(self.leaves) - self.num_arg_leaves))  # keyword arrays: no gradient
        cotangents = []
        for leaf, is_dynamic, grad in zip(self.leaves, self.mask, per_leaf, strict=True):
            if not is_dynamic:
                continue
            dtype = getattr(leaf, "dtype", None)
            differentiable = dtype is not None and is_inexact(dtype)
            cotangents.append(grad if differentiable else None)
        return tuple(cotangents)


def _call_with_vjp(kernel: Kernel, form: str, method, args: tuple, kwargs: dict, cfg: Any) -> Any:
    import jax

    split = CallSplit(kernel, args, kwargs)

    @jax.custom_vjp
    def call(*dynamic):
        call_args, call_kwargs = split.rebuild(dynamic)
        return method(*call_args, cfg=cfg, **call_kwargs)

    def forward(*dynamic):
        call_args, call_kwargs = split.rebuild(dynamic)
        if form == "residuals":
            return kernel.fwd_with_residuals(*call_args, cfg=cfg, **call_kwargs)
        return method(*call_args, cfg=cfg, **call_kwargs), dynamic

    def backward(residuals, cotangent):
        if form == "residuals":
            grads = kernel.vjp(residuals, cotangent, cfg=cfg, **split.static_kwargs())
        else:
            primals, call_kwargs = split.rebuild(residuals)
            cotangents = tuple(cotangent) if isinstance(cotangent, tuple) else (cotangent,)
            grads = kernel.custom_vjp(primals, cfg, call_kwargs, cotangents)
        return split.grads_to_dynamic(grads, kernel.name)

    call.defvjp(forward, backward)
    return call(*split.dynamic)
