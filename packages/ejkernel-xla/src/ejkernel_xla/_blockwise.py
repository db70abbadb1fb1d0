"""Blockwise (online-softmax) attention in pure JAX: the block steps and the flash-attention driver.

The semantics are those of ``docs/flash_attention.md``. Everything is written for one *q block* against
one *kv block*; the full attention is a scan over blocks, so memory grows with the sequence length, not
its square. Other operations reuse the pieces (``ring_attention`` runs :func:`forward_block` /
:func:`backward_block` on the kv shard it currently holds; the dense operations call
:func:`visibility` on the whole sequence).

Layout of every block argument (standard ejkernel layout, the block being a slice of the sequence):
``q [B, bq, H, D]``, ``k [B, bk, Hkv, D]``, ``v [B, bk, Hkv, Dv]``, ``bias [B|1, H|1, bq, bk]``,
``mask [B, 1|H, bq, bk]`` (True = may attend). Query head ``h`` reads kv head ``h // (H // Hkv)``.

Where a token sits is described by :class:`Tokens` (one per block, for queries and for keys): its global
index (dropout hashes it), its position in key coordinates (queries are already aligned bottom-right,
so causal is ``kv.position <= q.position``), whether it exists, and its segment / varlen sequence ids.
:func:`query_tokens` and :func:`key_tokens` build them for a whole sequence; slice them with
:func:`slice_tokens`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.modules.operations._precision import matmul_precision
from ejkernel.ops.utils.dropout import inverted_dropout, keep_mask, seed_bits
from ejkernel.ops.utils.padding import pad_axis

# ---- token descriptions ---------------------------------------------------------------------------


class Tokens(NamedTuple):
    """Where the tokens of a block sit (see the module docstring). Leading dims broadcast to [B, n]."""

    index: jax.Array
    """int32 [n]: index into the (packed) array as passed; dropout hashes it."""
    position: jax.Array
    """int32 [B|1, n]: position in key coordinates (queries: aligned to the end of their keys)."""
    valid: jax.Array
    """bool [B|1, n]: the token exists (False for block padding and tokens past ``cum_seqlens[-1]``)."""
    segment: jax.Array | None = None
    """int32 [B, n] segment ids (attend only within equal ids), or None."""
    sequence: jax.Array | None = None
    """int32 [B|1, n] varlen sequence of each token, or None."""


def _varlen_layout(cum_seqlens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For packed tokens 0..n-1: (sequence id, local index, exists)."""
    cum = cum_seqlens.astype(jnp.int32)
    index = jnp.arange(n, dtype=jnp.int32)
    sequence = jnp.searchsorted(cum, index, side="right").astype(jnp.int32) - 1
    sequence = jnp.clip(sequence, 0, cum.shape[0] - 2)
    exists = index < cum[-1]
    return sequence, index - cum[sequence], exists


def query_tokens(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    segment_ids: jax.Array | None = None,
    cum_seqlens_q: jax.Array | None = None,
    cum_seqlens_k: jax.Array | None = None,
) -> Tokens:
    """Tokens of a whole query sequence; positions aligned to the end of the keys (per sequence if varlen)."""
    index = jnp.arange(q_len, dtype=jnp.int32)
    if cum_seqlens_q is None:
        position = (index + (kv_len - q_len))[None]
        valid = jnp.ones((1, q_len), bool)
        sequence = None
    else:
        seq, local, exists = _varlen_layout(cum_seqlens_q, q_len)
        len_q = cum_seqlens_q[seq + 1] - cum_seqlens_q[seq]
        len_k = cum_seqlens_k[seq + 1] - cum_seqlens_k[seq]
        position = (local + len_k - len_q).astype(jnp.int32)[None]
        valid = exists[None]
        sequence = seq[None]
    segment = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return Tokens(index, position, valid, segment, sequence)


def key_tokens(
    batch: int,
    kv_len: int,
    *,
    segment_ids: jax.Array | None = None,
    cum_seqlens_k: jax.Array | None = None,
) -> Tokens:
    """Tokens of a whole key sequence (positions local to their varlen sequence)."""
    index = jnp.arange(kv_len, dtype=jnp.int32)
    if cum_seqlens_k is None:
        position, valid, sequence = index[None], jnp.ones((1, kv_len), bool), None
    else:
        seq, local, exists = _varlen_layout(cum_seqlens_k, kv_len)
        position, valid, sequence = local[None], exists[None], seq[None]
    segment = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return Tokens(index, position, valid, segment, sequence)


def pad_tokens(tokens: Tokens, length: int) -> Tokens:
    """Extend to ``length`` tokens with non-existent ones (block padding)."""
    n = tokens.index.shape[0]
    extra = length - n
    if extra == 0:
        return tokens

    def pad(x, value):
        return None if x is None else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=value)

    return Tokens(
        index=jnp.arange(length, dtype=jnp.int32),
        position=pad(tokens.position, 0),
        valid=pad(tokens.valid, False),
        segment=pad(tokens.segment, 0),
        sequence=pad(tokens.sequence, -1),
    )


def slice_tokens(tokens: Tokens, start, size: int) -> Tokens:
    """Tokens ``start .. start+size`` (``start`` may be traced)."""

    def take(x):
        if x is None:
            return None
        return lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)

    return Tokens(*(take(x) for x in tokens))


def _blocked_tokens(tokens: Tokens, num_blocks: int, block: int) -> Tokens:
    """[.., n] fields -> [num_blocks, .., block] so ``lax.scan`` walks the blocks."""

    def split(x):
        if x is None:
            return None
        x = x.reshape(*x.shape[:-1], num_blocks, block)
        return jnp.moveaxis(x, -2, 0)

    return Tokens(*(split(x) for x in tokens))


# ---- parameters -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """The static (hashable) part of an attention call."""

    softmax_scale: float
    causal: bool = False
    sliding_window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    dropout_prob: float = 0.0
    precision: jax.lax.Precision | None = None
    """Matmul precision of the call (None: JAX's default); forward and backward both run under it."""

    @classmethod
    def of(cls, call) -> AttentionParams:
        """The static part of a canonical attention call (``FlashAttentionCall`` and its relatives)."""
        return cls(
            softmax_scale=call.softmax_scale,
            causal=call.causal,
            sliding_window=call.sliding_window,
            logits_soft_cap=call.logits_soft_cap,
            dropout_prob=call.dropout_prob,
            precision=call.precision,
        )

    def matmuls(self):
        """Context running this call's matmuls at its precision."""
        return contextlib.nullcontext() if self.precision is None else matmul_precision(self.precision)


# ---- per-block math -------------------------------------------------------------------------------


def _grouped(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """[B|1, H|1, ...] -> [B|1, Hkv|1, g|1, ...] (query head h = kv head h // g, group member h % g)."""
    if x is None:
        return None
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], num_kv_heads, x.shape[1] // num_kv_heads, *x.shape[2:])


def _ungrouped(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def visibility(
    q: Tokens, kv: Tokens, params: AttentionParams, mask: jax.Array | None = None, *, all_valid: bool = False
) -> jax.Array:
    """bool [B|1, 1|H, bq, bk]: key j visible to query i (every rule of the semantics but the padding of
    the logits, which callers do not need). ``all_valid``: the caller knows every token exists (whole
    sequences, no varlen), so the existence flags are not read."""
    qp, kp = q.position[..., :, None], kv.position[..., None, :]
    visible = jnp.ones((1, 1, 1), bool) if all_valid else q.valid[..., :, None] & kv.valid[..., None, :]
    if params.causal:
        visible &= kp <= qp
    if params.sliding_window is not None:
        left, right = params.sliding_window
        visible &= (kp >= qp - left) & (kp <= qp + right)
    if q.segment is not None:
        visible &= q.segment[..., :, None] == kv.segment[..., None, :]
    if q.sequence is not None:
        visible &= q.sequence[..., :, None] == kv.sequence[..., None, :]
    visible = visible[:, None]
    if mask is not None:
        visible = visible & mask
    return visible


def _dropout_keep(q: Tokens, kv: Tokens, seed, batch: int, num_heads: int, params: AttentionParams) -> jax.Array:
    """bool [B, H, bq, bk] keep mask of ``ejkernel.ops.utils.dropout`` at these global indices."""
    b = jnp.arange(batch, dtype=jnp.uint32)[:, None, None, None]
    h = jnp.arange(num_heads, dtype=jnp.uint32)[None, :, None, None]
    return keep_mask(seed, b, h, q.index[:, None], kv.index[None, :], params.dropout_prob)


def scores(rows: jax.Array, cols: jax.Array) -> jax.Array:
    """float32 ``[B, Hkv, g, bq, bk]`` = ``einsum("bqkgd,bskd->bkgqs")`` of grouped rows ``[B, bq, Hkv, g, D]``
    and ``cols [B, bk, Hkv, D]``, produced by the matmul in that order (keys minor).

    ``jnp.einsum`` puts ``cols`` first here and emits ``[B, Hkv, bk, bq, g]`` plus a transpose: on a GPU a
    whole extra pass over the float32 S² scores (the dense forward ran at 0.65x ``jax.nn``'s). Transposing
    the rows instead costs O(S)."""
    batch, bq, num_kv_heads, group, head_dim = rows.shape
    # [B, Hkv, g*bq, D]: a plain 4D batched matmul whose result is [B, Hkv, g, bq, bk] by a free reshape
    rows = jnp.transpose(rows, (0, 2, 3, 1, 4)).reshape(batch, num_kv_heads, group * bq, head_dim)
    s = lax.dot_general(rows, cols, (((3,), (3,)), ((0, 1), (0, 2))), preferred_element_type=jnp.float32)
    return s.reshape(batch, num_kv_heads, group, bq, cols.shape[1])


def weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """float32 ``[B, bq, Hkv, g, Dv]`` = ``einsum("bkgqs,bskd->bqkgd")`` of weights ``p [B, Hkv, g, bq, bk]``
    and ``v [B, bk, Hkv, Dv]``, as the 4D batched matmul that reads ``p`` as laid out (the 5D einsum
    made XLA copy the S² logits into another layout on CPU); only the O(S) result is transposed."""
    batch, num_kv_heads, group, bq, bk = p.shape
    out = lax.dot_general(p.reshape(batch, num_kv_heads, group * bq, bk), v, (((3,), (1,)), ((0, 1), (0, 2))),
                          preferred_element_type=jnp.float32)  # [B, Hkv, g*bq, Dv]
    return jnp.transpose(out.reshape(batch, num_kv_heads, group, bq, v.shape[-1]), (0, 3, 1, 2, 4))


def _logits(q, k, bias, params: AttentionParams) -> tuple[jax.Array, jax.Array | None]:
    """float32 logits [B, Hkv, g, bq, bk] (scale, soft cap, bias) and tanh(s/c) for the soft cap's VJP."""
    num_kv_heads = k.shape[2]
    qg = q.reshape(*q.shape[:2], num_kv_heads, q.shape[2] // num_kv_heads, q.shape[3])
    s = scores(qg, k) * params.softmax_scale
    capped = None
    if params.logits_soft_cap is not None:
        capped = jnp.tanh(s / params.logits_soft_cap)
        s = params.logits_soft_cap * capped
    if bias is not None:
        s = s + _grouped(bias, num_kv_heads).astype(jnp.float32)
    return s, capped


def forward_block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_tokens: Tokens,
    kv_tokens: Tokens,
    params: AttentionParams,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_seed=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of one q block over one kv block.

    Returns ``(out, lse)``: ``out`` float32 [B, bq, H, Dv] normalized over this kv block only and
    ``lse`` float32 [B, H, bq] its log-sum-exp (``-inf`` and ``out = 0`` for rows that see no key here).
    Blocks combine with :func:`combine`; dropout (``params.dropout_prob > 0``) is applied to the
    probabilities after normalization, so partial results still combine exactly.
    """
    batch, bq, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    s, _ = _logits(q, k, bias, params)
    visible = _grouped(visibility(q_tokens, kv_tokens, params, mask), num_kv_heads)
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)  # exactly 0 where not visible
    l = jnp.sum(p, axis=-1, keepdims=True)
    if params.dropout_prob > 0.0:
        keep = _grouped(_dropout_keep(q_tokens, kv_tokens, dropout_seed, batch, num_heads, params), num_kv_heads)
        p = jnp.where(keep, p / (1.0 - params.dropout_prob), 0.0)
    acc = weighted_values(p.astype(v.dtype), v)
    l_row = jnp.moveaxis(l[..., 0], -1, 1)[..., None]  # [B, bq, Hkv, g, 1]
    out = acc / jnp.where(l_row > 0, l_row, 1.0)
    lse = jnp.where(l[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out.reshape(batch, bq, num_heads, v.shape[-1]), _ungrouped(lse)


def combine(out_a, lse_a, out_b, lse_b) -> tuple[jax.Array, jax.Array]:
    """Merge two partial results over disjoint key sets (``out`` [B, bq, H, Dv], ``lse`` [B, H, bq])."""
    lse = jnp.logaddexp(lse_a, lse_b)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.moveaxis(jnp.exp(lse_a - lse_safe), 1, 2)[..., None]
    weight_b = jnp.moveaxis(jnp.exp(lse_b - lse_safe), 1, 2)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def backward_block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    d_out: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_tokens: Tokens,
    kv_tokens: Tokens,
    params: AttentionParams,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_seed=None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Gradient contributions of one (q block, kv block) pair.

    ``lse`` [B, H, bq] is the *final* log-sum-exp of the q rows (over all keys and sinks) and ``delta``
    [B, H, bq] = ``sum(d_out * out, -1)`` with the final output. Returns float32 ``(dq [B, bq, H, D],
    dk [B, bk, Hkv, D], dv [B, bk, Hkv, Dv], ds [B, H, bq, bk])``; ``ds`` is the gradient of the logits
    after soft cap (= the bias gradient, before any reduction over broadcast bias dims). Sum ``dq`` over
    kv blocks and ``dk``/``dv`` over q blocks.
    """
    batch, bq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    s, capped = _logits(q, k, bias, params)
    visible = _grouped(visibility(q_tokens, kv_tokens, params, mask), num_kv_heads)
    lse_g = _grouped(lse, num_kv_heads)[..., None]
    lse_safe = jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)
    p = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - lse_safe), 0.0)
    dog = d_out.reshape(batch, bq, num_kv_heads, group, d_out.shape[-1])
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, v, preferred_element_type=jnp.float32)
    p_dropped = p
    if params.dropout_prob > 0.0:
        keep = _grouped(_dropout_keep(q_tokens, kv_tokens, dropout_seed, batch, num_heads, params), num_kv_heads)
        p_dropped = inverted_dropout(p, keep, params.dropout_prob)
        dp = inverted_dropout(dp, keep, params.dropout_prob)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p_dropped.astype(d_out.dtype), dog, preferred_element_type=jnp.float32)
    ds = p * (dp - _grouped(delta, num_kv_heads)[..., None])
    ds_raw = ds if capped is None else ds * (1.0 - capped * capped)
    ds_raw = (ds_raw * params.softmax_scale).astype(q.dtype)
    qg = q.reshape(batch, bq, num_kv_heads, group, head_dim)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds_raw, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds_raw, qg, preferred_element_type=jnp.float32)
    return dq.reshape(batch, bq, num_heads, head_dim), dk, dv, _ungrouped(ds)


# ---- the flash-attention driver -------------------------------------------------------------------


def sink_lse(softmax_aux: jax.Array | None, batch: int, num_heads: int, q_len: int) -> jax.Array:
    """float32 [B, H, Sq]: log-sum-exp of the sink logits (``-inf`` without sinks)."""
    if softmax_aux is None:
        return jnp.full((batch, num_heads, q_len), -jnp.inf, jnp.float32)
    aux = softmax_aux.astype(jnp.float32)
    aux = aux[:, None] if aux.ndim == 1 else aux
    per_head = jax.nn.logsumexp(aux, axis=-1)
    return jnp.broadcast_to(per_head[None, :, None], (batch, num_heads, q_len))


def _seq_blocks(x: jax.Array, num_blocks: int, block: int) -> jax.Array:
    """[B, S, ...] -> [num_blocks, B, block, ...]."""
    return jnp.moveaxis(x.reshape(x.shape[0], num_blocks, block, *x.shape[2:]), 1, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """[num_blocks, B, block, ...] -> [B, num_blocks * block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _pair_blocks(x: jax.Array | None, nq: int, bq: int, nk: int, bk: int, kv_major: bool) -> jax.Array | None:
    """[B', H', Sq, Skv] -> [nq, nk, B', H', bq, bk] (or [nk, nq, ...] when ``kv_major``)."""
    if x is None:
        return None
    x = x.reshape(x.shape[0], x.shape[1], nq, bq, nk, bk)
    return jnp.transpose(x, (4, 2, 0, 1, 3, 5) if kv_major else (2, 4, 0, 1, 3, 5))


def _scan(step, init, xs):
    """``lax.scan``, but a single step is called directly: no while loop, so one-block calls (short
    sequences) compile as fast as dense attention."""
    length = jax.tree.leaves(xs)[0].shape[0]
    if length != 1:
        return lax.scan(step, init, xs)
    carry, y = step(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda x: x[None], y)


def blocks_may_meet(q: Tokens, kv: Tokens, params: AttentionParams) -> jax.Array:
    """False only when no (query, key) pair of these blocks can be visible under the causal / window
    rules (from position bounds; conservative, so also right for varlen's per-sequence positions)."""
    big = jnp.int32(2**30)
    q_lo = jnp.min(jnp.where(q.valid, q.position, big))
    q_hi = jnp.max(jnp.where(q.valid, q.position, -big))
    k_lo = jnp.min(jnp.where(kv.valid, kv.position, big))
    k_hi = jnp.max(jnp.where(kv.valid, kv.position, -big))
    meet = (q_lo <= q_hi) & (k_lo <= k_hi)
    if params.causal:
        meet &= k_lo <= q_hi
    if params.sliding_window is not None:
        left, right = params.sliding_window
        meet &= (k_hi >= q_lo - left) & (k_lo <= q_hi + right)
    return meet


def _skippable(params: AttentionParams) -> bool:
    return params.causal or params.sliding_window is not None


def _map(fn, xs):
    return _scan(lambda _, x: (None, fn(x)), None, xs)[1]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    q: int
    kv: int
    bwd_q: int
    bwd_kv: int


def _flash_forward(blocks: BlockSizes, params: AttentionParams, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    batch, q_len, num_heads, _ = q.shape
    kv_len = k.shape[1]
    bq, bk = blocks.q, blocks.kv
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    qp, kp, vp = pad_axis(q, 1, nq * bq), pad_axis(k, 1, nk * bk), pad_axis(v, 1, nk * bk)
    bias_p = pad_axis(pad_axis(bias, 2, nq * bq), 3, nk * bk)
    mask_p = pad_axis(pad_axis(mask, 2, nq * bq, False), 3, nk * bk, False)
    q_blocks = _seq_blocks(qp, nq, bq)
    k_blocks, v_blocks = _seq_blocks(kp, nk, bk), _seq_blocks(vp, nk, bk)
    qt = _blocked_tokens(pad_tokens(q_tok, nq * bq), nq, bq)
    kt = _blocked_tokens(pad_tokens(kv_tok, nk * bk), nk, bk)
    bias_b = _pair_blocks(bias_p, nq, bq, nk, bk, kv_major=False)
    mask_b = _pair_blocks(mask_p, nq, bq, nk, bk, kv_major=False)
    sinks = pad_axis(sink_lse(aux, batch, num_heads, q_len), 2, nq * bq, -jnp.inf)
    init_lse = _seq_blocks(jnp.moveaxis(sinks, 2, 1), nq, bq)

    def one_q_block(xs):
        q_b, qt_b, bias_row, mask_row, lse0 = xs

        def kv_step(carry, ys):
            k_b, v_b, kt_b, bias_bb, mask_bb = ys

            def attend(carry):
                out_b, lse_b = forward_block(
                    q_b, k_b, v_b, qt_b, kt_b, params, bias=bias_bb, mask=mask_bb, dropout_seed=seed
                )
                return combine(*carry, out_b, lse_b)

            if not _skippable(params):
                return attend(carry), None
            # blocks entirely above the causal diagonal / outside the window contribute nothing
            return lax.cond(blocks_may_meet(qt_b, kt_b, params), attend, lambda c: c, carry), None

        init = (jnp.zeros((*q_b.shape[:3], v.shape[-1]), jnp.float32), jnp.moveaxis(lse0, 1, 2))
        (out_b, lse_b), _ = _scan(kv_step, init, (k_blocks, v_blocks, kt, bias_row, mask_row))
        return out_b, lse_b

    out, lse = _map(one_q_block, (q_blocks, qt, bias_b, mask_b, init_lse))
    out = _unblock(out)[:, :q_len].astype(q.dtype)
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, num_heads, nq * bq)[:, :, :q_len]
    return out, lse


def _flash_backward(blocks: BlockSizes, params: AttentionParams, res, d_out):
    q, k, v, bias, aux, mask, q_tok, kv_tok, seed, out, lse = res
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    bq, bk = blocks.bwd_q, blocks.bwd_kv
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    q_blocks = _seq_blocks(pad_axis(q, 1, nq * bq), nq, bq)
    do_blocks = _seq_blocks(pad_axis(d_out, 1, nq * bq), nq, bq)
    lse_blocks = _seq_blocks(jnp.moveaxis(pad_axis(lse, 2, nq * bq, -jnp.inf), 2, 1), nq, bq)
    delta_blocks = _seq_blocks(jnp.moveaxis(pad_axis(delta, 2, nq * bq), 2, 1), nq, bq)
    k_blocks = _seq_blocks(pad_axis(k, 1, nk * bk), nk, bk)
    v_blocks = _seq_blocks(pad_axis(v, 1, nk * bk), nk, bk)
    qt = _blocked_tokens(pad_tokens(q_tok, nq * bq), nq, bq)
    kt = _blocked_tokens(pad_tokens(kv_tok, nk * bk), nk, bk)
    bias_b = _pair_blocks(pad_axis(pad_axis(bias, 2, nq * bq), 3, nk * bk), nq, bq, nk, bk, kv_major=True)
    mask_b = _pair_blocks(pad_axis(pad_axis(mask, 2, nq * bq, False), 3, nk * bk, False), nq, bq, nk, bk, kv_major=True)

    def reduce_to_bias(ds):
        if bias is None:
            return None
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
        return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds

    def one_kv_block(dq_all, xs):
        k_b, v_b, kt_b, bias_col, mask_col = xs

        def q_step(carry, ys):
            q_b, do_b, lse_b, delta_b, qt_b, bias_bb, mask_bb, dq_b = ys

            def attend(carry):
                dk_acc, dv_acc = carry
                dq, dk, dv, ds = backward_block(
                    q_b, k_b, v_b, do_b, jnp.moveaxis(lse_b, 1, 2), jnp.moveaxis(delta_b, 1, 2), qt_b, kt_b,
                    params, bias=bias_bb, mask=mask_bb, dropout_seed=seed,
                )
                return (dk_acc + dk, dv_acc + dv), (dq_b + dq, reduce_to_bias(ds))

            def skip(carry):
                return carry, (dq_b, None if bias_bb is None else jnp.zeros(bias_bb.shape, jnp.float32))

            if not _skippable(params):
                return attend(carry)
            return lax.cond(blocks_may_meet(qt_b, kt_b, params), attend, skip, carry)

        init = (jnp.zeros(k_b.shape, jnp.float32), jnp.zeros(v_b.shape, jnp.float32))
        (dk_b, dv_b), (dq_all, dbias_col) = _scan(
            q_step, init, (q_blocks, do_blocks, lse_blocks, delta_blocks, qt, bias_col, mask_col, dq_all)
        )
        return dq_all, (dk_b, dv_b, dbias_col)

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    dq_all, (dk, dv, dbias) = _scan(one_kv_block, dq0, (k_blocks, v_blocks, kt, bias_b, mask_b))
    dq = _unblock(dq_all)[:, :q_len].astype(q.dtype)
    dk = _unblock(dk)[:, :kv_len].astype(k.dtype)
    dv = _unblock(dv)[:, :kv_len].astype(v.dtype)
    if bias is not None:
        # [nk, nq, B', H', bq, bk] -> [B', H', Sq, Skv]
        dbias = jnp.transpose(dbias, (2, 3, 1, 4, 0, 5)).reshape(*dbias.shape[2:4], nq * bq, nk * bk)
        dbias = dbias[:, :, :q_len, :kv_len].astype(bias.dtype)
    d_aux = None
    if aux is not None:
        # sinks sit in the denominator only: d aux[h, k] = -sum_{b,i} P_sink[b,h,i,k] * delta[b,h,i]
        aux2 = aux.astype(jnp.float32)
        aux2 = aux2[:, None] if aux.ndim == 1 else aux2
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        p_sink = jnp.exp(aux2[None, :, None, :] - lse_safe[..., None])
        d_aux = -jnp.einsum("bhqk,bhq->hk", p_sink, delta).reshape(aux.shape).astype(aux.dtype)
    return dq, dk, dv, dbias, d_aux


def _flash_fwd(blocks, params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    with params.matmuls():
        out, lse = _flash_forward(blocks, params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed)
    return out, (q, k, v, bias, aux, mask, q_tok, kv_tok, seed, out, lse)


def _flash_bwd(blocks, params, res, d_out):
    with params.matmuls():
        dq, dk, dv, dbias, d_aux = _flash_backward(blocks, params, res, d_out)
    # mask, tokens and seed are integers/booleans: no cotangent
    return dq, dk, dv, dbias, d_aux, None, None, None, None


def _flash_primal(blocks, params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    with params.matmuls():
        return _flash_forward(blocks, params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed)[0]


_flash = jax.custom_vjp(_flash_primal, nondiff_argnums=(0, 1))
_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_blockwise(
    query,
    key,
    value,
    *,
    params: AttentionParams,
    blocks: BlockSizes,
    bias=None,
    softmax_aux=None,
    attention_mask=None,
    q_tokens: Tokens,
    kv_tokens: Tokens,
    dropout_seed=None,
) -> jax.Array:
    """Blockwise attention with a custom VJP (memory O(S) besides bias/mask); see the module docstring."""
    seed = None if params.dropout_prob == 0.0 else seed_bits(dropout_seed)
    return _flash(blocks, params, query, key, value, bias, softmax_aux, attention_mask, q_tokens, kv_tokens, seed)


def dense_attention(
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
) -> tuple[jax.Array, jax.Array]:
    """The same semantics on the whole [B, H, Sq, Skv] logits at once (plain autodiff; memory O(S²)).

    Returns ``(out [B, Sq, H, Dv]`` in query's dtype, ``weights [B, H, Sq, Skv]`` float32: the softmax
    probabilities before dropout``)``. Used by the dense operations (``scaled_dot_product_attention``,
    ``attention``), which trade memory for one fused XLA computation.
    """
    with params.matmuls():  # plain autodiff: the transposed matmuls keep the precision their forward recorded
        return _dense_attention(
            query, key, value, params=params, bias=bias, softmax_aux=softmax_aux, attention_mask=attention_mask,
            q_tokens=q_tokens, kv_tokens=kv_tokens, dropout_seed=dropout_seed,
        )


def _dense_attention(query, key, value, *, params, bias, softmax_aux, attention_mask, q_tokens, kv_tokens, dropout_seed):
    batch, q_len, num_heads, _ = query.shape
    num_kv_heads = key.shape[2]
    s, _ = _logits(query, key, bias, params)
    visible = _grouped(visibility(q_tokens, kv_tokens, params, attention_mask), num_kv_heads)
    sinks = sink_lse(softmax_aux, batch, num_heads, q_len)  # [B, H, Sq]
    sinks = _grouped(sinks, num_kv_heads)[..., None]
    # the row max only stabilises exp and cancels: no gradient through it
    m = lax.stop_gradient(jnp.maximum(jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1, keepdims=True), sinks))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - m), 0.0)
    denominator = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sinks - m)
    weights = e / jnp.where(denominator > 0, denominator, 1.0)
    p = weights
    if params.dropout_prob > 0.0:
        seed = seed_bits(dropout_seed)
        keep = _grouped(_dropout_keep(q_tokens, kv_tokens, seed, batch, num_heads, params), num_kv_heads)
        p = jnp.where(keep, weights / (1.0 - params.dropout_prob), 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(value.dtype), value, preferred_element_type=jnp.float32)
    out = out.reshape(batch, q_len, num_heads, value.shape[-1]).astype(query.dtype)
    return out, _ungrouped(weights)


def default_block_sizes(
    q_len: int, kv_len: int, head_dim: int, q_block=None, kv_block=None, bwd_q=None, bwd_kv=None
) -> BlockSizes:
    """Blocks of 512 queries x 512 keys (smaller for wide heads), never larger than the sequence."""
    base = 512 if head_dim <= 128 else 256
    fit = lambda n, want: max(1, min(want or base, n))  # noqa: E731
    bq, bk = fit(q_len, q_block), fit(kv_len, kv_block)
    return BlockSizes(bq, bk, fit(q_len, bwd_q or bq), fit(kv_len, bwd_kv or bk))


__all__ = [
    "AttentionParams",
    "BlockSizes",
    "Tokens",
    "backward_block",
    "blocks_may_meet",
    "combine",
    "default_block_sizes",
    "dense_attention",
    "flash_attention_blockwise",
    "forward_block",
    "key_tokens",
    "pad_tokens",
    "query_tokens",
    "sink_lse",
    "slice_tokens",
    "visibility",
]
