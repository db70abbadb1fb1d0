"""``ring_attention``: sequence-parallel exact attention; key/value blocks travel around a ring of devices.

Core validates the public call into one frozen :class:`RingAttentionCall`, all a backend sees. Called inside
``jax.shard_map`` with the sequence axis (axis 1) of query, key, value and the segment ids sharded over the
mesh axis ``axis_name``; the arrays are the per-device shards: ``query`` ``[B, Sq_loc, H, D]``, ``key``
``[B, Skv_loc, Hkv, D]``, ``value`` ``[B, Skv_loc, Hkv, Dv]``, segment ids int32 ``[B, Sq_loc]`` /
``[B, Skv_loc]`` (both or neither), ``softmax_aux`` (sinks, replicated) ``[H]`` or ``[H, S_sink]``. With ``P``
devices on the axis, device ``r`` holds global queries ``r * Sq_loc + i`` and keys ``r * Skv_loc + j``.

The result on each device is ``flash_attention`` (docs/flash_attention.md) of the *global* (concatenated)
sequences, restricted to the local queries: same logits, soft cap, bottom-right alignment on the
global lengths, causal / sliding-window visibility on global positions, segment ids, sinks (counted once
per row), zeros for rows that see nothing, float32 accumulation, output in query's dtype.
``axis_name=None`` is the one-device case (``P = 1``): plain flash attention. ``sequence_layout="zigzag"``:
device ``r`` holds global chunks ``r`` and ``2P - 1 - r`` of ``S_loc / 2`` tokens instead (causal load balance;
:func:`zigzag_shard` / :func:`zigzag_unshard` lay a global array out and back).

Gradients: query, key, value (each device gets its shards' gradients) and softmax_aux (summed over the
ring). Full specification, including the inner block every ring step computes: ``docs/ops/ring_attention.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._validation import describe
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention_subset, restricted_call


@flash_attention_subset(
    "query", "key", "value", "q_segment_ids", "kv_segment_ids", "softmax_aux",
    "softmax_scale", "causal", "sliding_window", "logits_soft_cap", "precision",
)
class RingAttentionCall:
    """A validated ``ring_attention`` call (the local shards): what every backend receives (see above); its
    fields are ``FlashAttentionCall``'s of those names (segment ids both given or both None) and:"""

    axis_name: str | None = None
    """The mesh axis the sequence is sharded over; None: one device."""
    sequence_layout: str = "contiguous"
    """How the global sequence is laid out over the ring: ``"contiguous"`` (device ``r`` holds tokens
    ``r * S_loc + i``) or ``"zigzag"`` (``S_loc = 2 h``; device ``r`` holds chunks ``r`` and ``2P - 1 - r`` of
    length ``h``: every ring step of a causal call then has the same work; :func:`zigzag_shard` lays a
    global array out so)."""


SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def zigzag_order(length: int, num_shards: int) -> np.ndarray:
    """int ``[length]``: the global token index at each place of the zig-zag layout (concatenated over the
    shards): shard ``r`` holds chunks ``r`` and ``2 * num_shards - 1 - r`` of ``length / (2 * num_shards)``."""
    chunks = 2 * num_shards
    if length % chunks:
        raise ValueError(f"zigzag layout: the sequence length {length} must be a multiple of 2 x {num_shards} shards")
    size = length // chunks
    order = [c for r in range(num_shards) for c in (r, chunks - 1 - r)]
    return (np.asarray(order)[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def zigzag_shard(x, num_shards: int, axis: int = 1):
    """``x`` with its sequence ``axis`` reordered so that splitting it into ``num_shards`` contiguous shards
    (e.g. ``PartitionSpec(None, "sp")``) gives every device its zig-zag chunks (for query, key, value and
    segment ids alike; pass ``sequence_layout="zigzag"`` to :func:`ring_attention`)."""
    return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], num_shards)), axis=axis)


def zigzag_unshard(x, num_shards: int, axis: int = 1):
    """The inverse of :func:`zigzag_shard` (e.g. on ring attention's output gathered over the devices)."""
    return jnp.take(x, jnp.asarray(np.argsort(zigzag_order(x.shape[axis], num_shards))), axis=axis)


def ring_token_positions(layout: str, rank, size: int, length: int):
    """int32 ``[length]``: the global positions of shard ``rank``'s ``length`` tokens on a ring of ``size``."""
    local = jnp.arange(length, dtype=jnp.int32)
    if layout == "contiguous":
        return rank * length + local
    half = length // 2
    chunk = jnp.where(local < half, rank, 2 * size - 1 - rank)
    return chunk * half + local % half


class RingAttention(RegistryOperation):
    """Sequence-parallel attention over a ring of devices (see the module docstring)."""

    algorithm = "ring_attention"

    def canonicalize(self, args: Arguments) -> RingAttentionCall:
        """Its own rules (both segment-id sides, ``axis_name``), then ``FlashAttention.validate``'s."""
        q_segment_ids, kv_segment_ids, axis_name = args.q_segment_ids, args.kv_segment_ids, args.axis_name
        if (q_segment_ids is None) != (kv_segment_ids is None):
            # Unlike flash_attention, no self-attention fill: the key/value shards travel around the ring
            # and must carry their own segment ids, so both sides are required.
            given, missing = ("q_segment_ids", "kv_segment_ids")
            if q_segment_ids is None:
                given, missing = missing, given
            present = kv_segment_ids if q_segment_ids is None else q_segment_ids
            raise ValueError(
                f"ring_attention: {missing} is required when {given} is given (segment ids travel with their "
                f"shards; for self-attention pass the same shard as both); got {given} {describe(present)} and "
                f"{missing}=None"
            )
        if axis_name is not None and not isinstance(axis_name, str):
            raise ValueError(f"axis_name must be a mesh axis name (str) or None, got {axis_name!r}")
        layout = args.sequence_layout
        if layout not in SEQUENCE_LAYOUTS:
            raise ValueError(f"sequence_layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}")
        if layout == "zigzag":
            for name in ("query", "key"):
                if args[name].shape[1] % 2:
                    raise ValueError(f"sequence_layout='zigzag' holds two equal chunks per device: {name}'s local "
                                     f"length must be even, got {describe(args[name])}")
        flash_call = FlashAttention().validate(**args.without("axis_name", "sequence_layout"))
        return restricted_call(self.algorithm, RingAttentionCall, flash_call, axis_name=axis_name,
                               sequence_layout=layout)


@public_function(RingAttention)
def ring_attention(
    query: Float[jax.Array, "batch q_len num_heads head_dim"],
    key: Float[jax.Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[jax.Array, "batch kv_len num_kv_heads v_head_dim"],
    q_segment_ids: Int[jax.Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[jax.Array, "batch kv_len"] | None = None,
    softmax_aux: Float[jax.Array, "num_heads *num_sinks"] | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    axis_name: str | None = None,
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
    sequence_layout: str = "contiguous",
) -> Float[jax.Array, "batch q_len num_heads v_head_dim"]:
    """Exact attention over a sequence sharded on ``axis_name`` (call inside ``jax.shard_map``).

    Args:
        query, key, value: the local shards ``[batch, q_len, num_heads, head_dim]`` /
            ``[batch, kv_len, num_kv_heads, head_dim]`` / ``[batch, kv_len, num_kv_heads, v_head_dim]``.
        q_segment_ids, kv_segment_ids: local shards of int segment ids (attend within equal ids).
        softmax_aux: attention-sink logits ``[num_heads]`` or ``[num_heads, num_sinks]`` (replicated).
        softmax_scale: logits scale (default ``head_dim ** -0.5``); causal, sliding_window
            (``w`` or ``(left, right)``), logits_soft_cap: as in ``flash_attention``, on global positions.
        axis_name: the mesh axis the sequence is sharded over; None runs on one device.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        platform: ``"auto"`` or a backend name.
        sequence_layout: ``"contiguous"`` or ``"zigzag"`` (causal load balance: lay the global arrays out
            with :func:`zigzag_shard` before sharding, undo with :func:`zigzag_unshard`).
        cfg: one implementation's config (the blocks of every ring step, e.g.
            ``ejkernel_xla.flash_attention.XlaFlashConfig``); it selects that implementation. None: cached,
            tuned or heuristic config of the chosen one.

    Returns:
        The local shard of the output ``[batch, q_len, num_heads, v_head_dim]`` in query's dtype.
    """
    return execute(RingAttention(), **locals())
