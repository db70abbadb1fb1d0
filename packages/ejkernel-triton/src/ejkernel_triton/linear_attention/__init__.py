"""Chunked gated linear attention as Triton kernels: ``recurrent``, ``gla`` and ``lightning_attention``
(one :class:`~ejkernel.modules.operations.recurrent.LinearAttentionCall`, one implementation).

Supported, forward and backward (gradients of q, k, v, every gate given and the initial state; the final
state's cotangent flows back): per-dimension key gates ``g`` and ``gk`` [B, T, H, K], scalar gates
``g`` [B, T, H, 1], ``g_gamma``, GQA (kv heads repeated before the kernels), ``reverse`` (every sequence
flipped around the kernels), any length (padded to whole chunks of 64 with neutral tokens), varlen
``cu_seqlens`` (a chunk table: chunks start at every sequence's start, the kernels mask short ones), initial
and final state, head dims up to 256, bf16/fp16/fp32 (float32 with IEEE dots). Refused with
:class:`ejkernel.UnsupportedFeature` (the dispatcher falls back to XLA): the value-dimension gate ``gv``,
head dims above 256.

All key-dimension gates are summed into one float32 log gate ``a`` [B, T, H, K] (``g`` + ``gk`` +
``g_gamma``, broadcast); autodiff of that sum hands each gate its gradient. When every gate given is one
scalar per token and head (scalar ``g``, ``g_gamma``, ``lightning_attention``'s decay, or none), ``a`` is
[B, T, H, 1] and the kernels take their scalar-gate path (the intra-chunk matrix is one matmul). Modules:
``forward`` (chunk states, outputs), ``backward`` (state gradients, dv, dq/dk/dg), ``vjp`` (launches, custom
VJP, vmap rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.recurrent import LinearAttentionCall
from ejkernel_triton.interpret import interpreting
from ejkernel_triton.linear_attention.forward import CHUNK
from ejkernel_triton.linear_attention.vjp import StaticParams, chunk_table, linear_attention, table_chunks

__all__ = ["IMPLEMENTATION", "TritonLinearAttention", "TritonLinearAttentionConfig"]

MAX_HEAD_DIM = 256


def _power_of_two(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"TritonLinearAttentionConfig.{name} must be a power of two >= 16, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TritonLinearAttentionConfig:
    """Tiles of the key and value dims (the chunk is fixed at 64 tokens) and the launch shapes, per pass.

    ``block_k``/``block_v``: None picks min(64, head dim rounded up to a power of two >= 16);
    ``output_block_v``: the output kernel's value tile (None: min(128, ...): one tile computes the chunk's
    intra matrix once for V <= 128). ``num_warps``: the forward's output kernel (at 4 warps it spills on
    sm_90, at 8 it uses 240 registers without); ``backward_num_warps``: the backward's dv and dq/dk/dg kernels
    (H200, B=4 T=4k H=8 K=V=128: the backward took 1.17 ms at 4 warps, 1.68 at 8, although dq/dk/dg spills
    216 B at 4). ``state_num_warps``, ``state_block_k``/``state_block_v`` (None: ``block_k``/``block_v``): the
    two sequential state kernels (forward states, recomputed in the backward, and the state gradients):
    smaller tiles run more programs (B*H*(K/tile)*(V/tile)) over the same chain of chunks;
    ``state_num_stages`` (None: ``num_stages``): their software pipelining depth (loads of later chunks in
    flight while the state is updated).
    ``decayed_keys``: the cumulative-gate kernel also writes k * exp(gc_last - gc), so that the state loops only
    load and multiply (one more [B, T, H, K] array in k's dtype written and read; the backward recomputes it).
    ``intra_kernel``: the intra-chunk matrix A by its own kernel of small programs (one per sub-chunk of 16 rows,
    chunk and head) instead of inside the output kernel, which then reads it (A is stored anyway);
    ``intra_num_warps``: its warps; ``intra_split``: its two parts (across sub-chunks, inside them) as two
    launches into the same array, each with its own registers and shared memory (H100, B=4 T=16k H=8 K=V=128:
    forward 2.212 ms split, 2.438 not); ``intra_inside_num_warps``: the second launch's warps (None: the
    same).
    ``carried_state``: fixed-length calls with K <= 128 (and scalar gates or ``intra_kernel``) run the forward
    as segments of chunks, all at once, each carrying its state in registers through its chunks
    (``_carried_output_kernel``) from the state entering it (each segment summed from zero by the state
    kernel, those sums carried across the segments by the output kernel): no per-chunk states written and
    read back, and 1/segments of the sequential chain; the backward recomputes the states and their
    gradients per segment likewise. ``segments``: per sequence of a fixed-length call (None: ~256 programs,
    at most one per 8 chunks). ``carried_block_v``/``carried_num_warps``/``carried_num_stages`` (None: ``num_stages``):
    that kernel's value tile, warps and pipelining depth; None: 64 / 4 for scalar gates, 128 / 8 for
    per-dimension ones (H100, B=4 T=16k H=8 K=V=128, forward: lightning 0.434 ms at 64 / 4, 0.614 at 128 / 8,
    0.711 at 64 / 8; gla 1.827 and 1.853 ms at 128 / 8 against 1.884 and 1.886 at 64 / 4, two runs).
    ``cumsum_block_k``/``cumsum_num_warps``: the cumulative-gate kernel's key tile and warps (per-dimension
    gates: it reads the gates and keys and writes gc and the decayed keys, 804 MB at that shape).
    ``carried_varlen``: varlen calls through the carried forward too (runs of ``carried_varlen_run`` chunks
    inside each packed sequence; None: at least 8, ~256 programs; the backward keeps the stored-state passes).
    Off by default: it passes the GPU suite but was slower than the stored-state forward (H100, 8 sequences in
    16k tokens, forward: gla 0.722 vs 0.676 ms, lightning 0.598 vs 0.286, recurrent 0.410 vs 0.274).

    Resolution: a user's config may leave the fields above at None ("the rule"); :meth:`resolved` decides
    them for the call, once, where the call runs (``TritonLinearAttention.__call__``), and the heuristic and
    candidate configs the executor stores are resolved ones: every field the value the kernels run with.
    There ``decayed_keys``/``intra_kernel`` are False for scalar gates (their kernels then do not run),
    ``segments`` is the carried forward's segment count (0: it does not run: varlen, K > 128, or off) and
    ``carried_varlen_run`` its chunks per run for varlen calls (0: it does not run)."""

    block_k: int | None = None
    block_v: int | None = None
    output_block_v: int | None = None
    num_warps: int = 8
    num_stages: int = 2
    state_num_warps: int = 4
    state_num_stages: int | None = None
    backward_num_warps: int = 4
    state_block_k: int | None = None
    state_block_v: int | None = None
    # both on: the final H200 run of 2026-11-23 (B=4 T=4k H=8 K=V=128 bf16) measured the forward at 0.811 ms
    # with neither, 0.802 decayed keys, 0.740 intra kernel, 0.705 both (forward+backward 2.029 / 1.953 / 1.857 /
    # 1.811 ms)
    decayed_keys: bool = True
    intra_kernel: bool = True
    intra_num_warps: int = 4
    intra_split: bool = True
    intra_inside_num_warps: int | None = None
    carried_state: bool = True
    segments: int | None = None
    carried_block_v: int | None = None
    carried_num_warps: int | None = None
    carried_num_stages: int | None = None
    cumsum_block_k: int = 128
    cumsum_num_warps: int = 8
    carried_varlen: bool = False
    carried_varlen_run: int | None = None

    def __post_init__(self):
        for name in ("block_k", "block_v", "output_block_v", "state_block_k", "state_block_v", "carried_block_v",
                     "cumsum_block_k"):
            if getattr(self, name) is not None:
                _power_of_two(name, getattr(self, name))
        for name in ("num_warps", "num_stages", "state_num_warps", "state_num_stages", "backward_num_warps",
                     "intra_num_warps", "intra_inside_num_warps", "segments", "carried_num_warps", "carried_num_stages",
                     "cumsum_num_warps", "carried_varlen_run"):
            value = getattr(self, name)
            if value is None and name in ("intra_inside_num_warps", "state_num_stages", "segments", "carried_num_warps",
                                          "carried_num_stages", "carried_varlen_run"):
                continue
            if name in ("segments", "carried_varlen_run"):  # 0: the carried forward does not run (resolved)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"TritonLinearAttentionConfig.{name} must be an int >= 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TritonLinearAttentionConfig.{name} must be a positive int, got {value!r}")
        for name in ("decayed_keys", "intra_kernel", "intra_split", "carried_state", "carried_varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TritonLinearAttentionConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def resolved(self, call: LinearAttentionCall) -> TritonLinearAttentionConfig:
        """This config with every field the kernels read decided for ``call`` (the class docstring): None
        fields by the rules given there, ``segments``/``carried_varlen_run`` to what runs (0: the carried
        forward does not), ``decayed_keys``/``intra_kernel`` off for scalar gates. A resolved config is its own."""
        batch, total, heads, dk = call.query.shape
        dv = call.value.shape[-1]
        scalar_gate = has_scalar_gates(call)
        varlen = call.cu_seqlens is not None
        intra_kernel = self.intra_kernel and not scalar_gate
        carried_block_v = _block(dv, self.carried_block_v, 64 if scalar_gate else 128)
        value_tiles = -(-dv // carried_block_v)
        usable = scalar_gate or intra_kernel
        segments = carried_segments(self, batch, heads, -(-total // CHUNK), value_tiles, dk,
                                    usable=not varlen and usable)
        varlen_run = 0
        if varlen:
            varlen_run = carried_varlen_run(self, table_chunks(total, call.cu_seqlens.shape[0] - 1), heads,
                                            value_tiles, dk, usable=usable)
        return dataclasses.replace(
            self, block_k=_block(dk, self.block_k), block_v=_block(dv, self.block_v),
            output_block_v=_block(dv, self.output_block_v, 128),
            state_num_stages=self.state_num_stages or self.num_stages,
            state_block_k=_block(dk, self.state_block_k or self.block_k),
            state_block_v=_block(dv, self.state_block_v or self.block_v),
            decayed_keys=self.decayed_keys and not scalar_gate, intra_kernel=intra_kernel,
            intra_inside_num_warps=self.intra_inside_num_warps or self.intra_num_warps,
            segments=segments, carried_block_v=carried_block_v,
            carried_num_warps=self.carried_num_warps or (4 if scalar_gate else 8),
            carried_num_stages=self.carried_num_stages or self.num_stages, carried_varlen_run=varlen_run,
        )

    @classmethod
    def parse(cls, spec: str) -> TritonLinearAttentionConfig:
        """A config from ``name=value`` pairs joined by ``/`` (e.g. ``state_block_k=32/decayed_keys=1``; the
        benchmark's ``--configs``); ints, the bool fields 0/1."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, spec.split("/")):
            name, _, raw = item.partition("=")
            if name not in fields:
                raise ValueError(f"TritonLinearAttentionConfig has no field {name!r} (spec {spec!r})")
            is_bool = fields[name].type in ("bool", bool)
            if raw not in ("0", "1") if is_bool else not raw.isdigit():
                wanted = "0 or 1" if is_bool else "a positive int"
                raise ValueError(f"TritonLinearAttentionConfig.{name} takes {wanted} in a spec, got {item!r} "
                                 f"(spec {spec!r})")
            values[name] = bool(int(raw)) if is_bool else int(raw)
        return cls(**values)


CARRIED_PROGRAMS = 256
"""Programs the carried-state forward aims for (about two per SM of an H100), when the config names no
segment count."""


def carried_segments(config: TritonLinearAttentionConfig, batch: int, heads: int, chunks: int, value_tiles: int,
                     dk: int, usable: bool) -> int:
    """Segments per sequence for the carried-state forward, or 0 when it does not apply (varlen, K > 128, or
    neither scalar gates nor the intra kernel: ``usable``; or ``carried_state`` off)."""
    if not (config.carried_state and usable and dk <= 128):
        return 0
    if config.segments is not None:
        return min(config.segments, chunks)
    wanted = -(-CARRIED_PROGRAMS // (batch * heads * value_tiles))
    return max(1, min(wanted, chunks // 8))


def carried_varlen_run(config: TritonLinearAttentionConfig, chunks: int, heads: int, value_tiles: int, dk: int,
                       usable: bool) -> int:
    """Chunks per run for the carried forward of a varlen call (``chunks``: the chunk table's entries), or 0
    when it does not apply (``carried_varlen`` or ``carried_state`` off, K > 128, not ``usable``): the
    config's ``carried_varlen_run``, else at least 8 chunks and about ``CARRIED_PROGRAMS`` programs."""
    if not (config.carried_varlen and config.carried_state and usable and dk <= 128):
        return 0
    if config.carried_varlen_run is not None:
        return config.carried_varlen_run
    return max(8, -(-chunks * heads * value_tiles // CARRIED_PROGRAMS))


def _block(dim: int, chosen: int | None, largest: int = 64) -> int:
    if chosen is not None:
        return chosen
    return max(16, min(largest, 1 << (dim - 1).bit_length()))


def has_scalar_gates(call: LinearAttentionCall) -> bool:
    """Whether every gate of the call is one value per token and head (or there are none)."""
    return call.gk is None and (call.g is None or call.g.shape[-1] == 1)


def key_log_gate(call: LinearAttentionCall) -> jax.Array:
    """``g + gk + g_gamma`` as float32 [B, T, H, K], or [B, T, H, 1] when :func:`has_scalar_gates` (zeros
    without gates)."""
    batch, total, heads, dk = call.query.shape
    if has_scalar_gates(call):
        dk = 1
    total_gate = None  # no copy when g alone is given in float32
    for gate in (call.g, call.gk, None if call.g_gamma is None else call.g_gamma[:, None, :, None]):
        if gate is not None:
            gate = gate.astype(jnp.float32)
            total_gate = gate if total_gate is None else total_gate + gate
    if total_gate is None:
        return jnp.zeros((batch, total, heads, dk), jnp.float32)
    return jnp.broadcast_to(total_gate, (batch, total, heads, dk))


def reverse_order(cu_seqlens, total: int) -> jax.Array:
    """Token order running every packed sequence back to front (an involution; tokens past the end stay)."""
    tokens = jnp.arange(total, dtype=jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], tokens, side="right"), 0, cu.shape[0] - 2)
    return jnp.where(tokens < cu[-1], cu[seq] + cu[seq + 1] - 1 - tokens, tokens)


class TritonLinearAttention(Implementation[LinearAttentionCall, TritonLinearAttentionConfig]):
    """Triton kernels through jax-triton (see the module docstring).

    Precision: float32 inputs run IEEE float32 dots; bf16/fp16 dots take exact products of the inputs'
    dtype (decayed queries and keys rounded to it, as flash attention rounds its probabilities) with
    float32 accumulation and float32 states, gates and cumulative sums; nothing is refused for its precision.
    """

    config_type = TritonLinearAttentionConfig

    def supports(self, call: LinearAttentionCall) -> None:
        if call.gv is not None:
            raise UnsupportedFeature("triton linear attention: the value-dimension gate gv is not implemented "
                                     "(use the XLA backend)")
        dk, dv = call.query.shape[-1], call.value.shape[-1]
        if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
            raise UnsupportedFeature(f"triton linear attention: head dims {dk}/{dv} above {MAX_HEAD_DIM}")

    def heuristic_config(self, call: LinearAttentionCall) -> TritonLinearAttentionConfig:
        """The default config resolved for ``call``: every tile, launch shape and segment count that runs."""
        return TritonLinearAttentionConfig().resolved(call)

    def candidate_configs(self, call: LinearAttentionCall) -> Sequence[TritonLinearAttentionConfig]:
        # the default (decayed keys + intra kernel + carried states, measured fastest), then the single levers,
        # smaller state tiles and the stored-state forward; resolved, without repeats (scalar gates run no
        # decayed-keys or intra kernel, so those levers change nothing there)
        levers = (TritonLinearAttentionConfig(),
                  TritonLinearAttentionConfig(carried_state=False),
                  TritonLinearAttentionConfig(decayed_keys=False, intra_kernel=False),
                  TritonLinearAttentionConfig(decayed_keys=False),
                  TritonLinearAttentionConfig(intra_kernel=False),
                  TritonLinearAttentionConfig(state_block_k=32, state_block_v=32))
        return tuple(dict.fromkeys(config.resolved(call) for config in levers))

    def __call__(self, call: LinearAttentionCall, config: TritonLinearAttentionConfig) -> tuple[jax.Array, jax.Array]:
        config = config.resolved(call)  # a user's config may leave fields to the rules; the executor's are resolved
        q, k, v = call.query, call.key, call.value
        total = q.shape[1]
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k = jnp.repeat(k, group, axis=2)
            v = jnp.repeat(v, group, axis=2)
        a = key_log_gate(call)
        scalar_gate = a.shape[-1] == 1
        arrays = [q, k, v, a]
        varlen = call.cu_seqlens is not None
        order = None
        if call.reverse:
            if varlen:  # every packed sequence back to front (an involution; tokens past the end stay)
                order = reverse_order(call.cu_seqlens, total)
                arrays = [x[:, order] for x in arrays]
            else:
                arrays = [jnp.flip(x, axis=1) for x in arrays]
        tables = None
        if varlen:  # chunks start at every sequence's start: nothing to pad
            tables = chunk_table(call.cu_seqlens, total)
        else:
            padded = -(-total // CHUNK) * CHUNK
            if padded != total:  # neutral tokens at the end: zero keys and gates leave the state as it is
                arrays = [jnp.pad(x, [(0, 0), (0, padded - total), (0, 0), (0, 0)]) for x in arrays]
        st = StaticParams(scale=float(call.softmax_scale), block_k=config.block_k, block_v=config.block_v,
                          output_block_v=config.output_block_v, num_warps=config.num_warps,
                          num_stages=config.num_stages, state_num_warps=config.state_num_warps,
                          state_num_stages=config.state_num_stages,
                          interpret=interpreting(), varlen=varlen, backward_num_warps=config.backward_num_warps,
                          state_block_k=config.state_block_k, state_block_v=config.state_block_v,
                          decayed_keys=config.decayed_keys, intra_kernel=config.intra_kernel, scalar_gate=scalar_gate,
                          intra_num_warps=config.intra_num_warps, intra_split=config.intra_split,
                          intra_inside_num_warps=config.intra_inside_num_warps,
                          segments=config.segments, varlen_run_chunks=config.carried_varlen_run,
                          carried_block_v=config.carried_block_v, carried_num_warps=config.carried_num_warps,
                          carried_num_stages=config.carried_num_stages,
                          cumsum_block_k=config.cumsum_block_k, cumsum_num_warps=config.cumsum_num_warps)
        o, final = linear_attention(*arrays, call.initial_state, tables, st)
        o = o[:, :total]
        if call.reverse:
            o = o[:, order] if varlen else jnp.flip(o, axis=1)
        return o, final


IMPLEMENTATION = TritonLinearAttention()
"""Registered for ``recurrent``, ``gla`` and ``lightning_attention``."""
