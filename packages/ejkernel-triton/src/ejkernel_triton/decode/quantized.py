"""Quantized KV caches in the decode kernels: which calls they take (:func:`check_quantized_cache`).

The kernels read a float8 or int8 cache as stored and multiply in the query's dtype (float16 for bfloat16
queries: ``kernels._compute_query``); ``key_scale`` / ``value_scale`` (per kv head, or per page and kv head on
paged caches) dequantize in the kernel. float8 needs Triton's conversions of sm_89 and later, and does not run in
Triton's interpreter (no float8 on the host).
"""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature

FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_quantized_cache(operation: str, cache_dtype) -> None:
    """Refuse (``UnsupportedFeature``) a float8 cache the kernels cannot take here: in the interpreter or before
    sm_89. int8 caches and scales run everywhere the kernels do (the GPU suite checked all of them on an H100,
    2026-11-27: float8_e4m3fn / float8_e5m2 / int8, scalar, per-head and per-page scales)."""
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
