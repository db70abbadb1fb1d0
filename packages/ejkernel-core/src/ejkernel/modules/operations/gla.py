"""``gla_attention``: gated linear attention (GLA) with per-key-dimension log-space gates.

The ``recurrent`` operation (``ejkernel.modules.operations.recurrent``, whose :class:`LinearAttentionCall`
its backends receive) with only the key-dimension gate ``g`` (``[B, T, H, K]``: ``log(sigmoid(.))`` values
in GLA, any log decay allowed; ``[B, T, H]`` means one per token and head) and the optional per-head
constant ``g_gamma`` (``[H]`` or ``[B, H]``)::

    S_t = diag(exp(g_t + g_gamma)) S_{t-1} + k_t v_t^T,      o_t = softmax_scale * q_t^T S_t

Everything else -- GQA, ``initial_state``, ``reverse``, varlen ``cu_seqlens``, ``precision``, the float32
final state, the gradients (query, key, value, g, g_gamma, initial_state) -- is as in ``recurrent``.
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations.recurrent import LinearAttentionCall, RecurrentAttention


class GLAttention(RegistryOperation):
    """Gated linear attention (see the module docstring)."""

    algorithm = "gla"

    def canonicalize(self, args: Arguments) -> LinearAttentionCall:
        """Checked and normalized by ``RecurrentAttention.validate`` (gla's arguments are a subset)."""
        return RecurrentAttention().validate(**args)


@public_function(GLAttention)
def gla_attention(
    query: Float[jax.Array, "batch seq heads head_dim"],
    key: Float[jax.Array, "batch seq kv_heads head_dim"],
    value: Float[jax.Array, "batch seq kv_heads value_dim"],
    g: Float[jax.Array, "batch seq heads *gate_dim"] | None = None,
    g_gamma: Float[jax.Array, "*gamma_batch heads"] | None = None,
    softmax_scale: float | None = None,
    initial_state: Float[jax.Array, "states heads head_dim value_dim"] | None = None,
    reverse: bool = False,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    platform: str = "auto",
    *,
    precision: str | jax.lax.Precision | None = None,
    cfg: Any = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Gated linear attention; returns ``(output in query's dtype, float32 final_state)``.

    Args:
        query: ``[batch, seq, heads, head_dim]``; key/value ``[batch, seq, kv_heads, head_dim/value_dim]``.
        g: log-space gate ``[batch, seq, heads, head_dim]`` (or ``[batch, seq, heads]``).
        g_gamma: per-head constant log decay ``[heads]`` or ``[batch, heads]``.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first; cu_seqlens: packed sequences (batch 1).
        platform: ``"auto"`` or a platform name.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs).
        cfg: one implementation's config (e.g. ``ejkernel_xla.recurrent.XlaLinearAttentionConfig``); it
            selects that implementation.
    """
    return execute(GLAttention(), **locals())
