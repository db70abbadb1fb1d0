"""``recurrent_attention``: gated linear attention as a recurrence over tokens -- the general form of the
linear-attention family (``gla_attention`` and ``lightning_attention`` are this recurrence with fewer gates).

Core validates every family member's call into one frozen :class:`LinearAttentionCall`; that object is
all a backend sees (one implementation can serve the three operations)::

    query [B, T, H, K]; key [B, T, Hkv, K]; value [B, T, Hkv, V]   (one dtype; H % Hkv == 0, query head h
                                                                   uses kv head h // (H // Hkv))
    g [B, T, H, K] or [B, T, H, 1] (core reshapes [B, T, H]); gk [B, T, H, K]   key-dimension log gates
    g_gamma float32 [B, H] (core broadcasts [H])                                  per-head constant log decay
    gv [B, T, H, V]                                                               value-dimension log gate
    initial_state float [B, H, K, V] (varlen: [N, H, K, V]); cu_seqlens int32 [N + 1] (then B == 1)
    softmax_scale: float (None -> K ** -0.5); reverse: bool; precision: jax.lax.Precision

Gates are log-space, any float dtype, all optional. Recurrence, per batch row and head, in float32, with
``a_t = g_t + gk_t + g_gamma`` (broadcast over K) and ``b_t = gv_t``::

    S_t = diag(exp(a_t)) S_{t-1} diag(exp(b_t)) + k_t v_t^T        (S: [K, V])
    o_t = softmax_scale * q_t^T S_t

``S_0 = initial_state`` (zeros when None). ``reverse=True`` runs from the last token to the first (the gates
of token t multiply the state coming from t + 1). ``output`` ``[B, T, H, V]`` in query's dtype;
``final_state`` float32 ``[B, H, K, V]``: the state after the last processed token.

Varlen: ``cu_seqlens`` int32 ``[N + 1]`` with ``B == 1``: the tokens of sequence ``n``
(``cu_seqlens[n] <= t < cu_seqlens[n + 1]``) run their own recurrence from ``initial_state[n]``
(``[N, H, K, V]``), and ``final_state`` is ``[N, H, K, V]`` (an empty sequence keeps its initial state).
Tokens past ``cu_seqlens[-1]`` output zeros.

``precision`` is the matmul precision floor (``_precision``: None -> HIGHEST for float32 inputs).
Gradients: query, key, value, every gate given, initial_state. Backends must not materialize per-token
states (the XLA backend is chunked: O(T * chunk) memory). Full specification: ``docs/ops/recurrent.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    check_array,
    check_bool,
    check_cum_seqlens,
    check_dim,
    check_gqa,
    check_same_dtype,
    describe,
    resolve_softmax_scale,
)


@canonical_call
class LinearAttentionCall:
    """A validated call of ``recurrent`` / ``gla`` / ``lightning_attention`` (see the module docstring)."""

    query: Float[jax.Array, "batch seq heads head_dim"] = array_field()
    key: Float[jax.Array, "batch seq kv_heads head_dim"] = array_field()
    value: Float[jax.Array, "batch seq kv_heads value_dim"] = array_field()
    g: Float[jax.Array, "batch seq heads head_dim"] | Float[jax.Array, "batch seq heads 1"] | None = array_field()
    """Key-dimension log gate; ``[..., 1]``: one per token and head."""
    gk: Float[jax.Array, "batch seq heads head_dim"] | None = array_field()
    gv: Float[jax.Array, "batch seq heads value_dim"] | None = array_field()
    """Value-dimension log gate."""
    g_gamma: Float[jax.Array, "batch heads"] | None = array_field()
    """float32 per-head constant log decay (lightning_attention: its layer-dependent slopes)."""
    initial_state: Float[jax.Array, "states heads head_dim value_dim"] | None = array_field()
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = array_field()
    """int32; then batch is 1 and ``states`` is ``num_seqs``."""
    softmax_scale: float = 1.0
    reverse: bool = False
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


class RecurrentAttention(RegistryOperation):
    """Gated linear attention as a recurrence (see the module docstring)."""

    algorithm = "recurrent"

    def canonicalize(self, args: Arguments) -> LinearAttentionCall:
        """The checks of the whole linear family (``gla``, ``lightning_attention`` forward their arguments)."""
        query, key, value, g_gamma, cu_seqlens, initial_state = (
            args.query, args.key, args.value, args.g_gamma, args.cu_seqlens, args.initial_state
        )
        check_array("query", query, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq, heads, head_dim]")
        check_array("key", key, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq, kv_heads, head_dim]")
        check_array("value", value, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq, kv_heads, value_dim]")
        check_same_dtype("query", query, key=key, value=value)
        batch, total, heads, dk = query.shape
        for name, x in (("key", key), ("value", value)):
            check_dim(name, x, 0, batch, "batch of query")
            check_dim(name, x, 1, total, "seq of query")
        check_dim("key", key, 3, dk, "head_dim of query")
        check_dim("value", value, 2, key.shape[2], "kv_heads of key")
        check_gqa("query", heads, "key", key.shape[2], key)
        dv = value.shape[3]
        gates = {}
        for name, x in (("g", args.g), ("gk", args.gk), ("gv", args.gv)):
            if x is None:
                gates[name] = None
                continue
            last, last_name = (dv, "value_dim") if name == "gv" else (dk, "head_dim")
            check_array(name, x, dtypes=FLOAT_DTYPES, what=f"(log-space gate [batch, seq, heads, {last_name}])")
            expected = [(batch, total, heads, last)] + ([(batch, total, heads)] if name == "g" else [])
            if tuple(x.shape) not in expected:
                shapes = " or ".join("[" + ", ".join(map(str, s)) + "]" for s in expected)
                raise ValueError(f"{name} must have shape {shapes} (from query/value), got {describe(x)}")
            gates[name] = x[..., None] if x.ndim == 3 else x
        if g_gamma is not None:
            check_array("g_gamma", g_gamma, dtypes=FLOAT_DTYPES, what="(per-head log decay [heads] or [batch, heads])")
            if tuple(g_gamma.shape) not in ((heads,), (batch, heads)):
                raise ValueError(f"g_gamma must have shape [{heads}] or [{batch}, {heads}], got {describe(g_gamma)}")
            g_gamma = jnp.broadcast_to(g_gamma.astype(jnp.float32), (batch, heads))
        states = batch
        if cu_seqlens is not None:
            check_cum_seqlens("cu_seqlens", cu_seqlens, total, "seq of query")
            if batch != 1:
                raise ValueError(f"cu_seqlens needs packed inputs with batch 1 ([1, total_tokens, ...]), got query {describe(query)}")
            cu_seqlens = cu_seqlens.astype(jnp.int32)
            states = cu_seqlens.shape[0] - 1
        if initial_state is not None:
            rows = "num_seqs" if cu_seqlens is not None else "batch"
            check_array("initial_state", initial_state, rank=4, dtypes=FLOAT_DTYPES, what=f"[{rows}, heads, head_dim, value_dim]")
            if tuple(initial_state.shape) != (states, heads, dk, dv):
                raise ValueError(
                    f"initial_state must have shape [{states}, {heads}, {dk}, {dv}] ([{rows}, heads, head_dim, value_dim]), "
                    f"got {describe(initial_state)}"
                )
        return args.build(
            LinearAttentionCall,
            **gates,
            g_gamma=g_gamma,
            cu_seqlens=cu_seqlens,
            softmax_scale=resolve_softmax_scale(args.softmax_scale, dk),
            reverse=check_bool("reverse", args.reverse),
            precision=resolve_precision(args.precision, query.dtype),
        )


@public_function(RecurrentAttention)
def recurrent_attention(
    query: Float[jax.Array, "batch seq heads head_dim"],
    key: Float[jax.Array, "batch seq kv_heads head_dim"],
    value: Float[jax.Array, "batch seq kv_heads value_dim"],
    g: Float[jax.Array, "batch seq heads *gate_dim"] | None = None,
    g_gamma: Float[jax.Array, "*gamma_batch heads"] | None = None,
    gk: Float[jax.Array, "batch seq heads head_dim"] | None = None,
    gv: Float[jax.Array, "batch seq heads value_dim"] | None = None,
    softmax_scale: float | None = None,
    initial_state: Float[jax.Array, "states heads head_dim value_dim"] | None = None,
    reverse: bool = False,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    platform: str = "auto",
    *,
    precision: str | jax.lax.Precision | None = None,
    cfg: Any = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Linear attention with log-space gates, run as a recurrence (see the module docstring).

    Positional order as in the original library (``platform`` included); ``precision`` and ``cfg`` are
    keyword-only.

    Args:
        query: ``[batch, seq, heads, head_dim]``; key ``[batch, seq, kv_heads, head_dim]``; value
            ``[batch, seq, kv_heads, value_dim]``.
        g: log gate ``[batch, seq, heads, head_dim]`` or ``[batch, seq, heads]``; gk: ``[batch, seq, heads,
            head_dim]``; gv: ``[batch, seq, heads, value_dim]``; g_gamma: ``[heads]`` or ``[batch, heads]``.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first.
        cu_seqlens: int ``[num_seqs + 1]`` for packed sequences (batch 1).
        platform: ``"auto"`` or a platform name (``"xla"``, ...).
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs); ``"default"``
            allows TF32 on NVIDIA GPUs.
        cfg: one implementation's config (e.g. ``ejkernel_xla.recurrent.XlaLinearAttentionConfig``); it
            selects that implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``(output [batch, seq, heads, value_dim] in query's dtype, final_state float32)``.
    """
    return execute(RecurrentAttention(), **locals())


recurrent = recurrent_attention
"""The operation's catalogue name (``recurrent``); same function."""
