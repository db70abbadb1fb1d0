"""``lightning_attention``: linear attention with a constant per-head decay set by the layer's depth.

Canonical call every backend receives (validated and normalized here)::

    lightning_attention(query, key, value, initial_state, cu_seqlens, *, layer_idx: int, num_layers: int,
                        softmax_scale: float, reverse: bool, cfg) -> (output, final_state)

The ``recurrent`` operation with ``g_gamma = lightning_decay_slopes(H, layer_idx, num_layers)``, the
original library's per-head log decay::

    g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h          (h = 0 .. H-1)

so head 0 never decays and deeper layers decay more slowly. ``0 <= layer_idx < num_layers``. GQA,
``initial_state``, ``reverse``, varlen ``cu_seqlens``, the float32 final state and the gradients
(query, key, value, initial_state) are as in ``recurrent``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import typechecked
from ejkernel.modules.operations.recurrent import RecurrentConfig, resolve_softmax_scale, validate_linear_attention

LightningAttentionConfig = RecurrentConfig


def lightning_decay_slopes(num_heads: int, layer_idx: int, num_layers: int) -> jax.Array:
    """float32 [num_heads]: the per-head log decay (see the module docstring)."""
    return -(8.0 / num_heads) * (1.0 - layer_idx / num_layers) * jnp.arange(num_heads, dtype=jnp.float32)


def _check_layers(layer_idx, num_layers) -> tuple[int, int]:
    for name, value in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_layers <= 0 or not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, num_layers) with num_layers > 0, got layer_idx={layer_idx}, num_layers={num_layers}")
    return int(layer_idx), int(num_layers)


class LightningAttention(RegistryOperation):
    """Lightning attention (see the module docstring)."""

    algorithm = "lightning_attention"
    config_type = RecurrentConfig

    def validate(self, query, key, value, initial_state=None, cu_seqlens=None, *, layer_idx, num_layers,
                 softmax_scale=None, reverse=False):
        layer_idx, num_layers = _check_layers(layer_idx, num_layers)
        n = validate_linear_attention(query, key, value, gates={}, initial_state=initial_state, cu_seqlens=cu_seqlens)
        args = (query, key, value, n["initial_state"], n["cu_seqlens"])
        kwargs = dict(
            layer_idx=layer_idx, num_layers=num_layers,
            softmax_scale=resolve_softmax_scale(softmax_scale, query.shape[-1]), reverse=bool(reverse),
        )
        return args, kwargs


@typechecked
def lightning_attention(
    query: Float[jax.Array, "batch seq heads head_dim"],
    key: Float[jax.Array, "batch seq kv_heads head_dim"],
    value: Float[jax.Array, "batch seq kv_heads value_dim"],
    layer_idx: int,
    num_layers: int,
    softmax_scale: float | None = None,
    initial_state: Float[jax.Array, "states heads head_dim value_dim"] | None = None,
    reverse: bool = False,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    platform: str = "auto",
    *,
    cfg: RecurrentConfig | None = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Lightning attention of layer ``layer_idx`` of ``num_layers``; returns ``(output, float32 final_state)``.

    Args:
        query: ``[batch, seq, heads, head_dim]``; key/value ``[batch, seq, kv_heads, head_dim/value_dim]``.
        layer_idx, num_layers: the layer's depth, which sets the per-head decay.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first; cu_seqlens: packed sequences (batch 1).
        platform: ``"auto"`` or a backend name; cfg: a :class:`RecurrentConfig` (``chunk_size``).
    """
    return execute(
        LightningAttention(), query, key, value, initial_state, cu_seqlens,
        layer_idx=layer_idx, num_layers=num_layers, softmax_scale=softmax_scale, reverse=reverse,
        platform=platform, cfg=cfg,
    )
