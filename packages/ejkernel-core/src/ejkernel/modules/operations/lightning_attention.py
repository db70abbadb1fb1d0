"""``lightning_attention``: linear attention with a constant per-head decay set by the layer's depth.

The ``recurrent`` operation (whose :class:`LinearAttentionCall` its backends receive) with
``g_gamma = lightning_decay_slopes(H, layer_idx, num_layers)``, the original library's per-head log
decay, computed by core::

    g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h          (h = 0 .. H-1)

so head 0 never decays and deeper layers decay more slowly. ``0 <= layer_idx < num_layers``. GQA,
``initial_state``, ``reverse``, varlen ``cu_seqlens``, ``precision``, the float32 final state and the
gradients (query, key, value, initial_state) are as in ``recurrent``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations.recurrent import LinearAttentionCall, RecurrentAttention


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

    def canonicalize(self, args: Arguments) -> LinearAttentionCall:
        """Every argument but ``layer_idx``/``num_layers`` is checked by ``RecurrentAttention.validate``."""
        layer_idx, num_layers = _check_layers(args.layer_idx, args.num_layers)
        call = RecurrentAttention().validate(**args.without("layer_idx", "num_layers"))
        batch, _, heads, _ = args.query.shape
        slopes = lightning_decay_slopes(heads, layer_idx, num_layers)
        return dataclasses.replace(call, g_gamma=jnp.broadcast_to(slopes, (batch, heads)))


@public_function(LightningAttention)
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
    precision: str | jax.lax.Precision | None = None,
    cfg: Any = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Lightning attention of layer ``layer_idx`` of ``num_layers``; returns ``(output, float32 final_state)``.

    Args:
        query: ``[batch, seq, heads, head_dim]``; key/value ``[batch, seq, kv_heads, head_dim/value_dim]``.
        layer_idx, num_layers: the layer's depth, which sets the per-head decay.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first; cu_seqlens: packed sequences (batch 1).
        platform: ``"auto"`` or a platform name.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs).
        cfg: one implementation's config (e.g. ``ejkernel_xla.recurrent.XlaLinearAttentionConfig``); it
            selects that implementation.
    """
    return execute(LightningAttention(), **locals())
