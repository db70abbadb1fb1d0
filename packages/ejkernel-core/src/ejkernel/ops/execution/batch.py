"""vmap / pmap of a kernel with one config selection for the whole batch.

The kernel is called once per trace with per-example (or per-device) shapes, so the config is chosen
once, from the shapes each example has, and shared by every element.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ejkernel.ops.core.invocation import require_kernel
from ejkernel.ops.core.kernel import Kernel
from ejkernel.ops.execution.executor import get_default_executor

__all__ = ["pmap_with_config", "vmap_with_config"]


def _runner(kernel: Kernel, executor: Any, kwargs: dict) -> Callable:
    require_kernel(kernel, "vmap_with_config/pmap_with_config")
    run = executor if executor is not None else get_default_executor()
    cfg = kwargs.pop("cfg", None)

    def per_example(*args: Any) -> Any:
        return run(kernel, *args, cfg=cfg, **kwargs)

    return per_example


def vmap_with_config(
    kernel: Kernel, in_axes: Any = 0, out_axes: Any = 0, *, executor: Any = None, axis_name: Any = None
) -> Callable:
    """``jax.vmap`` of ``kernel`` over its positional arguments; keyword arguments are not batched.

    ``vmap_with_config(kernel, in_axes=(0, 0))(a, b, causal=True)``; ``cfg=`` pins the config.
    """
    import jax

    def batched(*args: Any, **kwargs: Any) -> Any:
        per_example = _runner(kernel, executor, dict(kwargs))
        return jax.vmap(per_example, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)(*args)

    return batched


def pmap_with_config(
    kernel: Kernel,
    axis_name: Any = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    *,
    executor: Any = None,
    **pmap_kwargs: Any,
) -> Callable:
    """``jax.pmap`` of ``kernel`` over its positional arguments (leading axis = devices).

    The pmapped program is kept per set of (hashable) keyword arguments, so repeated eager calls do not
    recompile.
    """
    import jax

    compiled: dict[Any, Callable] = {}

    def parallel(*args: Any, **kwargs: Any) -> Any:
        try:
            key = tuple(sorted(kwargs.items()))
            hash(key)
        except TypeError:  # arrays or other unhashable keywords: build per call
            key = None
        program = compiled.get(key) if key is not None else None
        if program is None:
            per_device = _runner(kernel, executor, dict(kwargs))
            program = jax.pmap(per_device, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes, **pmap_kwargs)
            if key is not None and len(compiled) < 64:
                compiled[key] = program
        return program(*args)

    return parallel
