"""Running a kernel with a chosen config: the ``run_<platform>`` method, the ``custom_vjp`` backward and
the HLO stamp of ``EJKERNEL_OPS_STAMP``.

Shared by the executor and the tuner, so a candidate is timed exactly the way it will later run. The
public operations have neither ``run_<platform>`` methods nor a ``custom_vjp`` (their implementations come
from the kernel registry and carry their own VJPs): for them this is a plain ``kernel.run`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ejkernel.ops.core.invocation import explicit_platform, is_array_like, is_inexact
from ejkernel.ops.utils.fingerprint import get_device_platform
from ejkernel.ops.utils.labels import stamp_mode, stamp_name

__all__ = ["ArrayLeaves", "has_custom_vjp", "run_with_config"]


def has_custom_vjp(kernel: Any) -> bool:
    return callable(getattr(kernel, "custom_vjp", None))


def run_with_config(kernel: Any, args: tuple, kwargs: dict, cfg: Any, *, inv: Any = None) -> Any:
    """``kernel.run_<platform>(*args, cfg=cfg, **kwargs)`` (else ``run``), with its custom VJP and stamp."""
    mode = stamp_mode()
    if mode is None and _is_plain(type(kernel)):  # the per-call path of every operation: nothing to decide
        return kernel.run(*args, cfg=cfg, **kwargs)
    platform = explicit_platform(kwargs) or get_device_platform()
    method = getattr(kernel, f"run_{platform}", None) or kernel.run
    if mode is None:
        return _call(kernel, method, args, kwargs, cfg)
    import jax

    cache_key = inv.cache_key if inv is not None else None
    abstract = inv.abstracted() if inv is not None and mode == "hash" else None
    with jax.named_scope(stamp_name(kernel.name, platform, cfg, mode, cache_key=cache_key, invocation=abstract)):
        return _call(kernel, method, args, kwargs, cfg)


_plain: dict[type, bool] = {}


def _is_plain(kernel_type: type) -> bool:
    """True for kernel classes with neither ``run_<platform>`` methods nor a ``custom_vjp`` (memoized)."""
    plain = _plain.get(kernel_type)
    if plain is None:
        plain = _plain[kernel_type] = not callable(getattr(kernel_type, "custom_vjp", None)) and not any(
            name.startswith("run_") and callable(getattr(kernel_type, name, None)) for name in dir(kernel_type)
        )
    return plain


def _call(kernel: Any, method: Callable, args: tuple, kwargs: dict, cfg: Any) -> Any:
    if not has_custom_vjp(kernel):
        return method(*args, cfg=cfg, **kwargs)
    import jax

    leaves = ArrayLeaves(args, kwargs)

    def primal(*arrays):
        call_args, call_kwargs = leaves.rebuild(arrays)
        return method(*call_args, cfg=cfg, **call_kwargs)

    def forward(*arrays):
        return primal(*arrays), arrays  # residuals: the inputs

    def backward(arrays, cotangent):
        primals, call_kwargs = leaves.rebuild(arrays)
        cotangents = cotangent if isinstance(cotangent, tuple) else (cotangent,)
        return leaves.gradients(kernel.custom_vjp(primals, cfg, call_kwargs, cotangents), kernel.name)

    call = jax.custom_vjp(primal)
    call.defvjp(forward, backward)
    return call(*leaves.arrays)


class ArrayLeaves:
    """A call's array leaves (what is traced, timed and differentiated) and the static rest around them."""

    def __init__(self, args: tuple, kwargs: dict):
        import jax

        self.leaves, self._tree = jax.tree_util.tree_flatten((args, kwargs))
        self._is_array = [is_array_like(leaf) for leaf in self.leaves]
        self._arg_trees = [jax.tree_util.tree_structure(arg) for arg in args]
        self.arrays = [leaf for leaf, is_array in zip(self.leaves, self._is_array, strict=True) if is_array]

    def rebuild(self, arrays: list | tuple) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``arrays`` in place of the array leaves."""
        replacements = iter(arrays)
        leaves = [next(replacements) if is_array else leaf for leaf, is_array in zip(self.leaves, self._is_array)]
        args, kwargs = self._tree.unflatten(leaves)
        return tuple(args), kwargs

    def gradients(self, grads: Any, kernel_name: str) -> tuple:
        """``custom_vjp``'s per-positional-argument gradients -> one cotangent (or None) per array leaf."""
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self._arg_trees):
            raise TypeError(
                f"kernel {kernel_name!r}: custom_vjp must return a tuple with one gradient per positional "
                f"argument ({len(self._arg_trees)}), got {type(grads).__name__}"
                + (f" of length {len(grads)}" if isinstance(grads, (tuple, list)) else "")
            )
        per_leaf: list[Any] = []
        for grad, tree in zip(grads, self._arg_trees, strict=True):
            per_leaf.extend([None] * tree.num_leaves if grad is None else tree.flatten_up_to(grad))
        per_leaf.extend([None] * (len(self.leaves) - len(per_leaf)))  # keyword arrays: no gradient
        return tuple(
            grad if is_inexact(leaf.dtype) else None
            for leaf, is_array, grad in zip(self.leaves, self._is_array, per_leaf, strict=True)
            if is_array
        )
