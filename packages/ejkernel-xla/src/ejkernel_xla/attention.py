"""XLA ``attention``: dense attention returning ``(out, weights)`` (``_blockwise.dense_attention``),
differentiated by autodiff; memory O(S²) by design (the weights are part of the result)."""

from __future__ import annotations

from ejkernel_xla.flash_attention import attention_params
from ejkernel_xla.scaled_dot_product_attention import dense_jit


def attention(
    query,
    key,
    value,
    bias=None,
    softmax_aux=None,
    *,
    attention_mask=None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed=None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    cfg=None,
):
    """Canonical ``attention`` (arguments normalized by core): ``(out, weights)``."""
    del cfg  # nothing to tune
    params = attention_params(softmax_scale, causal, sliding_window, logits_soft_cap, dropout_prob)
    return dense_jit(
        query, key, value, bias, attention_mask, None, None, softmax_aux,
        None if params.dropout_prob == 0.0 else dropout_seed, params=params, return_weights=True,
    )
