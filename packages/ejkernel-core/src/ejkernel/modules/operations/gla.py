"""``gla_attention``: gated linear attention (GLA) with per-key-dimension log-space gates.

Canonical call every backend receives (validated and normalized here)::

    gla(query, key, value, g, g_gamma, initial_state, cu_seqlens, *, softmax_scale: float, reverse: bool, cfg)
        -> (output, final_state)

The ``recurrent`` operation (``ejkernel.modules.operations.recurrent``) with only the key-dimension gate
``g`` (``[B, T, H, K]``: ``log(sigmoid(.))`` values in GLA, any log decay allowed; ``[B, T, H]`` means one
per token and head) and the optional per-head constant ``g_gamma`` (``[H]`` or ``[B, H]``)::

    S_t = diag(exp(g_t + g_gamma)) S_{t-1} + k_t v_t^T,      o_t = softmax_scale * q_t^T S_t

Everything else -- GQA, ``initial_state``, ``reverse``, varlen ``cu_seqlens``, the float32 final state,
the gradients (query, key, value, g, g_gamma, initial_state) -- is as in ``recurrent``.
"""

from __future__ import annotations

import jax
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import typechecked
from ejkernel.modules.operations.recurrent import RecurrentConfig, resolve_softmax_scale, validate_linear_attention

GLAConfig = RecurrentConfig


class GLAttention(RegistryOperation):
    """Gated linear attention (see the module docstring)."""

    algorithm = "gla"
    config_type = RecurrentConfig

    def validate(self, query, key, value, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, *,
                 softmax_scale=None, reverse=False):
        n = validate_linear_attention(
            query, key, value, gates=dict(g=g), g_gamma=g_gamma, initial_state=initial_state, cu_seqlens=cu_seqlens
        )
        args = (query, key, value, n["g"], n["g_gamma"], n["initial_state"], n["cu_seqlens"])
        return args, dict(softmax_scale=resolve_softmax_scale(softmax_scale, query.shape[-1]), reverse=bool(reverse))


@typechecked
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
    cfg: RecurrentConfig | None = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Gated linear attention; returns ``(output in query's dtype, float32 final_state)``.

    Args:
        query: ``[batch, seq, heads, head_dim]``; key/value ``[batch, seq, kv_heads, head_dim/value_dim]``.
        g: log-space gate ``[batch, seq, heads, head_dim]`` (or ``[batch, seq, heads]``).
        g_gamma: per-head constant log decay ``[heads]`` or ``[batch, heads]``.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first; cu_seqlens: packed sequences (batch 1).
        platform: ``"auto"`` or a backend name; cfg: a :class:`RecurrentConfig` (``chunk_size``).
    """
    return execute(
        GLAttention(), query, key, value, g, g_gamma, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, platform=platform, cfg=cfg,
    )
