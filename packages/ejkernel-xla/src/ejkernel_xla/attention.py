"""XLA ``attention``: dense attention returning ``(out, weights)`` (``_blockwise.dense_attention``),
differentiated by autodiff; memory O(S²) by design (the weights are part of the result). Nothing to
tune (``NoConfig``); every feature is implemented, nothing is refused."""

from __future__ import annotations

import jax

from ejkernel.modules.operations._contract import Implementation, NoConfig
from ejkernel.modules.operations.attention import AttentionCall
from ejkernel_xla._blockwise import AttentionParams
from ejkernel_xla.scaled_dot_product_attention import dense_jit


class XlaAttention(Implementation[AttentionCall, NoConfig]):
    config_type = NoConfig

    def __call__(self, call: AttentionCall, config: NoConfig) -> tuple[jax.Array, jax.Array]:
        return dense_jit(
            call.query, call.key, call.value, call.bias, call.attention_mask, None, None, call.softmax_aux,
            call.dropout_seed, params=AttentionParams.of(call), return_weights=True,
        )


IMPLEMENTATION = XlaAttention()
