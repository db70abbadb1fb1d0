"""Dense, obviously-correct attention: the reference of ``flash_attention``, ``scaled_dot_product_attention``
and ``attention``. Every rule of ``docs/flash_attention.md`` is spelled out on the full [B, H, Sq, Skv]
logits; the visibility mask is built in numpy with explicit per-sequence loops (independent of any
backend's index arithmetic). Differentiable with ``jax.vjp``; call it on float64 inputs inside
``jax.enable_x64(True)`` (``ejkernel.testing.numerics.jax_float64``).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops.utils.dropout import keep_mask
from ejkernel.testing.numerics import exact_matmuls


def _window(sliding_window) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (int, np.integer)):
        return int(sliding_window), int(sliding_window)
    left, right = sliding_window
    return int(left), int(right)


def reference_visibility(
    batch: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    sliding_window=None,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
) -> np.ndarray:
    """bool [B, H, Sq, Skv]: may query i attend to key j (numpy, concrete inputs only)."""
    window = _window(sliding_window)
    visible = np.zeros((batch, num_heads, q_len, kv_len), bool)
    if cum_seqlens_q is None:
        spans = [(0, q_len, 0, kv_len)]
    else:
        cq, ck = np.asarray(cum_seqlens_q), np.asarray(cum_seqlens_k)
        spans = [(cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]
    for q0, q1, k0, k1 in spans:
        lq, lk = q1 - q0, k1 - k0
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        position = i + lk - lq  # bottom-right alignment
        ok = np.ones((lq, lk), bool)
        if causal:
            ok &= j <= position
        if window is not None:
            ok &= (j >= position - window[0]) & (j <= position + window[1])
        visible[:, :, q0:q1, k0:k1] = ok
    if q_segment_ids is not None or kv_segment_ids is not None:
        qs = np.asarray(q_segment_ids if q_segment_ids is not None else kv_segment_ids)
        ks = np.asarray(kv_segment_ids if kv_segment_ids is not None else q_segment_ids)
        visible &= (qs[:, :, None] == ks[:, None, :])[:, None]
    if attention_mask is not None:
        visible &= np.asarray(attention_mask, bool)
    return visible


@exact_matmuls
def reference_attention_weights(
    query,
    key,
    bias=None,
    *,
    softmax_scale=None,
    logits_soft_cap=None,
    softmax_aux=None,
    visible: np.ndarray,
):
    """Softmax probabilities [B, H, Sq, Skv] (sinks in the denominator; rows seeing nothing are 0)."""
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    key_per_q_head = jnp.repeat(key, num_heads // num_kv_heads, axis=2)  # head h reads kv head h // g
    s = jnp.einsum("bqhd,bkhd->bhqk", query, key_per_q_head) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias
    vis = jnp.asarray(visible)
    if softmax_aux is None:
        sinks = jnp.zeros((num_heads, 0), s.dtype)
    else:
        sinks = softmax_aux if softmax_aux.ndim == 2 else softmax_aux[:, None]
    sinks = jnp.broadcast_to(sinks[None, :, None, :].astype(s.dtype), (*s.shape[:3], sinks.shape[-1]))
    # the max only stabilises exp; it cancels, so it carries no gradient
    m = jax.lax.stop_gradient(
        jnp.maximum(jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1), jnp.max(sinks, axis=-1, initial=-jnp.inf))
    )
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    e = jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - m), 0.0)
    denominator = jnp.sum(e, axis=-1, keepdims=True) + jnp.sum(jnp.exp(sinks - m), axis=-1, keepdims=True)
    return e / jnp.where(denominator > 0, denominator, 1.0)


def reference_dropout_keep(batch: int, num_heads: int, q_len: int, kv_len: int, seed: int, dropout_prob: float):
    """bool [B, H, Sq, Skv]: the keep mask of ``ejkernel.ops.utils.dropout`` at every index."""
    b = jnp.arange(batch)[:, None, None, None]
    h = jnp.arange(num_heads)[None, :, None, None]
    i = jnp.arange(q_len)[None, None, :, None]
    j = jnp.arange(kv_len)[None, None, None, :]
    return keep_mask(seed, b, h, i, j, dropout_prob)


@exact_matmuls
def reference_flash_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal: bool = False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob: float = 0.0,
    dropout_seed=None,
    cum_seqlens_q=None,
    cum_seqlens_k=None,
    softmax_aux=None,
    return_weights: bool = False,
):
    """``out [B, Sq, H, Dv]`` (and the pre-dropout weights with ``return_weights``), computed densely."""
    batch, q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    visible = reference_visibility(batch, num_heads, q_len, kv_len, **_visibility_keywords(locals()))
    weights = reference_attention_weights(
        query,
        key,
        bias,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux,
        visible=visible,
    )
    p = weights
    if dropout_prob > 0.0:
        seed = 0 if dropout_seed is None else dropout_seed
        keep = reference_dropout_keep(batch, num_heads, q_len, kv_len, seed, dropout_prob)
        p = jnp.where(keep, weights / (1.0 - dropout_prob), 0.0)
    value_per_q_head = jnp.repeat(value, num_heads // num_kv_heads, axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, value_per_q_head)
    return (out, weights) if return_weights else out


def _visibility_keywords(arguments: dict) -> dict:
    """The arguments of a flash_attention reference that :func:`reference_visibility` takes."""
    return {name: arguments[name] for name in _VISIBILITY}


_VISIBILITY = tuple(
    p.name for p in inspect.signature(reference_visibility).parameters.values() if p.kind is p.KEYWORD_ONLY
)


def reference_flash_attention_numpy(
    query, key, value, bias=None, *, d_out=None, **keywords
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The same reference in plain float64 numpy (nothing to compile, so suites stay fast), with the
    textbook softmax-attention gradients for cotangent ``d_out``. ``keywords``: those of
    :func:`reference_flash_attention` (but ``return_weights``). Returns ``(out, weights, grads)``;
    ``grads`` has query/key/value and bias/softmax_aux when given (empty without ``d_out``). The
    suites check it against ``jax.vjp`` of :func:`reference_flash_attention` (the autodiff form)."""
    bound = inspect.signature(reference_flash_attention).bind(query, key, value, bias, **keywords)
    bound.apply_defaults()
    arguments = bound.arguments
    softmax_scale, logits_soft_cap = arguments["softmax_scale"], arguments["logits_soft_cap"]
    dropout_prob, dropout_seed = arguments["dropout_prob"], arguments["dropout_seed"]
    f64 = lambda x: None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, np.float64)  # noqa: E731
    q, k, v, b, aux = f64(query), f64(key), f64(value), f64(bias), f64(arguments["softmax_aux"])
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    visible = reference_visibility(batch, num_heads, q_len, kv_len, **_visibility_keywords(arguments))
    k_rep = np.repeat(k, group, axis=2)  # query head h reads kv head h // group
    v_rep = np.repeat(v, group, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale
    capped = None
    s = raw
    if logits_soft_cap is not None:
        capped = np.tanh(raw / logits_soft_cap)
        s = logits_soft_cap * capped
    if b is not None:
        s = s + b
    sinks = np.zeros((num_heads, 0)) if aux is None else (aux if aux.ndim == 2 else aux[:, None])
    sinks_b = np.broadcast_to(sinks[None, :, None, :], (batch, num_heads, q_len, sinks.shape[1]))
    m = np.maximum(np.max(np.where(visible, s, -np.inf), axis=-1), np.max(sinks_b, axis=-1, initial=-np.inf))
    m = np.where(np.isfinite(m), m, 0.0)[..., None]
    e = np.where(visible, np.exp(np.where(visible, s, 0.0) - m), 0.0)
    e_sinks = np.exp(sinks_b - m)
    denominator = e.sum(-1, keepdims=True) + e_sinks.sum(-1, keepdims=True)
    denominator = np.where(denominator > 0, denominator, 1.0)
    weights, sink_weights = e / denominator, e_sinks / denominator
    keep_scaled = np.ones_like(weights)
    if dropout_prob > 0.0:
        seed = 0 if dropout_seed is None else int(dropout_seed)
        keep = np.asarray(reference_dropout_keep(batch, num_heads, q_len, kv_len, seed, dropout_prob))
        keep_scaled = keep / (1.0 - dropout_prob)
    p_dropped = weights * keep_scaled
    out = np.einsum("bhqk,bkhd->bqhd", p_dropped, v_rep)
    grads: dict[str, np.ndarray] = {}
    if d_out is None:
        return out, weights, grads
    do = f64(d_out)
    dv_rep = np.einsum("bhqk,bqhd->bkhd", p_dropped, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v_rep) * keep_scaled
    delta = np.sum(weights * dp, axis=-1, keepdims=True)  # = rowsum(d_out * out)
    ds = weights * (dp - delta)  # gradient of the logits after bias (sinks have no value: dp = 0)
    if b is not None:
        grads["bias"] = ds.sum(axis=tuple(a for a in (0, 1) if b.shape[a] == 1), keepdims=True)
    if aux is not None:
        d_sinks = -np.einsum("bhqk,bhq->hk", sink_weights, delta[..., 0])
        grads["softmax_aux"] = d_sinks.reshape(aux.shape)
    d_raw = ds if capped is None else ds * (1.0 - capped**2)
    grads["query"] = np.einsum("bhqk,bkhd->bqhd", d_raw, k_rep) * scale
    dk_rep = np.einsum("bhqk,bqhd->bkhd", d_raw, q) * scale
    grads["key"] = dk_rep.reshape(batch, kv_len, num_kv_heads, group, head_dim).sum(3)
    grads["value"] = dv_rep.reshape(batch, kv_len, num_kv_heads, group, -1).sum(3)
    return out, weights, grads


# ---- pieces of the other operations' references (paged, ragged, MLA, sparse) ------------------------


@exact_matmuls
def masked_softmax_attention(logits, visible, values, sinks=None):
    """Dense softmax over ``visible`` keys (``logits`` ``[..., H, Q, K]``, ``values`` ``[..., H, K, Dv]``);
    rows without a visible key give zeros; ``sinks`` ``[H, n]`` join the denominator only."""
    masked = jnp.where(visible, logits, -jnp.inf)
    row_max = masked.max(axis=-1, keepdims=True)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks.max(axis=-1)[:, None, None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(masked - row_max), 0.0)
    denominator = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + jnp.exp(sinks[:, None, :] - row_max).sum(axis=-1, keepdims=True)
    probs = weights / jnp.where(denominator == 0, 1.0, denominator)
    return probs @ values


def soft_cap(logits, cap):
    return logits if cap is None else cap * jnp.tanh(logits / cap)
