"""Ring attention with the TPU flash kernels as the inner block; docs/ops/ring_attention.md.

Each device keeps its query shard; key/value shards (and, in the backward, their gradient accumulators)
move one step around the ring per iteration with ``ppermute``. Every step runs the Pallas block kernels
of ``tpu_flash_attention`` with the global positions of the two shards (traced starts), and the per-step
(output, log-sum-exp) pairs are merged by the log-sum-exp rule; sinks enter once, at the end.

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``RingAttentionCall``; its config is the
flash kernels' :class:`~ejkernel_pallas.tpu_flash_attention.TpuFlashBlocks` on the local shards. Precision:
float32 calls pass ``call.precision`` to the kernels' dots (Mosaic maps it to the MXU's contract precision)
and run the merges outside the kernels at it too, so none is refused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental
import jax.numpy as jnp
from jax import lax

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations._precision import matmul_precision
from ejkernel.modules.operations._ring_schedule import rotate as _rotate
from ejkernel.modules.operations._ring_schedule import summed_like, varying_like
from ejkernel.modules.operations.ring_attention import RingAttentionCall

from ejkernel_pallas import tpu_flash_attention as tpu
from ejkernel_pallas.interpret import tpu_interpret_or_refuse
from ejkernel_pallas.tpu_flash_attention import TpuFlashBlocks


@dataclasses.dataclass(frozen=True)
class _RingStatic:
    block: object  # tpu._Static
    axis_name: str | None
    precision: jax.lax.Precision  # the call's: of the matmuls outside the kernels (delta, sinks)
    in_order: bool = False
    """Every collective waits for the kernels before it (a ring under the TPU interpreter, see :func:`_in_turn`)."""


def _ring_position(axis_name):
    if axis_name is None:
        return 1, jnp.zeros((), jnp.int32)
    return lax.axis_size(axis_name), lax.axis_index(axis_name).astype(jnp.int32)


def _in_turn(rs: _RingStatic, collective, operands):
    """``collective(operands)``; when ``rs.in_order``, strictly between the interpreted kernels before and
    after it. The TPU interpreter's kernels meet the other devices' at barriers in host callbacks and are
    ordered after one another (ordered callbacks), not after their data, so XLA's CPU runtime may run a
    kernel's barrier beside a ppermute: a device waiting at a kernel barrier while its peers wait in the
    ppermute never returns (a 4-device CI run aborted so, at XLA's 40-s collective timeout). Operands and
    result pass through ordered callbacks (host copies; XLA's CPU pipeline drops optimization barriers,
    which hung every run). Compiled kernels keep the overlap of transfer and compute."""
    if not rs.in_order:
        return collective(operands)
    operands = _ordered_identity(operands)
    return _ordered_identity(collective(operands))


def _ordered_identity(tree):
    """``tree`` through an ordered host callback, keeping each leaf's varying axes (the callback drops them)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    copied = jax.experimental.io_callback(lambda t: t, shapes, tree, ordered=True)
    return jax.tree.map(varying_like, copied, tree)


def _merge(o_a, lse_a, o_b, lse_b):
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731  [B, H, S] -> [B, S, H, 1]
    return o_a * to_rows(w_a) + o_b * to_rows(w_b), lse


def _forward(rs: _RingStatic, q, k, v, q_seg, kv_seg, aux):
    size, rank = _ring_position(rs.axis_name)
    rotate = functools.partial(_rotate, rs.axis_name, size)
    sq, skv = q.shape[1], k.shape[1]
    q_len, kv_len = size * sq, size * skv
    batch, _, heads, _ = q.shape
    o, lse = varying_like((
        jnp.zeros((batch, sq, heads, v.shape[3]), jnp.float32), jnp.full((batch, heads, sq), -jnp.inf, jnp.float32)
    ), q)

    def step(s, carry):
        o, lse, k_cur, v_cur, seg_cur = carry
        src = (rank - s) % size
        o_b, lse_b = tpu.block_forward(rs.block, q, k_cur, v_cur, q_seg, seg_cur, q_start=rank * sq,
                                       kv_start=src * skv, q_len=q_len, kv_len=kv_len)
        o, lse = _merge(o, lse, o_b, lse_b)
        k_cur, v_cur, seg_cur = _in_turn(rs, rotate, (k_cur, v_cur, seg_cur))
        return o, lse, k_cur, v_cur, seg_cur

    o, lse, *_ = lax.fori_loop(0, size, step, (o, lse, k, v, kv_seg))
    if aux is not None:
        sink_lse = jax.nn.logsumexp(aux.astype(jnp.float32), axis=-1)[None, :, None]  # [1, H, 1]
        lse_final = jnp.logaddexp(lse, sink_lse)
        o = o * jnp.swapaxes(jnp.exp(jnp.where(jnp.isfinite(lse), lse, -jnp.inf) - lse_final), 1, 2)[..., None]
        lse = lse_final
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rs, q, k, v, q_seg, kv_seg, aux):
    with matmul_precision(rs.precision):
        return _forward(rs, q, k, v, q_seg, kv_seg, aux)[0]


def _ring_fwd(rs, q, k, v, q_seg, kv_seg, aux):
    with matmul_precision(rs.precision):
        out, lse = _forward(rs, q, k, v, q_seg, kv_seg, aux)
    return out, (q, k, v, q_seg, kv_seg, aux, out, lse)


def _ring_bwd(rs, residuals, d_out):
    with matmul_precision(rs.precision):  # traced later, outside the forward's scope
        return _backward(rs, residuals, d_out)


def _backward(rs, residuals, d_out):
    q, k, v, q_seg, kv_seg, aux, out, lse = residuals
    size, rank = _ring_position(rs.axis_name)
    rotate = functools.partial(_rotate, rs.axis_name, size)
    sq, skv = q.shape[1], k.shape[1]
    q_len, kv_len = size * sq, size * skv
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def step(s, carry):
        dq, k_cur, v_cur, seg_cur, dk_cur, dv_cur = carry
        src = (rank - s) % size
        dq_b, dk_b, dv_b = tpu.block_backward(rs.block, q, k_cur, v_cur, q_seg, seg_cur, d_out, lse, delta,
                                              q_start=rank * sq, kv_start=src * skv, q_len=q_len, kv_len=kv_len)
        dq = dq + dq_b
        shard = (k_cur, v_cur, seg_cur, dk_cur + dk_b, dv_cur + dv_b)
        k_cur, v_cur, seg_cur, dk_cur, dv_cur = _in_turn(rs, rotate, shard)
        return dq, k_cur, v_cur, seg_cur, dk_cur, dv_cur

    zeros = varying_like((jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                          jnp.zeros(v.shape, jnp.float32)), q)
    init = (zeros[0], k, v, kv_seg, zeros[1], zeros[2])
    dq, _, _, _, dk, dv = lax.fori_loop(0, size, step, init)
    d_aux = None
    if aux is not None:
        finite = jnp.where(jnp.isfinite(lse), lse, jnp.inf)
        p_sink = jnp.exp(aux.astype(jnp.float32)[None, :, None, :] - finite[..., None])  # [B, H, Sq, K]
        d_aux = -jnp.sum(p_sink * delta[..., None], axis=(0, 2))
        d_aux = _in_turn(rs, lambda d: summed_like(d, aux, rs.axis_name), d_aux)
        d_aux = d_aux.astype(aux.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_aux


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(call: RingAttentionCall, blocks: TpuFlashBlocks, *, interpret=False) -> jax.Array:
    """The ring of TPU block kernels on a validated call, ``blocks`` tiling the local shards. ``interpret``:
    False (compile with Mosaic), True (Pallas' generic interpreter) or a ``pltpu.InterpretParams``."""
    query = call.query
    if interpret is True and call.axis_name is not None:
        # Pallas' generic interpreter evaluates kernel bodies under shard_map's varying-axes checks and
        # trips on them (jax 0.11: "mul requires varying manual axes to match"); the TPU interpreter does not.
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    block = tpu.block_static(
        query, call.key, call.value, has_segments=call.q_segment_ids is not None, softmax_scale=call.softmax_scale,
        causal=call.causal, sliding_window=call.sliding_window, logits_soft_cap=call.logits_soft_cap, blocks=blocks,
        precision=call.precision if query.dtype == jnp.float32 else None, interpret=interpret,
    )
    aux = None if call.softmax_aux is None else call.softmax_aux.reshape(query.shape[2], -1)
    rs = _RingStatic(block=block, axis_name=call.axis_name, precision=call.precision,
                     in_order=interpret is not False and call.axis_name is not None)
    return _ring(rs, query, call.key, call.value, call.q_segment_ids, call.kv_segment_ids, aux)


def _shard_facts(call: RingAttentionCall) -> tuple[int, int, object, int]:
    """(local q_len, local kv_len, dtype, head_dim): what the heuristic and the candidates depend on."""
    return call.query.shape[1], call.key.shape[1], call.query.dtype, call.query.shape[3]


class PallasRingAttention(Implementation[RingAttentionCall, TpuFlashBlocks]):
    """The ring over the TPU flash block kernels (see the module docstring); on CPU in interpret mode only."""

    config_type = TpuFlashBlocks

    def supports(self, call: RingAttentionCall) -> None:
        if jax.default_backend() not in ("tpu", "cpu"):
            raise UnsupportedFeature("pallas ring_attention uses the TPU block kernels; on GPUs use platform='xla'")
        if call.sequence_layout != "contiguous":
            raise UnsupportedFeature(f"pallas ring_attention: sequence_layout={call.sequence_layout!r} (its block "
                                     "kernels take contiguous shards; platform='xla' takes every layout)")
        tpu_interpret_or_refuse()  # on a CPU without interpret mode: says what runs instead

    def heuristic_config(self, call: RingAttentionCall) -> TpuFlashBlocks:
        """The TPU flash heuristic for the local shard lengths (one block over short shards, multiples of
        128 rows otherwise)."""
        return tpu.heuristic_blocks(*_shard_facts(call))

    def candidate_configs(self, call: RingAttentionCall) -> list[TpuFlashBlocks]:
        return tpu.candidate_blocks(*_shard_facts(call))

    def __call__(self, call: RingAttentionCall, config: TpuFlashBlocks) -> jax.Array:
        return ring_attention(call, config, interpret=tpu_interpret_or_refuse())


IMPLEMENTATION = PallasRingAttention()
