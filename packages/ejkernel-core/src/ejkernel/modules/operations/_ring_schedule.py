"""The ring schedule over a backend's local attention kernels (``ring_attention``'s GPU path).

A backend whose local flash attention is a fast kernel gives the ring two calls on whole local blocks
(:class:`RingBlocks`): ``forward`` returning the block's output and log-sum-exp, ``backward`` taking the
*final* output and log-sum-exp, so blocks merge exactly. :func:`ring_attention` runs them around the ring:

- every step issues the ``ppermute`` of the key/value shard for the next step before its own kernel, so
  XLA can overlap the transfer with the compute, and the last step sends nothing; the first step is the
  device's own shard, whose work is static (no branch, no merge); the backward carries the key/value
  gradient accumulators with their shard, as the XLA ring does;
- the step's work depends on where the visiting shard sits (``sequence_layout``): non-causal calls attend
  to every shard in full; causal contiguous shards see their own shard through a causal diagonal block, the
  earlier ones in full and skip the later ones (unbalanced: the last device works every step); causal
  zig-zag shards (device ``r`` holds chunks ``r`` and ``2P - 1 - r``) see their own pair through one causal
  block, an earlier source's first chunk with all their queries, a later source's two chunks with their
  second query chunk only: every step is half a shard pair of work, none is skipped;
- outputs merge in float32 by their log-sum-exps; kv stays at its own head count (GQA is the kernels').

A "causal" block here is the diagonal one: local queries and keys of equal length, query ``i`` sees keys
``j <= i``. Sliding windows, sinks and unequal local lengths under causal masking are refused by the
backends that use this schedule (their own ring, or the XLA one, takes those calls).
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32

# the work of one ring step, by the visiting shard's place (see the module docstring)
NOTHING, DIAGONAL, FULL, FULL_FIRST_KV_HALF, FULL_SECOND_Q_HALF = range(5)


class RingBlocks(Protocol):
    """A backend's local kernels for the ring (hashable: the custom VJP keys on it).

    ``forward(q, k, v, q_seg, kv_seg, causal)``: ``(out [B, Sq, H, Dv], lse [B, H, Sq] float32)``, lse the
    natural log-sum-exp of each row's logits, ``-inf`` for a row that sees no key (its output zeros).
    ``backward(q, k, v, q_seg, kv_seg, out, lse, d_out, causal)``: ``(dq, dk, dv)`` of the block, with
    ``out`` / ``lse`` the *final* (merged) ones of these rows. Segment ids may be None (both or neither).
    """

    def forward(self, q, k, v, q_seg, kv_seg, causal: bool): ...

    def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, causal: bool): ...


def _own_kind(causal: bool) -> int:
    """The first step's work: the device's own shard (static: no branch)."""
    return DIAGONAL if causal else FULL


def _visitor_kinds(causal: bool, layout: str) -> tuple[int, ...]:
    """The kinds of work another device's shard can bring (the branches of the later steps' ``lax.switch``)."""
    if not causal:
        return (FULL,)
    if layout == "zigzag":
        return (FULL_FIRST_KV_HALF, FULL_SECOND_Q_HALF)
    return (NOTHING, FULL)


def _visitor_kind(causal: bool, layout: str, rank, src):
    """Index into :func:`_visitor_kinds` of the step where ``rank`` meets ``src``'s shard (``src != rank``)."""
    if not causal:
        return jnp.int32(0)
    if layout == "zigzag":
        return jnp.where(src < rank, 0, 1)
    return jnp.where(src < rank, 1, 0)


def _run_step(step_fn, causal, layout, rank, src, *operands):
    """``step_fn(kind, *operands)`` for another device's shard: one branch per possible kind, outputs marked
    varying like the queries (the first operand)."""
    kinds = _visitor_kinds(causal, layout)
    branches = [_marked(functools.partial(step_fn, kind)) for kind in kinds]
    if len(branches) == 1:
        return branches[0](*operands)
    return lax.switch(_visitor_kind(causal, layout, rank, src), branches, *operands)


def _half(x, which: int):
    if x is None:
        return None
    h = x.shape[1] // 2
    return x[:, :h] if which == 0 else x[:, h:]


def _forward_step(blocks: RingBlocks, kind: int, q, k, v, q_seg, kv_seg):
    """(out [B, Sq, H, Dv] float32, lse [B, H, Sq]) of one step of kind ``kind``."""
    batch, q_len, heads, _ = q.shape
    if kind == NOTHING:
        return jnp.zeros((batch, q_len, heads, v.shape[-1]), F32), jnp.full((batch, heads, q_len), -jnp.inf, F32)
    if kind in (DIAGONAL, FULL):
        out, lse = blocks.forward(q, k, v, q_seg, kv_seg, kind == DIAGONAL)
        return out.astype(F32), lse
    if kind == FULL_FIRST_KV_HALF:
        out, lse = blocks.forward(q, _half(k, 0), _half(v, 0), q_seg, _half(kv_seg, 0), False)
        return out.astype(F32), lse
    out, lse = blocks.forward(_half(q, 1), k, v, _half(q_seg, 1), kv_seg, False)  # FULL_SECOND_Q_HALF
    h = q_len - out.shape[1]
    out = jnp.pad(out.astype(F32), ((0, 0), (h, 0), (0, 0), (0, 0)))
    return out, jnp.pad(lse, ((0, 0), (0, 0), (h, 0)), constant_values=-jnp.inf)


def _backward_step(blocks: RingBlocks, kind: int, q, k, v, q_seg, kv_seg, out, lse, d_out):
    """(dq, dk, dv) float32 contributions of one step of kind ``kind`` (full shapes)."""
    if kind == NOTHING:
        return jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)
    if kind in (DIAGONAL, FULL):
        parts = blocks.backward(q, k, v, q_seg, kv_seg, out, lse, d_out, kind == DIAGONAL)
        return tuple(p.astype(F32) for p in parts)
    if kind == FULL_FIRST_KV_HALF:
        dq, dk, dv = blocks.backward(q, _half(k, 0), _half(v, 0), q_seg, _half(kv_seg, 0), out, lse, d_out, False)
        h = k.shape[1] - dk.shape[1]
        pad = ((0, 0), (0, h), (0, 0), (0, 0))
        return dq.astype(F32), jnp.pad(dk.astype(F32), pad), jnp.pad(dv.astype(F32), pad)
    h = q.shape[1] // 2  # FULL_SECOND_Q_HALF
    dq, dk, dv = blocks.backward(_half(q, 1), k, v, _half(q_seg, 1), kv_seg, _half(out, 1), lse[:, :, h:],
                                 _half(d_out, 1), False)
    return jnp.pad(dq.astype(F32), ((0, 0), (q.shape[1] - dq.shape[1], 0), (0, 0), (0, 0))), dk.astype(F32), \
        dv.astype(F32)


def _merge(out, lse, step_out, step_lse):
    """Two partial softmax results of the same rows, merged exactly (float32; -inf lse: nothing seen)."""
    new = jnp.logaddexp(lse, step_lse)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    scale = lambda x: jnp.moveaxis(jnp.exp(x - safe), 1, 2)[..., None]  # noqa: E731 -- [B, H, S] -> [B, S, H, 1]
    return out * scale(lse) + step_out * scale(step_lse), new


def varying_like(tree, like):
    """``tree``'s leaves marked as varying over every manual mesh axis ``like`` varies over (under
    ``shard_map``'s checks), where they are not: fresh zeros, replicated values (sinks), and kernel outputs
    (a jax-triton call's results carry no mark), so loop carries and switch/cond branches agree. The ring
    axis and any other (a data axis sharding the batch) alike; a no-op outside ``shard_map``. Shared by
    every ring."""
    axes = tuple(jax.typeof(like).manual_axis_type.varying)
    if not axes:
        return tree

    def mark(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(mark, tree)


def summed_like(grad, primal, axis_name):
    """The gradient of a value replicated over the ring (sinks), summed over every device whose rows fed it:
    the ring's axis and any other manual axis the gradient varies over and ``primal`` does not (a data axis
    sharding the batch). Shared by the rings that take sinks."""
    axes = set(jax.typeof(grad).manual_axis_type.varying) - set(jax.typeof(primal).manual_axis_type.varying)
    if axis_name is not None:
        axes.add(axis_name)
    return lax.psum(grad, tuple(sorted(axes))) if axes else grad


def _marked(branch):
    """``branch`` with its outputs marked varying like its first operand (the local queries)."""
    return lambda *operands: varying_like(branch(*operands), operands[0])


def rotate(axis_name, size: int, tree):
    """Every leaf of ``tree`` one device further round the ring (``ppermute`` r -> r + 1; shared with the XLA
    ring)."""
    if axis_name is None or size == 1:
        return tree
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _rank(axis_name):
    return jnp.int32(0) if axis_name is None else lax.axis_index(axis_name)


def _later_steps(axis_name, size, shard, state, visit):
    """Steps 1..P-1: ``state = visit(state, s, shard)`` with ``shard`` the one visiting at step ``s`` (it was
    sent during the step before). Each step sends its successor before its own kernels; the middle steps
    run in a scan, the last one is peeled and sends nothing."""

    def step(carry, s):
        state, shard = carry
        following = rotate(axis_name, size, shard)
        return (visit(state, s, shard), following), None

    if size > 2:
        (state, shard), _ = lax.scan(step, (state, shard), jnp.arange(1, size - 1))
    return visit(state, size - 1, shard)


def _ring_forward(blocks, causal, layout, axis_name, size, q, k, v, q_seg, kv_seg):
    """Step 0 is the own shard (static work, no merge); its successor is sent before its kernel."""
    rank = _rank(axis_name)
    forward_step = functools.partial(_forward_step, blocks)
    following = rotate(axis_name, size, (k, v, kv_seg)) if size > 1 else None
    out, lse = varying_like(forward_step(_own_kind(causal), q, k, v, q_seg, kv_seg), q)

    def visit(state, s, shard):
        step_out, step_lse = _run_step(forward_step, causal, layout, rank, (rank - s) % size, q, *shard[:2],
                                       q_seg, shard[2])
        return _merge(*state, step_out, step_lse)

    if size > 1:
        out, lse = _later_steps(axis_name, size, following, (out, lse), visit)
    return out.astype(q.dtype), lse


def _ring_backward(blocks, causal, layout, axis_name, size, residuals, d_out):
    """As the forward; the key/value gradient sums travel with their shard (after the last step's rotation
    they are home)."""
    q, k, v, q_seg, kv_seg, out, lse = residuals
    rank = _rank(axis_name)
    d_out = d_out.astype(q.dtype)
    backward_step = functools.partial(_backward_step, blocks)
    following = rotate(axis_name, size, (k, v, kv_seg)) if size > 1 else None
    dq, dk, dv = varying_like(backward_step(_own_kind(causal), q, k, v, q_seg, kv_seg, out, lse, d_out), q)

    def visit(state, s, shard):
        dq, (dk_sum, dv_sum) = state
        dq_part, dk_part, dv_part = _run_step(backward_step, causal, layout, rank, (rank - s) % size, q,
                                              *shard[:2], q_seg, shard[2], out, lse, d_out)
        return dq + dq_part, rotate(axis_name, size, (dk_sum + dk_part, dv_sum + dv_part))

    if size > 1:  # the own shard's sums start their trip with the first step
        dq, (dk, dv) = _later_steps(axis_name, size, following, (dq, rotate(axis_name, size, (dk, dv))), visit)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


# `size` (the ring's length) is read outside: lax.axis_size cannot run in a custom VJP's backward under
# jax.vmap(axis_name=...) (a ring simulated on one device), axis_index and ppermute can.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ring(blocks, causal, layout, axis_name, size, q, k, v, q_seg, kv_seg):
    return _ring_forward(blocks, causal, layout, axis_name, size, q, k, v, q_seg, kv_seg)[0]


def _ring_fwd(blocks, causal, layout, axis_name, size, q, k, v, q_seg, kv_seg):
    out, lse = _ring_forward(blocks, causal, layout, axis_name, size, q, k, v, q_seg, kv_seg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


_ring.defvjp(_ring_fwd, _ring_backward)


def ring_attention(blocks: RingBlocks, call) -> jax.Array:
    """``ring_attention`` of a validated :class:`~ejkernel.modules.operations.ring_attention.RingAttentionCall`
    on ``blocks`` (see the module docstring for what the caller must have refused)."""
    size = 1 if call.axis_name is None else int(lax.axis_size(call.axis_name))
    return _ring(blocks, bool(call.causal), call.sequence_layout, call.axis_name, size, call.query, call.key,
                 call.value, call.q_segment_ids, call.kv_segment_ids)
