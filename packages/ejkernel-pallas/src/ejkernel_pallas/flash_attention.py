"""``flash_attention`` entry of the Pallas backend: routes to the TPU or GPU kernel, or to interpret mode.

On a TPU the Mosaic TPU kernel compiles; on an NVIDIA GPU the Triton-lowered kernel; on CPU the kernels
run only in interpret mode (see :mod:`ejkernel_pallas.interpret`), otherwise the call is refused with
``UnsupportedFeature`` naming the fix, before anything is traced.
"""

from __future__ import annotations

import jax

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


def check_supported(*args, **kwargs):
    family, _ = _target()
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as impl
    else:
        from ejkernel_pallas import gpu_flash_attention as impl
    kwargs.pop("cfg", None)
    impl.check_supported(*args, **kwargs)


def flash_attention(query, key, value, bias=None, *, cfg=None, **kwargs):
    family, interpret = _target()
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as impl
    else:
        from ejkernel_pallas import gpu_flash_attention as impl
    return impl.flash_attention(query, key, value, bias, cfg=cfg, interpret=interpret, **kwargs)


flash_attention.check_supported = check_supported
