"""Reference and conformance suite of ``attention`` (``docs/ops/attention.md``): dense attention that
returns ``(out, weights)``.

Subclass :class:`AttentionConformance` and set ``platform`` (see ``ejkernel.testing.flash_attention``
for the class attributes). Both outputs and their gradients are checked against the float64 reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.flash_attention import (
    AttentionSuiteBase,
    attention_inputs,
    reference_flash_attention,
)

__all__ = ["AttentionConformance", "reference_attention"]


def reference_attention(query, key, value, bias=None, softmax_aux=None, **keywords):
    """Dense reference ``(out, weights)`` (float64 inside ``jax.enable_x64(True)``); ``keywords``: those of
    ``reference_flash_attention`` that ``attention`` has."""
    return reference_flash_attention(query, key, value, bias, softmax_aux=softmax_aux, return_weights=True, **keywords)


class AttentionConformance(AttentionSuiteBase):
    """Conformance tests of ``attention`` for the backend named by ``platform``."""

    public_name = "attention"
    output_index = 0  # which of (out, weights) run_and_compare checks

    def operation(self, **kwargs):
        return super().operation(**kwargs)[self.output_index]

    def reference(self, **kwargs):
        return reference_attention(**kwargs)[self.output_index]

    @pytest.mark.parametrize(
        "dtype,output_index",
        [(jnp.float32, 0), (jnp.float32, 1), (jnp.bfloat16, 0), (jnp.float16, 1)],
        ids=["float32-out", "float32-weights", "bfloat16-out", "float16-weights"],
    )
    def test_dtypes(self, dtype, output_index):
        self.output_index = output_index
        inputs = attention_inputs(40, batch=2, q_len=21, kv_len=27, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
        self.run_and_compare(inputs, causal=True)

    @pytest.mark.parametrize("output_index", [0, 1], ids=["out", "weights"])
    def test_every_feature(self, output_index):
        self.output_index = output_index
        inputs = attention_inputs(41, batch=2, q_len=17, kv_len=23, num_heads=4, num_kv_heads=1, head_dim=32,
                                  bias_shape=(2, 1, 17, 23), num_sinks=2)
        mask = np.random.default_rng(41).random((2, 1, 17, 23)) > 0.3
        mask[:, :, 4] = False  # a row that sees nothing
        inputs["attention_mask"] = jnp.asarray(mask)
        out, _ = self.run_and_compare(
            inputs, causal=True, sliding_window=(8, 1), logits_soft_cap=6.0, dropout_prob=0.25, dropout_seed=9
        )
        np.testing.assert_array_equal(np.asarray(out[:, 4] if output_index == 0 else out[:, :, 4]), 0.0)

    @pytest.mark.parametrize("q_len,kv_len", [(1, 1), (17, 127), (127, 17)], ids=lambda v: str(v))
    def test_lengths(self, q_len, kv_len):
        inputs = attention_inputs(42, batch=1, q_len=q_len, kv_len=kv_len, num_heads=2, head_dim=32)
        self.run_and_compare(inputs, causal=True)

    def test_weights_rows_sum_to_one_and_deterministic_flag(self):
        from ejkernel.modules import attention

        inputs = attention_inputs(43, batch=1, q_len=12, num_heads=2, head_dim=32)
        with self.maybe_unsupported():
            out, weights = attention(**inputs, causal=True, platform=self.platform, cfg=self.cfg)
            deterministic, _ = attention(**inputs, causal=True, dropout_prob=0.5, deterministic=True,
                                         platform=self.platform, cfg=self.cfg)
            dropped, _ = attention(**inputs, causal=True, dropout_prob=0.5, platform=self.platform, cfg=self.cfg)
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(deterministic))
        assert not np.array_equal(np.asarray(out), np.asarray(dropped))

    @pytest.mark.parametrize(
        "mutate,argument",
        [
            (lambda x: dict(x, key=x["key"][:, :, :3], value=x["value"][:, :, :3]), "key"),
            (lambda x: dict(x, dropout_prob=1.5), "dropout_prob"),
            (lambda x: dict(x, logits_soft_cap=0.0), "logits_soft_cap"),
            (lambda x: dict(x, value=x["value"].astype(jnp.bfloat16)), "value"),
        ],
        ids=["kv-heads", "dropout", "soft-cap", "dtype-mix"],
    )
    def test_bad_inputs_raise_value_error(self, mutate, argument):
        inputs = mutate(attention_inputs(45, batch=2, q_len=16, num_heads=4, head_dim=32))
        with pytest.raises(ValueError, match=argument):
            self.operation(**inputs)

    def test_flash_features_it_lacks_are_refused(self):
        """Through the executor, which binds to the public signature: segments are flash_attention's."""
        from ejkernel.modules import Attention
        from ejkernel.ops import get_default_executor

        inputs = attention_inputs(47, batch=1, q_len=8, num_heads=2, head_dim=16)
        args = [inputs[name] for name in ("query", "key", "value")]
        with pytest.raises(TypeError, match="attention: got an unexpected keyword argument 'q_segment_ids'"):
            get_default_executor()(Attention(), *args, q_segment_ids=jnp.zeros((1, 8), jnp.int32), platform=self.platform)
