"""``flash_attention`` entry of the Pallas backend: routes to the TPU or GPU kernel, or to interpret mode.

On a TPU the Mosaic TPU kernel compiles; on an NVIDIA GPU the Triton-lowered kernel; on CPU the kernels
run only in interpret mode (see :mod:`ejkernel_pallas.interpret`), otherwise the call is refused with
``UnsupportedFeature`` naming the fix, before anything is traced.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ejkernel.errors import UnsupportedFeature

from ejkernel_pallas.interpret import interpret_mode, need_device_message, tpu_interpret_argument


def _target() -> tuple[str, object]:
    """(kernel family, interpret argument) for this machine and the interpret setting."""
    mode = interpret_mode()
    platform = jax.default_backend().lower()
    if mode == "gpu":
        return "gpu", True
    if mode is not None:
        return "tpu", tpu_interpret_argument(mode)
    if platform == "tpu":
        return "tpu", False
    if platform in ("gpu", "cuda"):
        return "gpu", False
    raise UnsupportedFeature(need_device_message())


# Arguments that are arrays (or None); the rest of the canonical keywords are static (scalars, tuples).
_ARRAY_KWARGS = (
    "attention_mask",
    "q_segment_ids",
    "kv_segment_ids",
    "cum_seqlens_q",
    "cum_seqlens_k",
    "softmax_aux",
    "dropout_seed",
)


def _impl(family: str):
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as impl
    else:
        from ejkernel_pallas import gpu_flash_attention as impl
    return impl


@functools.lru_cache(maxsize=256)
def _compiled(family: str, interpret, cfg, static: tuple):
    """One ``jax.jit`` per static configuration: an eager call compiles the whole wrapper (padding, three
    kernels, custom VJP) once per shape instead of dispatching dozens of small ops one by one; under a
    caller's ``jit`` it is inlined."""
    return jax.jit(functools.partial(_impl(family).flash_attention, cfg=cfg, interpret=interpret, **dict(static)))


def check_supported(*args, **kwargs):
    family, _ = _target()
    kwargs.pop("cfg", None)
    _impl(family).check_supported(*args, **kwargs)


def flash_attention(query, key, value, bias=None, *, cfg=None, **kwargs):
    family, interpret = _target()
    arrays = {name: kwargs.pop(name) for name in _ARRAY_KWARGS if name in kwargs}
    seed = arrays.get("dropout_seed")
    if isinstance(seed, (int, np.integer)):
        # the mask hashes the seed's low 32 bits (ejkernel.ops.utils.dropout): an array, not a static int,
        # so a new seed per step does not recompile
        arrays["dropout_seed"] = np.uint32(int(seed) & 0xFFFFFFFF)
    static = tuple(sorted(kwargs.items()))
    try:
        fn = _compiled(family, interpret, cfg, static)
    except TypeError:  # an unhashable cfg (a duck-typed stand-in): no cached jit
        fn = functools.partial(_impl(family).flash_attention, cfg=cfg, interpret=interpret, **kwargs)
    return fn(query, key, value, bias, **arrays)


flash_attention.check_supported = check_supported
