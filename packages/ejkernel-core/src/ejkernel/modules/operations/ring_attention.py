"""``ring_attention``: sequence-parallel exact attention; key/value blocks travel around a ring of devices.

Canonical call every backend receives (validated and normalized here)::

    ring_attention(query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, *, softmax_scale: float,
                   causal: bool, sliding_window: tuple[int, int] | None, logits_soft_cap: float | None,
                   axis_name: str | None, cfg)

Called inside ``jax.shard_map`` with the sequence axis (axis 1) of query, key, value and the segment ids
sharded over the mesh axis ``axis_name``; the arguments are the per-device shards: ``query``
``[B, Sq_loc, H, D]``, ``key`` ``[B, Skv_loc, Hkv, D]``, ``value`` ``[B, Skv_loc, Hkv, Dv]``, segment ids int32
``[B, Sq_loc]`` / ``[B, Skv_loc]``, ``softmax_aux`` (sinks, replicated) ``[H]`` or ``[H, S_sink]``. With
``P`` devices on the axis, device ``r`` holds global queries ``r * Sq_loc + i`` and keys ``r * Skv_loc + j``.

The result on each device is ``flash_attention`` (docs/flash_attention.md) of the *global* (concatenated)
sequences, restricted to the local queries: same logits, soft cap, bottom-right alignment on the
global lengths, causal / sliding-window visibility on global positions, segment ids, sinks (counted once
per row), zeros for rows that see nothing, float32 accumulation, output in query's dtype.
``axis_name=None`` is the one-device case (``P = 1``): plain flash attention.

Gradients: query, key, value (each device gets its shards' gradients) and softmax_aux (summed over the
ring). Full specification, including the inner block every ring step computes: ``docs/ops/ring_attention.md``.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import RegistryOperation, execute
from ejkernel.modules.operations._validation import describe, typechecked
from ejkernel.modules.operations._validation import (
    check_bool,
    check_qkv,
    check_softmax_aux,
    normalize_segment_ids,
    normalize_sliding_window,
    normalize_soft_cap,
    resolve_softmax_scale,
)
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


@dataclasses.dataclass(frozen=True)
class RingAttentionConfig:
    """Block sizes of the inner (per ring step) blockwise attention; None: the backend's heuristic."""

    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str = "auto"
    backend: str = "any"


class RingAttention(RegistryOperation):
    """Sequence-parallel attention over a ring of devices (see the module docstring)."""

    algorithm = "ring_attention"
    config_type = RingAttentionConfig

    def validate(
        self, query, key, value, q_segment_ids=None, kv_segment_ids=None, softmax_aux=None, *,
        softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, axis_name=None,
    ):
        batch, q_len, num_heads, head_dim, kv_len, _ = check_qkv(query, key, value)
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
        q_segment_ids, kv_segment_ids = normalize_segment_ids(q_segment_ids, kv_segment_ids, batch, q_len, kv_len)
        softmax_aux = check_softmax_aux(softmax_aux, num_heads)
        if axis_name is not None and not isinstance(axis_name, str):
            raise ValueError(f"axis_name must be a mesh axis name (str) or None, got {axis_name!r}")
        args = (query, key, value, q_segment_ids, kv_segment_ids, softmax_aux)
        kwargs = dict(
            softmax_scale=resolve_softmax_scale(softmax_scale, head_dim),
            causal=check_bool("causal", causal),
            sliding_window=normalize_sliding_window(sliding_window),
            logits_soft_cap=normalize_soft_cap(logits_soft_cap),
            axis_name=axis_name,
        )
        return args, kwargs


@typechecked
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
    platform: str = "auto",
    cfg: RingAttentionConfig | None = None,
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
        platform: ``"auto"`` or a backend name; cfg: a :class:`RingAttentionConfig`.

    Returns:
        The local shard of the output ``[batch, q_len, num_heads, v_head_dim]`` in query's dtype.
    """
    return execute(
        RingAttention(), query, key, value, q_segment_ids, kv_segment_ids, softmax_aux,
        softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        axis_name=axis_name, platform=platform, cfg=cfg,
    )
