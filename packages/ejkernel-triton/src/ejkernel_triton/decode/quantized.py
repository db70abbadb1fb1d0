"""Quantized KV caches in the decode kernels: which calls they take (:func:`check_quantized_cache`) and the
gate that keeps them off until a GPU run has checked them.

The kernels read a float8 or int8 cache as stored and multiply in the query's dtype; ``key_scale`` /
``value_scale`` (per kv head, or per page and kv head on paged caches) dequantize in the kernel. float8 needs
Triton's conversions of sm_89 and later, and does not run in Triton's interpreter (no float8 on the host).
"""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature

QUANTIZED_CACHE_VERIFIED_ON_GPU = False
"""Quantized and scaled caches (2026-11-27): sm_90 lowering and int8 interpreter numerics on the CPU, float8
benchmark numerics on an H100 (relative error 2.2e-3 against float32); the GPU conformance run was cut off by
its time limit. Until it passes, the dispatcher sends these calls to XLA (EJKERNEL_UNVERIFIED_KERNELS=1 lets
them through: the verifying run, ``scripts/device/gpu_tests.sh``)."""

FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_quantized_cache(operation: str, cache_dtype, query_dtype, scaled: bool) -> None:
    """Refuse (``UnsupportedFeature``) a quantized or scaled cache the kernels cannot take here: float8 in the
    interpreter or before sm_89, and any of them before the GPU suite has passed (see above)."""
    from ejkernel.plugins.checks import unverified_requested
    from ejkernel_triton.interpret import interpreting
    from ejkernel_triton.launch import target_compute_capability

    cache_dtype = jnp.dtype(cache_dtype)
    if cache_dtype in FLOAT8_DTYPES:
        if interpreting():
            raise UnsupportedFeature(f"triton {operation}: {cache_dtype} caches do not run in Triton's interpreter "
                                     "(no float8 on the host); platform='xla' takes them")
        if 0 < target_compute_capability() < 89:
            raise UnsupportedFeature(f"triton {operation}: {cache_dtype} caches need an sm_89 or later GPU; "
                                     "platform='xla' takes them")
    quantized = cache_dtype != jnp.dtype(query_dtype)
    if (quantized or scaled) and not (QUANTIZED_CACHE_VERIFIED_ON_GPU or unverified_requested() or interpreting()):
        raise UnsupportedFeature(
            f"triton {operation}: quantized or scaled caches have not passed the GPU suite yet "
            "(scripts/device/gpu_tests.sh, EJKERNEL_UNVERIFIED_KERNELS=1 runs them); platform='xla' takes them")
