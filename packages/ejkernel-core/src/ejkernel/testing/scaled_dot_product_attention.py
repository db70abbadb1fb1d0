"""Reference and conformance suite of ``scaled_dot_product_attention`` (``docs/ops/sdpa.md``).

Subclass :class:`ScaledDotProductAttentionConformance` and set ``platform`` (see
``ejkernel.testing.flash_attention`` for the class attributes). The reference is the dense float64
``reference_flash_attention`` restricted to the operation's features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.flash_attention import (
    DTYPE_IDS,
    DTYPES,
    AttentionSuiteBase,
    attention_inputs,
    reference_flash_attention,
)
from ejkernel.testing.numerics import assert_finite, fresh_keys, random_normal

__all__ = ["ScaledDotProductAttentionConformance", "reference_scaled_dot_product_attention"]


def reference_scaled_dot_product_attention(
    query, key, value, bias=None, cum_seqlens_q=None, cum_seqlens_k=None, **keywords
):
    """Dense reference (float64 inside ``jax.enable_x64(True)``); ``keywords``: those of
    ``reference_flash_attention`` that ``scaled_dot_product_attention`` has."""
    return reference_flash_attention(
        query, key, value, bias, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k, **keywords
    )


class ScaledDotProductAttentionConformance(AttentionSuiteBase):
    """Conformance tests of ``scaled_dot_product_attention`` for the backend named by ``platform``."""

    public_name = "scaled_dot_product_attention"
    reference = staticmethod(reference_scaled_dot_product_attention)
    reference_outputs = AttentionSuiteBase.numpy_reference_outputs

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    def test_dtypes(self, dtype):
        inputs = attention_inputs(30, batch=2, q_len=24, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
        self.run_and_compare(inputs, causal=True)

    @pytest.mark.parametrize("q_len,kv_len", [(1, 1), (17, 127), (1, 129)], ids=lambda v: str(v))
    def test_lengths(self, q_len, kv_len):
        inputs = attention_inputs(31, batch=1, q_len=q_len, kv_len=kv_len, num_heads=2, num_kv_heads=1, head_dim=32)
        self.run_and_compare(inputs, causal=True)

    def test_mqa_window_bias(self):
        inputs = attention_inputs(32, batch=2, q_len=20, kv_len=26, num_heads=4, num_kv_heads=1, head_dim=32,
                                  bias_shape=(1, 4, 20, 26))
        self.run_and_compare(inputs, sliding_window=(5, 2))

    def test_fully_masked_rows(self):
        inputs = attention_inputs(33, batch=2, q_len=14, kv_len=18, num_heads=2, head_dim=32)
        mask = np.random.default_rng(33).random((2, 1, 14, 18)) > 0.4
        mask[:, :, [0, 9]] = False
        inputs["attention_mask"] = jnp.asarray(mask)
        out, grads = self.run_and_compare(inputs)
        np.testing.assert_array_equal(np.asarray(out[:, [0, 9]]), 0.0)
        for name, g in grads.items():
            assert_finite(g, f"d{name}")

    def test_varlen(self):
        inputs = attention_inputs(34, batch=1, q_len=30, kv_len=34, num_heads=2, head_dim=32)
        inputs["cum_seqlens_q"] = jnp.asarray([0, 9, 9, 27], jnp.int32)
        inputs["cum_seqlens_k"] = jnp.asarray([0, 15, 18, 33], jnp.int32)
        out, _ = self.run_and_compare(inputs, causal=True)
        np.testing.assert_array_equal(np.asarray(out[:, 27:]), 0.0)

    def test_jit_and_vmap(self):
        keys = fresh_keys(35, 3)
        q = random_normal(keys[0], (2, 1, 9, 2, 16))
        k = random_normal(keys[1], (2, 1, 11, 2, 16))
        v = random_normal(keys[2], (2, 1, 11, 2, 16))
        with self.maybe_unsupported():
            fn = lambda q, k, v: self.operation(query=q, key=k, value=v, causal=True)  # noqa: E731
            mapped = self.jit(jax.vmap(fn))(q, k, v)
            looped = jnp.stack([fn(q[i], k[i], v[i]) for i in range(2)])
        np.testing.assert_allclose(np.asarray(mapped), np.asarray(looped), rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize(
        "mutate,argument",
        [
            (lambda x: dict(x, key=x["key"][:, :, :3], value=x["value"][:, :, :3]), "key"),
            (lambda x: dict(x, key=x["key"].astype(jnp.float16)), "key"),
            (lambda x: dict(x, sliding_window=(2, -2)), "sliding_window"),
            (lambda x: dict(x, cum_seqlens_k=jnp.array([0, 16], jnp.int32)), "cum_seqlens"),
        ],
        ids=["kv-heads", "dtype-mix", "window", "cu-alone"],
    )
    def test_bad_inputs_raise_value_error(self, mutate, argument):
        inputs = mutate(attention_inputs(36, batch=2, q_len=16, num_heads=4, head_dim=32))
        with pytest.raises(ValueError, match=argument):
            self.operation(**inputs)

    @pytest.mark.parametrize(
        "feature,argument",
        [(dict(dropout_prob=0.1), "dropout_prob"), (dict(logits_soft_cap=5.0), "logits_soft_cap")],
        ids=["dropout", "soft-cap"],
    )
    def test_flash_features_it_lacks_are_refused(self, feature, argument):
        """Through the executor, which binds to the public signature: these are flash_attention's features."""
        from ejkernel.modules import ScaledDotProductAttention
        from ejkernel.ops import get_default_executor

        inputs = attention_inputs(37, batch=1, q_len=8, num_heads=2, head_dim=16)
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{argument}'"):
            get_default_executor()(ScaledDotProductAttention(), *inputs.values(), **feature, platform=self.platform)
