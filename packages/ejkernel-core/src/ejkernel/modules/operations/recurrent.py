"""``recurrent_attention``: gated linear attention as a recurrence over tokens (the general form that
``gla_attention`` and ``lightning_attention`` specialize).

Canonical call every backend receives (validated and normalized here)::

    recurrent(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, *,
              softmax_scale: float, reverse: bool, cfg) -> (output, final_state)

Shapes: ``query`` ``[B, T, H, K]``; ``key`` ``[B, T, Hkv, K]``, ``value`` ``[B, T, Hkv, V]`` (same dtype as
query; ``H % Hkv == 0``, query head ``h`` uses kv head ``h // (H // Hkv)``). Log-space gates, any float
dtype (computed in float32), all optional:

- ``g``: ``[B, T, H, K]`` per key dimension, or ``[B, T, H]`` one per token and head (core passes the
  latter as ``[B, T, H, 1]``); ``gk``: ``[B, T, H, K]``; ``g_gamma``: ``[H]`` or ``[B, H]``, a constant per
  head (core passes ``[B, H]``); together ``a_t = g_t + gk_t + g_gamma`` (broadcast over K);
- ``gv``: ``[B, T, H, V]``, the value-dimension log decay ``b_t``.

Recurrence, per batch row and head, in float32::

    S_t = diag(exp(a_t)) S_{t-1} diag(exp(b_t)) + k_t v_t^T        (S: [K, V])
    o_t = softmax_scale * q_t^T S_t                                 (softmax_scale: default K ** -0.5)

``S_0 = initial_state`` (float ``[B, H, K, V]``; zeros when None). ``reverse=True`` runs from the last token
to the first (the gates of token t multiply the state coming from t + 1). ``output`` ``[B, T, H, V]`` in
query's dtype; ``final_state`` float32 ``[B, H, K, V]``: the state after the last processed token.

Varlen: ``cu_seqlens`` int32 ``[N + 1]`` with ``B == 1``: the tokens of sequence ``n``
(``cu_seqlens[n] <= t < cu_seqlens[n + 1]``) run their own recurrence from ``initial_state[n]``
(``[N, H, K, V]``), and ``final_state`` is ``[N, H, K, V]`` (an empty sequence keeps its initial state).
Tokens past ``cu_seqlens[-1]`` output zeros.

Gradients: query, key, value, every gate given, initial_state. Backends must not materialize per-token
states (the XLA backend is chunked: O(T * chunk) memory).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    check_array,
    check_cum_seqlens,
    check_dim,
    check_same_dtype,
    describe,
    typechecked,
)

LINEAR_LAYOUT = "[batch, seq, heads, head_dim]"


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Config of the linear-attention family (recurrent, gla, lightning); None: the backend decides."""

    chunk_size: int | None = None
    """Tokens per chunk of the chunked form (intra-chunk matmuls, a scan over chunks)."""
    platform: str = "auto"
    backend: str = "any"


def resolve_softmax_scale(value: Any, head_dim: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
        raise ValueError(f"softmax_scale must be a finite float or None, got {value!r}")
    return float(value)


def validate_linear_attention(
    query, key, value, *, gates: dict[str, Any], g_gamma=None, initial_state=None, cu_seqlens=None
) -> dict[str, Any]:
    """Shared checks of the linear family; returns the normalized gates/state (see the module docstring)."""
    check_array("query", query, rank=4, dtypes=FLOAT_DTYPES, what=LINEAR_LAYOUT)
    check_array("key", key, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq, kv_heads, head_dim]")
    check_array("value", value, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq, kv_heads, value_dim]")
    check_same_dtype("query", query, key=key, value=value)
    batch, total, heads, dk = query.shape
    for name, x in (("key", key), ("value", value)):
        check_dim(name, x, 0, batch, "batch of query")
        check_dim(name, x, 1, total, "seq of query")
    check_dim("key", key, 3, dk, "head_dim of query")
    check_dim("value", value, 2, key.shape[2], "kv_heads of key")
    kv_heads, dv = key.shape[2], value.shape[3]
    if heads % kv_heads != 0:
        raise ValueError(f"key has {kv_heads} kv heads, which must divide the {heads} heads of query; got {describe(key)}")
    out: dict[str, Any] = {}
    for name, x in gates.items():
        if x is None:
            out[name] = None
            continue
        last = dv if name == "gv" else dk
        scalar_ok = name == "g"
        check_array(name, x, dtypes=FLOAT_DTYPES, what=f"(log-space gate [batch, seq, heads, {'value_dim' if name == 'gv' else 'head_dim'}])")
        expected = [(batch, total, heads, last)] + ([(batch, total, heads)] if scalar_ok else [])
        if tuple(x.shape) not in expected:
            shapes = " or ".join("[" + ", ".join(map(str, s)) + "]" for s in expected)
            raise ValueError(f"{name} must have shape {shapes} (from query/value), got {describe(x)}")
        out[name] = x[..., None] if x.ndim == 3 else x
    if g_gamma is not None:
        check_array("g_gamma", g_gamma, dtypes=FLOAT_DTYPES, what="(per-head log decay [heads] or [batch, heads])")
        if tuple(g_gamma.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"g_gamma must have shape [{heads}] or [{batch}, {heads}], got {describe(g_gamma)}")
        g_gamma = jnp.broadcast_to(g_gamma.astype(jnp.float32), (batch, heads))
    out["g_gamma"] = g_gamma
    states = batch
    if cu_seqlens is not None:
        check_cum_seqlens("cu_seqlens", cu_seqlens, total, "seq of query")
        if batch != 1:
            raise ValueError(f"cu_seqlens needs packed inputs with batch 1 ([1, total_tokens, ...]), got query {describe(query)}")
        cu_seqlens = cu_seqlens.astype(jnp.int32)
        states = cu_seqlens.shape[0] - 1
    out["cu_seqlens"] = cu_seqlens
    if initial_state is not None:
        rows = "num_seqs" if cu_seqlens is not None else "batch"
        check_array("initial_state", initial_state, rank=4, dtypes=FLOAT_DTYPES, what=f"[{rows}, heads, head_dim, value_dim]")
        if tuple(initial_state.shape) != (states, heads, dk, dv):
            raise ValueError(
                f"initial_state must have shape [{states}, {heads}, {dk}, {dv}] ([{rows}, heads, head_dim, value_dim]), "
                f"got {describe(initial_state)}"
            )
    out["initial_state"] = initial_state
    return out


class RecurrentAttention(RegistryOperation):
    """Gated linear attention as a recurrence (see the module docstring)."""

    algorithm = "recurrent"
    config_type = RecurrentConfig

    def validate(
        self, query, key, value, g=None, g_gamma=None, gk=None, gv=None, initial_state=None, cu_seqlens=None,
        *, softmax_scale=None, reverse=False,
    ):
        n = validate_linear_attention(
            query, key, value, gates=dict(g=g, gk=gk, gv=gv), g_gamma=g_gamma, initial_state=initial_state,
            cu_seqlens=cu_seqlens,
        )
        args = (query, key, value, n["g"], n["g_gamma"], n["gk"], n["gv"], n["initial_state"], n["cu_seqlens"])
        kwargs = dict(softmax_scale=resolve_softmax_scale(softmax_scale, query.shape[-1]), reverse=bool(reverse))
        return args, kwargs


@typechecked
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
    cfg: RecurrentConfig | None = None,
) -> tuple[Float[jax.Array, "batch seq heads value_dim"], Float[jax.Array, "states heads head_dim value_dim"]]:
    """Linear attention with log-space gates, run as a recurrence (see the module docstring).

    Args:
        query: ``[batch, seq, heads, head_dim]``; key ``[batch, seq, kv_heads, head_dim]``; value
            ``[batch, seq, kv_heads, value_dim]``.
        g: log gate ``[batch, seq, heads, head_dim]`` or ``[batch, seq, heads]``; gk: ``[batch, seq, heads,
            head_dim]``; gv: ``[batch, seq, heads, value_dim]``; g_gamma: ``[heads]`` or ``[batch, heads]``.
        softmax_scale: multiplies the queries (default ``head_dim ** -0.5``).
        initial_state: ``[batch (or num_seqs), heads, head_dim, value_dim]``.
        reverse: run from the last token to the first.
        cu_seqlens: int ``[num_seqs + 1]`` for packed sequences (batch 1).
        platform: ``"auto"`` or a backend name; cfg: a :class:`RecurrentConfig`.

    Returns:
        ``(output [batch, seq, heads, value_dim] in query's dtype, final_state float32)``.
    """
    return execute(
        RecurrentAttention(), query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, platform=platform, cfg=cfg,
    )


recurrent = recurrent_attention
"""The operation's catalogue name (``recurrent``); same function."""
