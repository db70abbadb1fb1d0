"""The example's ``flash_attention``: dense softmax attention for plain calls (no mask, bias, sinks, soft
cap or dropout). It receives core's validated ``FlashAttentionCall`` (scale resolved, precision set) and
its own typed config, and re-validates nothing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ejkernel import Implementation, UnsupportedFeature
from ejkernel.modules import FlashAttentionCall

CALLS = {"flash_attention": 0}


@dataclasses.dataclass(frozen=True)
class ExampleFlashConfig:
    """The example's one knob: feed the probabilities to the second matmul in the inputs' dtype (faster
    for 16-bit inputs) instead of float32."""

    probabilities_in_input_dtype: bool = False


class ExampleFlashAttention(Implementation[FlashAttentionCall, ExampleFlashConfig]):
    config_type = ExampleFlashConfig

    def supports(self, call: FlashAttentionCall) -> None:
        extras = [
            name
            for name, used in [
                ("masking (causal, window, mask, segments, varlen)", call.masked),
                ("bias", call.bias is not None),
                ("softmax_aux", call.softmax_aux is not None),
                ("logits_soft_cap", call.logits_soft_cap is not None),
                ("dropout", call.dropout_prob > 0),
            ]
            if used
        ]
        if extras:
            raise UnsupportedFeature(f"example backend: {', '.join(extras)} not supported")

    def heuristic_config(self, call: FlashAttentionCall) -> ExampleFlashConfig:
        return ExampleFlashConfig()

    def candidate_configs(self, call: FlashAttentionCall) -> list[ExampleFlashConfig]:
        if call.query.dtype == jnp.float32:
            return []  # nothing to tune: float32 probabilities either way
        return [ExampleFlashConfig(False), ExampleFlashConfig(True)]

    def __call__(self, call: FlashAttentionCall, config: ExampleFlashConfig) -> jax.Array:
        CALLS["flash_attention"] += 1
        groups = call.query.shape[2] // call.key.shape[2]
        key = jnp.repeat(call.key, groups, axis=2)
        value = jnp.repeat(call.value, groups, axis=2)
        logits = jnp.einsum(
            "bqhd,bkhd->bhqk", call.query, key, precision=call.precision, preferred_element_type=jnp.float32
        )
        weights = jax.nn.softmax(logits * call.softmax_scale, axis=-1)
        if config.probabilities_in_input_dtype:
            weights = weights.astype(call.query.dtype)
        out = jnp.einsum(
            "bhqk,bkhd->bqhd", weights, value, precision=call.precision, preferred_element_type=jnp.float32
        )
        return out.astype(call.query.dtype)


IMPLEMENTATION = ExampleFlashAttention()
