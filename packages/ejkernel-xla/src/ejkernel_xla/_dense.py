"""Dense flash attention: the whole ``[B, H, Sq, Skv]`` logits at once, with a hand-written VJP.

The semantics are those of ``docs/flash_attention.md`` (the same per-block math as ``_blockwise``: logits,
visibility, sinks, dropout). One-shot softmax: float32 logits, row max, ``exp``, row sum (+ the sinks),
normalized probabilities ``P``; dropout scales the kept ones; ``out = P @ V``.

Saved for the backward: ``P`` (before dropout) in the inputs' dtype, the per-row log-sum-exp and the
output, so the backward reads ``P`` instead of recomputing the logits (the blockwise backward recomputes
them: one more matmul and one more pass over the S² elements). Only a soft cap recomputes the logits
(its derivative needs them). ``dS = P * (dP - rowsum(dO * O))``; every matmul takes its operands in the
inputs' dtype with float32 accumulation, forward and backward. Plain autodiff of the dense formula
(``_blockwise.dense_attention``) would run the backward's matmuls in float32 (the float32 logits'
cotangent meets bfloat16 keys) and differentiate the softmax's division term by term.

Memory: the S² buffers of one call (``XlaFlashConfig.dense``'s rule in ``flash_attention.py`` bounds
them) and, between a differentiated forward and its backward, ``P``: ``B*H*Sq*Skv`` elements of the
inputs' dtype.

On a GPU the program is a few large XLA kernels: the logits GEMM, ONE fused softmax kernel (XLA's Triton
"normalization diamond": row max, exp, row sum and divide in one pass over the logits; masks built from
iotas inside it), the P @ V GEMM -- bound by the bytes of the S² logits, not by FLOPs. Two things keep it
there: rows that see nothing are guarded with constants (``EMPTY_ROW_GUARDS``), which that fusion
accepts, and causal calls run in query chunks over the key prefix each can see (``query_chunk_count``),
so they do not pay for the masked half. ``benchmarks/xla_gpu_hlo.py`` lists the kernels XLA compiles
for an H100 (no GPU needed); packages/ejkernel-xla/NOTES.md has the numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.ops.utils.dropout import inverted_dropout, seed_bits
from ejkernel_xla._blockwise import (
    AttentionParams,
    Tokens,
    _dropout_keep,
    _grouped,
    _logits,
    _ungrouped,
    weighted_values,
    sink_lse,
    slice_tokens,
    visibility,
)


def _visible(q_tok: Tokens, kv_tok: Tokens, params: AttentionParams, mask) -> jax.Array | None:
    """bool [B|1, 1|H, Sq, Skv], or None when every key is visible to every query (nothing to select).
    Only what the call asks for is built: causal alone is one comparison of two iotas, as in ``jax.nn``."""
    masked = (
        params.causal
        or params.sliding_window is not None
        or mask is not None
        or q_tok.segment is not None
        or q_tok.sequence is not None
    )
    if not masked:
        return None
    # whole sequences unless varlen: every token exists, no existence flags to read
    return visibility(q_tok, kv_tok, params, mask, all_valid=q_tok.sequence is None)


EMPTY_ROW_GUARDS = ("constants", "selects")
"""How the forward keeps a row with no visible key finite (zeros, not NaN) when something is masked.

``"constants"`` (the default): the row max is clamped from below by ``_ROW_MAX_FLOOR`` and the denominator
padded by ``_DENOMINATOR_PAD``; both are operations with constants on the row statistics, which XLA's GPU
softmax fusion (the Triton "normalization diamond") accepts: logits -> one fused softmax kernel -> P, as
for ``jax.nn``. ``"selects"``: ``where(isfinite(max), max, 0)`` and ``where(denominator > 0, ...)``; XLA
does not fuse those, and the softmax runs as three passes over the S² logits (row max, row sum, divide):
the causal forward ran at 0.85-0.90x ``jax.nn``'s on an H100. Kept to compare both on the device
(``benchmarks/xla_flash.py``); the sinks' forward always uses it (their per-head term on the row max is
not a constant, which XLA's softmax fusion does not accept either way)."""

_ROW_MAX_FLOOR = -1e30
"""Clamp of the row max: a row whose logits are all -inf (nothing visible) gets exp(-inf - floor) = 0 in
every column; a visible row's max is a real logit, far above it. (A row whose every visible logit lies
below -1e30, reachable only through a bias of that size, reads as empty: zeros.)"""

_DENOMINATOR_PAD = 1e-30
"""Added to the row sum: 0 + pad for an empty row (0 / pad = 0); a visible row's sum is >= 1 (its max
term is exp(0)), where adding 1e-30 leaves the float32 value unchanged."""


def _forward(params: AttentionParams, guard: str, q, k, v, bias, aux, mask, q_tok, kv_tok, seed, *, residuals: bool):
    """``(out [B, Sq, H, Dv]`` in q's dtype, ``P`` [B, Hkv, g, Sq, Skv] in v's dtype, ``lse`` [B, H, Sq] or
    None``)``. Unmasked, without sinks or dropout it is ``jax.nn``'s formula and nothing more: float32
    logits, row max, ``exp``, row sum, divide, cast, matmul; masked, the same with ``-inf`` at the hidden
    logits and ``guard`` (``EMPTY_ROW_GUARDS``) for rows that see nothing. ``residuals``: also the
    log-sum-exp (the sinks' gradient reads it)."""
    batch, q_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    s, _ = _logits(q, k, bias, params)  # float32 [B, Hkv, g, Sq, Skv]
    visible = _visible(q_tok, kv_tok, params, mask)
    if visible is not None:
        s = jnp.where(_grouped(visible, num_kv_heads), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    lse = None
    if aux is None and (visible is None or guard == "constants"):
        # one fused softmax kernel on a GPU (EMPTY_ROW_GUARDS); unmasked rows need no guard at all
        if visible is not None:
            m = jnp.maximum(m, _ROW_MAX_FLOOR)
        e = jnp.exp(s - m)
        denominator = jnp.sum(e, axis=-1, keepdims=True)
        if visible is not None:
            denominator = denominator + _DENOMINATOR_PAD
        p_saved = (e / denominator).astype(v.dtype)
    else:
        sinks = None
        if aux is not None:
            sinks = _grouped(sink_lse(aux, batch, num_heads, q_len), num_kv_heads)[..., None]
            m = jnp.maximum(m, sinks)
        # a row may see nothing only under a mask: then m = -inf, exp(-inf - 0) = 0 and the denominator is 0
        guarded = visible is not None
        if guarded:
            m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(s - m)
        denominator = jnp.sum(e, axis=-1, keepdims=True)
        if sinks is not None:
            denominator = denominator + jnp.exp(sinks - m)
        safe_denominator = jnp.where(denominator > 0, denominator, 1.0) if guarded else denominator
        p_saved = (e / safe_denominator).astype(v.dtype)
        if residuals and aux is not None:
            lse = m + jnp.log(safe_denominator)
            lse = _ungrouped(jnp.where(denominator > 0, lse, -jnp.inf)[..., 0] if guarded else lse[..., 0])
    p_used = p_saved
    if params.dropout_prob > 0.0:
        keep = _grouped(_dropout_keep(q_tok, kv_tok, seed, batch, num_heads, params), num_kv_heads)
        # from the saved P, as the backward does: both passes use the same rounded probabilities
        p_used = inverted_dropout(p_saved.astype(jnp.float32), keep, params.dropout_prob).astype(v.dtype)
    out = weighted_values(p_used, v).reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)
    return out, p_saved, lse


def _backward(params: AttentionParams, res, d_out):
    q, k, v, bias, aux, mask, q_tok, kv_tok, seed, out, p, lse = res
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dog = d_out.reshape(batch, q_len, num_kv_heads, group, d_out.shape[-1])
    # (``scores(dog, v)`` would give dP keys-minor under GQA too -- XLA's GPU program then reads it without
    # an S² transpose, one kernel fewer -- but its float32 sums no longer cancel delta's exactly where a row
    # sees one key: dq = 1e-7 instead of 0, which the suite's relative error at q_len = kv_len = 1 rejects)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, v, preferred_element_type=jnp.float32)
    p_used = p
    if params.dropout_prob > 0.0:
        keep = _grouped(_dropout_keep(q_tok, kv_tok, seed, batch, num_heads, params), num_kv_heads)
        p_used = inverted_dropout(p.astype(jnp.float32), keep, params.dropout_prob).astype(p.dtype)
        dp = inverted_dropout(dp, keep, params.dropout_prob)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p_used.astype(d_out.dtype), dog, preferred_element_type=jnp.float32)
    ds = p.astype(jnp.float32) * (dp - _grouped(delta, num_kv_heads)[..., None])  # = d(logits after soft cap)
    ds_raw = ds
    if params.logits_soft_cap is not None:
        _, capped = _logits(q, k, None, params)
        ds_raw = ds * (1.0 - capped * capped)
    ds_raw = (ds_raw * params.softmax_scale).astype(q.dtype)
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds_raw, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds_raw, qg, preferred_element_type=jnp.float32)
    dq = dq.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
    dbias = None
    if bias is not None:
        dbias = _ungrouped(ds)
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
        dbias = (jnp.sum(dbias, axis=axes, keepdims=True) if axes else dbias).astype(bias.dtype)
    d_aux = None
    if aux is not None:
        # sinks sit in the denominator only: d aux[h, k] = -sum_{b,i} P_sink[b,h,i,k] * delta[b,h,i]
        aux2 = aux.astype(jnp.float32)
        aux2 = aux2[:, None] if aux.ndim == 1 else aux2
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        p_sink = jnp.exp(aux2[None, :, None, :] - lse_safe[..., None])
        d_aux = -jnp.einsum("bhqk,bhq->hk", p_sink, delta).reshape(aux.shape).astype(aux.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), dbias, d_aux


def _dense_fwd(params, guard, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    with params.matmuls():
        out, p, lse = _forward(params, guard, q, k, v, bias, aux, mask, q_tok, kv_tok, seed, residuals=True)
    return out, (q, k, v, bias, aux, mask, q_tok, kv_tok, seed, out, p, lse)


def _dense_bwd(params, guard, res, d_out):
    with params.matmuls():
        dq, dk, dv, dbias, d_aux = _backward(params, res, d_out)
    # mask, tokens and seed are integers/booleans: no cotangent
    return dq, dk, dv, dbias, d_aux, None, None, None, None


def _dense_primal(params, guard, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    with params.matmuls():
        return _forward(params, guard, q, k, v, bias, aux, mask, q_tok, kv_tok, seed, residuals=False)[0]


_dense = jax.custom_vjp(_dense_primal, nondiff_argnums=(0, 1))
_dense.defvjp(_dense_fwd, _dense_bwd)


CAUSAL_CHUNK_QUERIES = 1024
"""Causal calls split their queries into chunks of about this many (at most ``MAX_CAUSAL_CHUNKS``); each
chunk attends densely to the key prefix it can see (``query_chunk_spans``)."""

MAX_CAUSAL_CHUNKS = 4
"""n chunks compute (n+1)/(2n) of the logits: 2 -> 75 %, 4 -> 62.5 %, 8 -> 56 %. Each chunk's key length
is another GEMM shape, which XLA's GPU autotuner tunes once per program: 4 keeps that compile time down
for most of the gain (NOTES.md)."""

FULL_CHUNK_QUERIES = 8192
"""Calls without causality split their queries into chunks of at most this many: the same logits, in S²
buffers of at most 8192 query rows each, so a forward+backward holds one chunk's transients at a time
(S=16k, 16 heads, bf16: 28 instead of 48 GiB of S² buffers, within an H100's dense budget; the rule in
``flash_attention.dense_peak_bytes`` counts them). Shorter calls run as one call, as before."""


def query_chunk_count(params: AttentionParams, q_len: int, kv_len: int, bias, mask, varlen: bool) -> int:
    """How many query chunks a call runs as (1: one dense attention over all keys).

    Causal with queries aligned to the end of the keys: query chunk ``c`` of ``n`` sees no key past its
    last query's position (nor, under a sliding window, before its first query's window), so it needs
    only a prefix (a range) of the keys -- the n chunks together compute
    ``(n+1)/(2n)`` of the S² logits (n = 4: 62.5 %) where the one dense call computes all of them, masks half
    and pays the bytes of every one (the dense path is bound by the S² traffic, NOTES.md). Without
    causality, chunks of ``FULL_CHUNK_QUERIES`` over all keys (smaller buffers, the same logits). Not with
    varlen (visibility is per packed sequence, not a prefix), a bias or an explicit mask (S² inputs of
    their own; they would be sliced per chunk -- possible, not done), or causal with more queries than
    keys."""
    if varlen or bias is not None or mask is not None:
        return 1
    if not params.causal:
        return -(-q_len // FULL_CHUNK_QUERIES)
    if q_len > kv_len:
        return 1
    return max(1, min(MAX_CAUSAL_CHUNKS, q_len // CAUSAL_CHUNK_QUERIES))


def query_chunk_spans(params: AttentionParams, q_len: int, kv_len: int, chunks: int) -> list[tuple[int, int, int, int]]:
    """``(start, stop, first, last)`` per query chunk: queries ``[start, stop)`` see keys ``[first, last)``:
    every key without causality; causal (queries aligned to the end of the keys), the keys up to the chunk's
    last query position, from its first query's window start under a sliding window."""
    offset = kv_len - q_len  # query i sits at position i + offset
    bounds = [round(c * q_len / chunks) for c in range(chunks + 1)]
    if not params.causal:
        return [(start, stop, 0, kv_len) for start, stop in zip(bounds[:-1], bounds[1:])]
    left = None if params.sliding_window is None else max(0, params.sliding_window[0])
    return [
        (start, stop, 0 if left is None else max(0, start + offset - left), stop + offset)
        for start, stop in zip(bounds[:-1], bounds[1:])
    ]


def _query_chunks(attend, query, key, value, q_tokens: Tokens, kv_tokens: Tokens, spans):
    """``attend(q_chunk, k_range, v_range, q_tok_chunk, kv_tok_range)`` per span of ``query_chunk_spans``,
    outputs concatenated along the sequence. Tokens carry their global positions and indices, so causality, a
    sliding window, segment ids and dropout's hash see each chunk exactly as in the whole call. Autodiff
    through the slices sums each chunk's key and value gradients into the whole arrays (O(S) work)."""
    outs = []
    for start, stop, first, last in spans:
        outs.append(attend(
            query[:, start:stop], key[:, first:last], value[:, first:last],
            slice_tokens(q_tokens, start, stop - start), slice_tokens(kv_tokens, first, last - first),
        ))
    return jnp.concatenate(outs, axis=1)


def flash_attention_dense(
    query,
    key,
    value,
    *,
    params: AttentionParams,
    bias=None,
    softmax_aux=None,
    attention_mask=None,
    q_tokens: Tokens,
    kv_tokens: Tokens,
    dropout_seed=None,
    empty_row_guard: str = "constants",
    query_chunks: int | None = None,
) -> jax.Array:
    """Dense attention with the VJP of the module docstring (memory O(S²)); the arguments of
    ``_blockwise.flash_attention_blockwise`` but no block sizes. ``empty_row_guard``: one of
    ``EMPTY_ROW_GUARDS``; ``query_chunks``: how many query chunks (None: ``query_chunk_count``; 1: one
    dense call). The defaults are the fast ones; the others are there to be measured against."""
    if empty_row_guard not in EMPTY_ROW_GUARDS:
        raise ValueError(f"empty_row_guard must be one of {EMPTY_ROW_GUARDS}, got {empty_row_guard!r}")
    seed = None if params.dropout_prob == 0.0 else seed_bits(dropout_seed)

    def attend(q, k, v, q_tok, kv_tok):
        return _dense(params, empty_row_guard, q, k, v, bias, softmax_aux, attention_mask, q_tok, kv_tok, seed)

    return _in_query_chunks(attend, params, query, key, value, bias, attention_mask, q_tokens, kv_tokens, query_chunks)


def dense_forward(params: AttentionParams, q, k, v, bias, aux, mask, q_tok, kv_tok, seed) -> jax.Array:
    """The dense forward alone (not differentiable by itself: the primal of a custom VJP whose rules are
    elsewhere), in the query chunks of ``flash_attention_dense``."""

    def attend(q_, k_, v_, q_tok_, kv_tok_):
        return _dense_primal(params, "constants", q_, k_, v_, bias, aux, mask, q_tok_, kv_tok_, seed)

    return _in_query_chunks(attend, params, q, k, v, bias, mask, q_tok, kv_tok, None)


def _in_query_chunks(attend, params, q, k, v, bias, mask, q_tok: Tokens, kv_tok: Tokens, chunks: int | None):
    """``attend`` over the query chunks of ``query_chunk_count`` (or ``chunks``), or once."""
    q_len, kv_len = q.shape[1], k.shape[1]
    chunks = chunks or query_chunk_count(params, q_len, kv_len, bias, mask, q_tok.sequence is not None)
    if chunks == 1:
        return attend(q, k, v, q_tok, kv_tok)
    return _query_chunks(attend, q, k, v, q_tok, kv_tok, query_chunk_spans(params, q_len, kv_len, chunks))


__all__ = [
    "CAUSAL_CHUNK_QUERIES",
    "EMPTY_ROW_GUARDS",
    "FULL_CHUNK_QUERIES",
    "dense_forward",
    "flash_attention_dense",
    "query_chunk_count",
    "query_chunk_spans",
]
