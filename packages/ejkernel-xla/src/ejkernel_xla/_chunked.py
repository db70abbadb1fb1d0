"""Chunked linear attention with log-space gates: the engine of ``recurrent``, ``gla`` and
``lightning_attention``.

The recurrence (per batch row and head; ``a_t`` [K] and ``b_t`` [V] are log decays)::

    S_t = diag(exp(a_t)) S_{t-1} diag(exp(b_t)) + k_t v_t^T,     o_t = (scale q_t)^T S_t

is evaluated chunk by chunk (chunk length ``C``). With ``A_t``/``B_t`` the cumulative log decays since
the chunk start (or since the sequence start, when a packed sequence starts inside the chunk):

- intra-chunk: ``o_t += sum_{s<=t, same sequence} <q_t, k_s exp(A_t - A_s)> v_s exp(B_t - B_s)``;
  with scalar decays (one per token and head) this is ``(Q K^T * decay mask) V``, two matmuls; with
  per-dimension key decays, pairs across sub-chunks of 16 tokens are matmuls of queries and keys decayed
  to the sub-chunk start (exponents never positive for decays, so nothing overflows however strong the
  gates) and pairs inside a sub-chunk use the exact pairwise factor; with value-dimension decays too,
  the pairwise factors span the chunk (a small one);
- inter-chunk: ``o_t += (q_t exp(A_t))^T S_in exp(B_t)`` with ``S_in`` the state entering the chunk,
  passed along by a ``lax.scan`` over chunks:
  ``S_out = exp(A_C) S_in exp(B_C) + sum_s (k_s exp(A_C - A_s)) (v_s exp(B_C - B_s))^T``.

Memory is O(T * C) for activations plus one ``K x V`` state per chunk; gradients come from autodiff
with the chunk tiles recomputed in the backward pass (``jax.checkpoint``), so they stay O(T * C) too.
Every matmul, forward and backward, runs at the caller's ``precision`` (no custom VJP: autodiff keeps
the precision bound to each forward matmul).

Varlen (``cu_seqlens``, batch 1): tokens carry a sequence id; pairs across sequences are masked, a
sequence starting inside a chunk starts from its own initial state, and each sequence's final state is
rebuilt from the state entering the chunk holding its last token. Tokens past ``cu_seqlens[-1]``
output zeros. ``reverse`` runs every sequence back to front.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ejkernel.modules.operations._precision import matmul_precision
from ejkernel.ops.utils.padding import pad_axis

F32 = jnp.float32


class _Layout(NamedTuple):
    """Where each (padded) token sits. Arrays are [T_pad] (shared by the batch)."""

    sequence: jax.Array  # int32 sequence id (0 without varlen; num_seqs for tokens past the end)
    valid: jax.Array  # bool, a real token of some sequence
    first_local: jax.Array  # int32 index in its chunk of the first token of its sequence in that chunk
    continues: jax.Array  # bool, its sequence started before its chunk (reads the carried state)


def _layout(total: int, padded: int, chunk: int, cu_seqlens) -> _Layout:
    tokens = jnp.arange(padded, dtype=jnp.int32)
    chunk_start = (tokens // chunk) * chunk
    if cu_seqlens is None:
        valid = tokens < total
        sequence = jnp.zeros_like(tokens)
        return _Layout(sequence, valid, jnp.zeros_like(tokens), jnp.ones_like(valid))
    cu = cu_seqlens.astype(jnp.int32)
    num_seqs = cu.shape[0] - 1
    valid = tokens < cu[-1]
    sequence = jnp.searchsorted(cu[1:], tokens, side="right").astype(jnp.int32)  # num_seqs past the end
    start = cu[jnp.minimum(sequence, num_seqs - 1)]
    start = jnp.where(valid, start, cu[-1])
    first_local = jnp.maximum(start, chunk_start) - chunk_start
    return _Layout(sequence, valid, first_local, start < chunk_start)


def _reverse_permutation(padded: int, cu_seqlens) -> jax.Array:
    """Token order that runs every packed sequence back to front (an involution)."""
    tokens = jnp.arange(padded, dtype=jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    sequence = jnp.searchsorted(cu[1:], tokens, side="right")
    inside = tokens < cu[-1]
    sequence = jnp.minimum(sequence, cu.shape[0] - 2)
    return jnp.where(inside, cu[sequence] + cu[sequence + 1] - 1 - tokens, tokens)


def _chunks(x, chunk):
    """[B, T, H, D] -> [B, H, N, C, D] (heads first: every chunk op is a batched matmul)."""
    b, t, h, d = x.shape
    return jnp.transpose(x.reshape(b, t // chunk, chunk, h, d), (0, 3, 1, 2, 4))


def _cumulative(log_decay, layout: _Layout, chunk):
    """Cumulative log decay since the chunk start, restarted where a sequence starts inside the chunk.

    ``log_decay`` [B, H, N, C, D]; ``first_local`` picks the exclusive prefix at the sequence's start.
    """
    inclusive = jnp.cumsum(log_decay, axis=3)
    exclusive = inclusive - log_decay
    n = log_decay.shape[2]
    first = layout.first_local.reshape(1, 1, n, chunk, 1)
    first = jnp.broadcast_to(first, exclusive.shape[:-1] + (1,))
    return inclusive - jnp.take_along_axis(exclusive, first, axis=3)


SUB_CHUNK = 16
"""With per-dimension decays, pairs inside one sub-chunk of this many tokens use the exact pairwise factor;
pairs across sub-chunks are a matmul (see ``_vector_decay_scores``)."""


def _vector_decay_scores(q, k, a, seq, mask):
    """``<q_t, k_s exp(A_t - A_s)>`` for every pair of each chunk, per-dimension decays ([B,H,N,C,C]).

    Across sub-chunks the decay is split at the first token ``r`` of the query's sub-chunk:
    ``exp(A_t - A_r) * exp(A_r - A_s)`` (both exponents <= 0 for decays, so nothing overflows) and the
    sum over K becomes a matmul. Inside a sub-chunk the factor is formed pairwise. Factors are only
    formed within one sequence (``seq``), so packed sequences never mix.
    """
    *lead, chunk, dk = q.shape
    sub = SUB_CHUNK if chunk % SUB_CHUNK == 0 else chunk
    n = chunk // sub
    q_sub, a_sub = q.reshape(*lead, n, sub, dk), a.reshape(*lead, n, sub, dk)
    seq_sub = seq.reshape(-1, n, sub)  # [N, n, c]
    a_ref, seq_ref = a_sub[..., :1, :], seq_sub[..., :1]  # the first token of every sub-chunk
    with_ref = (seq_sub == seq_ref)[None, None, ..., None]
    q_scaled = q_sub * jnp.exp(jnp.where(with_ref, a_sub - a_ref, 0.0))
    # keys before the sub-chunk start, decayed up to it: [B, H, N, n(query sub-chunk), C, K]
    before = (jnp.arange(chunk)[None, :] < (jnp.arange(n) * sub)[:, None])[None]  # [1, n, C]
    usable = (before & (seq[:, None, :] == seq_ref))[None, None, ..., None]  # [1, 1, N, n, C, 1]
    k_decay = jnp.exp(jnp.where(usable, a_ref - a[..., None, :, :], 0.0))
    k_scaled = jnp.where(usable, k[..., None, :, :] * k_decay, 0.0)
    across = jnp.einsum("bhnitk,bhnisk->bhnits", q_scaled, k_scaled).reshape(*lead, chunk, chunk)
    # pairs inside one sub-chunk
    inner_mask = mask.reshape(*mask.shape[:-2], n, sub, n, sub)
    inner_mask = jnp.diagonal(inner_mask, axis1=-4, axis2=-2)  # [..., c, c, n]
    inner_mask = jnp.moveaxis(inner_mask, -1, -3)[..., None]  # [..., n, c, c, 1]
    diff = jnp.where(inner_mask, a_sub[..., :, None, :] - a_sub[..., None, :, :], 0.0)
    inner = jnp.einsum("bhnitk,bhnisk,bhnitsk->bhnits", q_sub, k.reshape(q_sub.shape),
                       jnp.where(inner_mask, jnp.exp(diff), 0.0))
    inner = inner[..., :, :, None, :] * jnp.eye(n, dtype=inner.dtype)[:, None, :, None]  # block diagonal
    return jnp.where(mask, across + inner.reshape(*lead, chunk, chunk), 0.0)


def _intra_chunk(q, k, v, a, b, same, seq, scalar_decay):
    """Outputs of the pairs inside each chunk. q/k [B,H,N,C,K], v [B,H,N,C,V], a [.., K|1], b [.., V]|None,
    ``same`` bool [N, C(t), C(s)]: s <= t, same sequence, s valid; ``seq`` int [N, C] sequence ids."""
    mask = same[None, None]
    if scalar_decay:
        decay = jnp.exp(jnp.where(mask, a[..., :, None, 0] - a[..., None, :, 0], 0.0))  # [B,H,N,C,C]
        scores = jnp.einsum("bhntk,bhnsk->bhnts", q, k) * jnp.where(mask, decay, 0.0)
    elif b is None:
        scores = _vector_decay_scores(q, k, a, seq, mask)
    else:  # value-dimension decays too: exact pairwise factors over the chunk (keep the chunk small)
        diff = jnp.where(mask[..., None], a[..., :, None, :] - a[..., None, :, :], 0.0)  # [B,H,N,C,C,K]
        pair = jnp.where(mask[..., None], jnp.exp(diff), 0.0)
        scores = jnp.einsum("bhntk,bhnsk,bhntsk->bhnts", q, k, pair)
    if b is None:
        return jnp.einsum("bhnts,bhnsv->bhntv", scores, v)
    value_diff = jnp.where(mask[..., None], b[..., :, None, :] - b[..., None, :, :], 0.0)
    value_pair = jnp.where(mask[..., None], jnp.exp(value_diff), 0.0)
    return jnp.einsum("bhnts,bhntsv,bhnsv->bhntv", scores, value_pair, v)


def _gather_state(h0, ids):
    """``h0`` [S, H, K, V] rows ``ids`` [...]; zeros for ids out of range (tokens past the end)."""
    safe = jnp.clip(ids, 0, h0.shape[0] - 1)
    rows = h0[safe]
    return jnp.where(((ids >= 0) & (ids < h0.shape[0]))[(...,) + (None,) * 3], rows, 0.0)


# One compiled program per (shapes, static arguments): called eagerly, the chunk loops would otherwise
# be dispatched op by op.
@functools.partial(jax.jit, static_argnames=("scale", "reverse", "chunk_size", "precision"))
def chunked_linear_attention(
    q,
    k,
    v,
    log_decay_k=None,
    log_decay_v=None,
    initial_state=None,
    cu_seqlens=None,
    *,
    scale: float,
    reverse: bool = False,
    chunk_size: int = 64,
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST,
):
    """See the module docstring.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (kv heads already repeated to H).
        log_decay_k: [B, T, H, K] or [B, T, H, 1] (scalar per token and head) or None.
        log_decay_v: [B, T, H, V] or None.
        initial_state: [B, H, K, V] (or [num_seqs, H, K, V] with ``cu_seqlens``) or None.
        cu_seqlens: int32 [num_seqs + 1] (then B == 1) or None.
        precision: of every matmul. The matmuls are bound with it here, so the gradients (autodiff,
            traced from these equations, the rematerialized ones included) run at it too.

    Returns:
        ``(o, final_state)``: float32 [B, T, H, V] and float32 [B or num_seqs, H, K, V].
    """
    with matmul_precision(precision):
        return _chunked_linear_attention(
            q, k, v, log_decay_k, log_decay_v, initial_state, cu_seqlens, scale=scale, reverse=reverse,
            chunk_size=chunk_size,
        )


def _chunked_linear_attention(q, k, v, log_decay_k, log_decay_v, initial_state, cu_seqlens, *, scale, reverse, chunk_size):
    batch, total, heads, dk = q.shape
    dv = v.shape[-1]
    chunk = int(chunk_size)
    # short inputs: one chunk, rounded up to whole sub-chunks when the chunk is made of them
    chunk = min(chunk, -(-total // SUB_CHUNK) * SUB_CHUNK if chunk % SUB_CHUNK == 0 else total)
    padded = -(-total // chunk) * chunk
    num_chunks = padded // chunk
    varlen = cu_seqlens is not None

    q, k, v = (x.astype(F32) for x in (q, k, v))
    q = q * scale
    if log_decay_k is None:
        log_decay_k = jnp.zeros((batch, total, heads, 1), F32)
    scalar_decay = log_decay_k.shape[-1] == 1 and log_decay_v is None
    arrays = [pad_axis(x, 1, padded) for x in (q, k, v, log_decay_k.astype(F32))]
    arrays.append(None if log_decay_v is None else pad_axis(log_decay_v.astype(F32), 1, padded))
    permutation = None
    if reverse:  # padding stays at the end: only real tokens are reordered
        bounds = cu_seqlens if varlen else jnp.asarray([0, total], jnp.int32)
        permutation = _reverse_permutation(padded, bounds)
        arrays = [None if x is None else x[:, permutation] for x in arrays]
    layout = _layout(total, padded, chunk, cu_seqlens)
    valid = layout.valid[None, :, None, None]
    q, k, v, a, b = (None if x is None else jnp.where(valid, x, 0.0) for x in arrays)

    qc, kc, vc, ac = (_chunks(x, chunk) for x in (q, k, v, a))
    bc = None if b is None else _chunks(b, chunk)
    ac = _cumulative(ac, layout, chunk)
    bc = None if bc is None else _cumulative(bc, layout, chunk)

    seq = layout.sequence.reshape(num_chunks, chunk)
    ok = layout.valid.reshape(num_chunks, chunk)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = causal[None] & (seq[:, :, None] == seq[:, None, :]) & ok[:, None, :]

    intra = jax.checkpoint(functools.partial(_intra_chunk, scalar_decay=scalar_decay))
    o = intra(qc, kc, vc, ac, bc, same, seq)

    # Per-chunk summaries: what the chunk adds to the state of its last token's sequence, and the decay.
    last = (slice(None),) * 3 + (slice(chunk - 1, chunk),)
    with_last = (seq == seq[:, -1:]) & ok  # [N, C]
    key_weight = jnp.exp(jnp.where(with_last[None, None, :, :, None], ac[last] - ac, 0.0))
    keys = jnp.where(with_last[None, None, :, :, None], kc * key_weight, 0.0)
    values = vc
    if bc is not None:
        value_weight = jnp.exp(jnp.where(with_last[None, None, :, :, None], bc[last] - bc, 0.0))
        values = jnp.where(with_last[None, None, :, :, None], vc * value_weight, 0.0)
    update = jnp.einsum("bhnck,bhncv->bnhkv", keys, values)  # [B, N, H, K, V]
    decay_k = jnp.moveaxis(jnp.exp(ac[..., -1, :]), 2, 1)[..., :, None]  # [B, N, H, K|1, 1]
    decay_v = None if bc is None else jnp.moveaxis(jnp.exp(bc[..., -1, :]), 2, 1)[..., None, :]
    continues = layout.continues.reshape(num_chunks, chunk)

    state_rows = batch if not varlen else cu_seqlens.shape[0] - 1
    h0 = None if initial_state is None else initial_state.astype(F32)
    if h0 is None:
        start_state = jnp.zeros((batch, heads, dk, dv), F32)
    else:
        start_state = h0 if not varlen else jnp.zeros((1, heads, dk, dv), F32)
    if varlen and h0 is not None:
        last_base = _gather_state(h0, seq[:, -1])[:, None]  # [N, 1, H, K, V]
    else:
        last_base = jnp.zeros((num_chunks, 1, heads, dk, dv), F32)

    def step(state, xs):
        upd, dec_k, dec_v, cont_last, fresh = xs
        base = jnp.where(cont_last, state, fresh)
        new = base * dec_k if dec_v is None else base * dec_k * dec_v
        return new + upd, state

    xs = (
        jnp.moveaxis(update, 1, 0),
        jnp.moveaxis(decay_k, 1, 0),
        None if decay_v is None else jnp.moveaxis(decay_v, 1, 0),
        continues[:, -1],
        last_base,
    )
    final, entering = jax.lax.scan(step, start_state, xs)  # entering: [N, B, H, K, V]
    entering = jnp.moveaxis(entering, 0, 1)  # [B, N, H, K, V]

    # Inter-chunk output of tokens whose sequence continues from earlier chunks.
    q_decayed = qc * jnp.exp(ac)
    inter = jnp.einsum("bhnck,bnhkv->bhncv", q_decayed, entering)
    inter = jnp.where(continues[None, None, :, :, None], inter, 0.0)
    if varlen and h0 is not None:  # sequences starting inside a chunk read their own initial state

        def fresh_output(args):
            q_chunk, ids = args  # [B, H, C, K], [C]
            return jnp.einsum("bhck,chkv->bhcv", q_chunk, _gather_state(h0, ids))

        fresh = jax.lax.map(jax.checkpoint(fresh_output), (jnp.moveaxis(q_decayed, 2, 0), seq))
        fresh = jnp.moveaxis(fresh, 0, 2)
        inter = inter + jnp.where(continues[None, None, :, :, None] | ~ok[None, None, :, :, None], 0.0, fresh)
    if bc is not None:
        inter = inter * jnp.exp(bc)
    o = o + inter

    o = jnp.transpose(o, (0, 2, 3, 1, 4)).reshape(batch, padded, heads, dv)
    o = jnp.where(valid, o, 0.0)
    if reverse:
        o = o[:, permutation]
    o = o[:, :total]

    if not varlen:
        return o, final
    return o, _varlen_final_states(
        cu_seqlens, chunk, kc, vc, ac, bc, entering, h0, layout, state_rows, (heads, dk, dv)
    )


def _varlen_final_states(cu_seqlens, chunk, kc, vc, ac, bc, entering, h0, layout, num_seqs, dims):
    """State after each sequence's last token: its chunk's entering state (or its own initial state,
    when it started inside that chunk) decayed, plus its tokens of that chunk."""
    heads, dk, dv = dims
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    end = jnp.maximum(cu[1:] - 1, 0)
    chunk_id, local = end // chunk, end % chunk
    take = lambda x: x[0][:, chunk_id]  # [H, S, C, D] (batch is 1 with varlen)
    k_chunk, v_chunk, a_chunk = take(kc), take(vc), take(ac)
    seq_chunk = layout.sequence.reshape(-1, chunk)[chunk_id]  # [S, C]
    positions = jnp.arange(chunk)
    member = (seq_chunk == jnp.arange(num_seqs)[:, None]) & (positions[None, :] <= local[:, None])
    member = member[None, :, :, None]
    a_end = jnp.take_along_axis(a_chunk, local[None, :, None, None], axis=2)  # [H, S, 1, K|1]
    keys = jnp.where(member, k_chunk * jnp.exp(jnp.where(member, a_end - a_chunk, 0.0)), 0.0)
    values = v_chunk
    if bc is not None:
        b_chunk = take(bc)
        b_end = jnp.take_along_axis(b_chunk, local[None, :, None, None], axis=2)
        values = v_chunk * jnp.exp(jnp.where(member, b_end - b_chunk, 0.0))
    own = jnp.einsum("hsck,hscv->shkv", keys, values)
    continues = layout.continues[end]
    base = jnp.where(continues[:, None, None, None], entering[0, chunk_id], 0.0)
    if h0 is not None:
        base = jnp.where(continues[:, None, None, None], base, h0)
    decay = jnp.moveaxis(jnp.exp(a_end[:, :, 0, :]), 0, 1)[..., None]  # [S, H, K|1, 1]
    state = base * decay
    if bc is not None:
        state = state * jnp.moveaxis(jnp.exp(b_end[:, :, 0, :]), 0, 1)[..., None, :]
    state = state + own
    empty = (lengths == 0)[:, None, None, None]
    fallback = jnp.zeros((num_seqs, heads, dk, dv), F32) if h0 is None else h0
    return jnp.where(empty, fallback, state)
