"""Quantized KV caches in the serving suites (``page_attention``, ``ragged_decode_attention``,
``ragged_page_attention``): random quantized caches with their dequantization scales, the dequantization the
references apply, and the checks the suites share (:class:`QuantizedCacheChecks`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations._validation import QUANTIZED_CACHE_DTYPES
from ejkernel.testing.numerics import assert_close, jax_float64, run_jitted

QUANTIZED_DTYPES = tuple(jnp.dtype(d).name for d in QUANTIZED_CACHE_DTYPES)
"""The cache dtypes core accepts besides the query's (``_validation.QUANTIZED_CACHE_DTYPES``), by name."""
SCALE_KINDS = ("none", "scalar", "head", "page")
"""How a cache is scaled: not at all, one scale, one per kv head, one per (page, kv head) (paged caches only)."""


def dequantized(cache: jax.Array, scale: Any, dtype: Any, kv_heads_axis: int) -> jax.Array:
    """``cache`` in ``dtype`` times ``scale``: a scalar, ``[num_kv_heads]``, or ``[num_pages, num_kv_heads]`` (a
    paged cache, pages on axis 0); None: 1."""
    cache = cache.astype(dtype)
    if scale is None:
        return cache
    scale = jnp.asarray(scale, dtype)
    shape = [1] * cache.ndim
    if scale.ndim >= 1:
        shape[kv_heads_axis] = scale.shape[-1]
    if scale.ndim == 2:
        shape[0] = scale.shape[0]
    return cache * scale.reshape(shape)


def quantized_cache(seed: int, shape, dtype: str, scale_shape) -> tuple[jax.Array, jax.Array | None]:
    """A random cache of ``shape`` in ``dtype`` (float8 entries ~N(0, 16), int8 entries in [-127, 127]) and a
    scale of ``scale_shape`` in [0.01, 0.1] (None: no scale; an unscaled int8 cache is divided by 16 so that its
    logits do not saturate every softmax)."""
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        values = rng.integers(-127, 128, size=shape)
        cache = jnp.asarray((values if scale_shape is not None else values // 16).astype(np.int8))
    else:
        cache = jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 4).astype(dtype)
    if scale_shape is None:
        return cache, None
    return cache, jnp.asarray(rng.uniform(0.01, 0.1, size=scale_shape).astype(np.float32))


class QuantizedCacheChecks:
    """Mixin of a serving suite: quantized caches with every scale kind the operation takes, against its reference
    on the dequantized float64 values. The suite sets ``quantized_names`` (its key and value arguments; one name
    when keys and values share an array, as ``ragged_page_attention``'s interleaved pages, whose suite overrides
    :meth:`num_kv_heads`), ``kv_heads_axis`` and implements :meth:`quantized_base_inputs` and
    :meth:`quantized_reference` (it comes after :class:`~ejkernel.testing.numerics.ConformanceSuite` in the bases,
    whose ``call`` it uses); a backend sets ``supports_quantized_cache = False`` when it refuses them (checked
    instead) or narrows ``quantized_cache_dtypes``."""

    supports_quantized_cache: ClassVar[bool] = True
    quantized_cache_dtypes: ClassVar[tuple[str, ...]] = QUANTIZED_DTYPES
    quantized_names: ClassVar[tuple[str, ...]]
    kv_heads_axis: ClassVar[int]
    paged: ClassVar[bool] = False
    """Whether per-page scales exist (a paged cache, pages on axis 0)."""

    def quantized_base_inputs(self, query_dtype: str) -> dict[str, Any]:
        raise NotImplementedError

    def quantized_reference(self) -> Callable[..., jax.Array]:
        raise NotImplementedError

    def num_kv_heads(self, cache_shape) -> int:
        return cache_shape[self.kv_heads_axis]

    def scale_shape(self, cache_shape, kind: str):
        """The shape of a scale of ``kind`` (:data:`SCALE_KINDS`) for a cache of ``cache_shape``; None: no scale."""
        kv_heads = self.num_kv_heads(cache_shape)
        return {"none": None, "scalar": (), "head": (kv_heads,), "page": (cache_shape[0], kv_heads)}[kind]

    @pytest.mark.parametrize("query_dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("scale_kind", SCALE_KINDS)
    @pytest.mark.parametrize("cache_dtype", QUANTIZED_DTYPES)
    def test_quantized_cache(self, cache_dtype, scale_kind, query_dtype):
        """Forward only: gradients of a quantized cache are not defined."""
        if cache_dtype not in self.quantized_cache_dtypes:
            pytest.skip(f"{cache_dtype} caches are checked elsewhere for this backend")
        if scale_kind == "page" and not self.paged:
            pytest.skip("per-page scales belong to paged caches")
        inputs = self.quantized_base_inputs(query_dtype)
        key_name, value_name = self.quantized_names[0], self.quantized_names[-1]
        shape = inputs[key_name].shape
        scale_shape = self.scale_shape(shape, scale_kind)
        # the key's cache last: with one shared array (one name) it holds the key's random values
        inputs[value_name], value_scale = quantized_cache(81, shape, cache_dtype, scale_shape)
        inputs[key_name], key_scale = quantized_cache(80, shape, cache_dtype, scale_shape)
        scales = {} if scale_shape is None else dict(key_scale=key_scale, value_scale=value_scale)
        if not self.supports_quantized_cache:
            from ejkernel.errors import UnsupportedFeature

            with pytest.raises(UnsupportedFeature):
                self.call(**inputs, **scales)
            return
        out = self.call(**inputs, **scales)
        with jax.enable_x64(True):  # the exact cache values, dequantized in float64
            expected = np.asarray(jax.jit(self.quantized_reference())(**jax_float64({**inputs, **scales})))
        assert out.dtype == jnp.dtype(query_dtype)
        assert_close(out, expected, dtype=query_dtype)

    def test_scales_only_where_given(self):
        """Scales on an unquantized cache, and a key scale without a value scale."""
        if not self.supports_quantized_cache:
            pytest.skip("refusals are checked by test_quantized_cache")
        inputs = self.quantized_base_inputs("float32")
        kv_heads = self.num_kv_heads(inputs[self.quantized_names[0]].shape)
        key_scale = jnp.linspace(0.5, 1.5, kv_heads, dtype=jnp.float32)
        out = self.call(**inputs, key_scale=key_scale)
        expected = run_jitted(self.quantized_reference(), **inputs, key_scale=key_scale)
        assert_close(out, expected, dtype="float32")
