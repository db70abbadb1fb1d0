"""Our own Hopper flash attention kernels (``csrc/flash_attention``, CUTLASS/CuTe, sm_90a) bound through the
XLA FFI: forward and backward as ``jax.ffi.ffi_call``s of the targets ``EjkFlashForward`` /
``EjkFlashBackward`` registered by :mod:`ejkernel_cuda._native`, one custom VJP around them.

The FFI contract (what the kernels export; arrays contiguous row-major):

- ``EjkFlashForward(q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, D], sinks [B, Hq, n] float32,
  q_segment_ids [B, Sq] int32, kv_segment_ids [B, Sk] int32) -> (out [B, Sq, Hq, D] (q's dtype), lse [B, Hq,
  Sq] float32, next_tile [1] int32)``: ``lse`` the natural log-sum-exp of the scaled (soft-capped) logits and
  the sinks, ``+inf`` for a row that sees no key and has no sink (its output is 0); ``n = 0`` means no sinks,
  segment ids of shape ``[B, 0]`` none; ``next_tile`` is the persistent kernel's tile counter (scratch,
  dropped here);
- ``EjkFlashBackward(q, k, v, d_out, lse, delta [B, Hq, Sq] float32, sinks, q_segment_ids, kv_segment_ids)
  -> (dq, dk, dv, dq_accum)`` (the shapes and dtypes of q, k, v; ``dq_accum`` float32 ``[B, Hq, Sq rounded up
  to 64, D]`` is the kernel's workspace, 64-query chunks in its own order, dropped here), ``delta =
  rowsum(d_out * out)`` in float32, formed here in JAX, as is the sinks' gradient (``-sum_rows exp(sink -
  lse) * delta``);
- attributes of both: ``softmax_scale`` (f32), ``causal`` (bool), ``window_left`` / ``window_right`` (i64,
  -1: unbounded), ``softcap`` (f32, 0: off). Query ``i`` sits at key position ``i + Sk - Sq`` (ejkernel's
  alignment); GQA/MQA (``Hq % Hk == 0``) is handled inside the kernels.

Taken: bfloat16/float16, head dims 64 or 128 (query and value alike), any lengths >= 1, GQA/MQA, causal,
sliding window, soft cap, attention sinks, segment ids (every key block then masked: none skipped), packed
varlen self-attention (one ``cum_seqlens`` array for queries and keys: run as segment ids), on a GPU of
compute capability 9.0 (H100 / H200 / GH200: the library holds sm_90a code only). :func:`refusal` names
everything else (bias, masks, varlen with separate arrays, dropout, other dtypes and head dims, another GPU,
the library missing), and :func:`check_supported` raises it as ``UnsupportedFeature`` before anything is
traced.

``jax.vmap`` folds the mapped axes into the batch axis (one kernel launch, no loop); the calls work under
``jit``, ``shard_map`` (per-shard arrays) and ``jax.export``: the custom calls have no compatibility
guarantee of JAX's, so ``jax.export.export(..., disabled_checks=native_flash.export_disabled_checks())``;
they are serialized by name, and the process that runs the exported program must have registered the
targets (:func:`ejkernel_cuda._native.ensure_registered`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.errors import UnsupportedFeature
from ejkernel.plugins.checks import UNVERIFIED_ENV, first_gpu, gpu_compute_capability, unverified_requested
from ejkernel_cuda import _native

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
COMPUTE_CAPABILITY = "9.0"  # sm_90a code only: neither older GPUs nor later ones (whose sm_100 has no wgmma)
NAME = "cuda native flash attention"


def device_refusal() -> str | None:
    """Why this process's GPU cannot run the kernels (no GPU, or not compute capability 9.0), or None."""
    capability = gpu_compute_capability()
    if capability is None:
        return "no GPU visible (the native kernels need an sm_90 GPU: H100 / H200 / GH200)"
    if capability != COMPUTE_CAPABILITY:
        return (f"the GPU ({first_gpu().device_kind}) has compute capability {capability}; the native kernels are "
                f"built for sm_90a only (H100 / H200 / GH200)")
    return None


# The project's rule for kernels no GPU run has checked (docs/DEVELOPING.md): used only with
# EJKERNEL_UNVERIFIED_KERNELS=1 (scripts/device/gpu_tests.sh sets it) until their GPU tests pass. The kernels
# with sinks, segment ids and packed varlen passed on an H100, 2026-11-27
# (results/nvidia-h100-2026-11-27b-cuda-native-gpu-tests.json: 115 passed, 40 refusals skipped).
VERIFIED_ON_GPU = True


def usable_here() -> str | None:
    """Why the native kernels cannot run in this process at all, or None: what ``ejkernel list-backends``
    shows for them. The GPU's reason and the library's together (a machine without the GPU may still lack
    the library); the FFI targets are registered only where both are fine."""
    reasons = [reason for reason in (device_refusal(), _native.library_missing()) if reason]
    if not VERIFIED_ON_GPU and not unverified_requested():
        reasons.append(f"not yet verified on a GPU: used only with {UNVERIFIED_ENV}=1 (the device test run)")
    return "; ".join(reasons) if reasons else _native.registration_failed()


def refusal(call, *, check_device: bool = True) -> str | None:
    """Why the native kernels cannot take ``call`` (a validated ``FlashAttentionCall``) here, or None. The
    call's own features first (so a refused feature is named on any machine), then the GPU and the library
    (``check_device=False``: the call alone)."""
    query, key, value = call.query, call.key, call.value
    for given, feature in (
        (call.bias is not None, "bias"),
        (call.attention_mask is not None, "attention_mask"),
        (call.cum_seqlens_q is not None and not _packed_self_attention(call),
         "cum_seqlens (varlen) with separate query and key arrays or lengths"),
        (call.cum_seqlens_q is not None and call.q_segment_ids is not None, "segment ids together with cum_seqlens"),
        (bool(call.dropout_prob), "dropout"),
    ):
        if given:
            return f"{feature} is not supported"
    if query.dtype not in DTYPES:
        return f"query/key/value dtype {query.dtype} is not supported (bfloat16 or float16)"
    head_dims = (query.shape[-1], value.shape[-1])
    if head_dims[0] != head_dims[1] or head_dims[0] not in HEAD_DIMS:
        return f"head dims (query, value) {head_dims} are not supported (equal, one of {HEAD_DIMS})"
    if min(query.shape[1], key.shape[1]) < 1:
        return f"lengths (query {query.shape[1]}, key {key.shape[1]}) must be >= 1"
    if query.shape[1] == key.shape[1] == 1:
        # softmax over one key: dq and dk are exactly 0, the kernels' float32 rounding leaves ~1e-8 of them
        return "one query and one key (exact zero gradients: taken by the other backends)"
    if not call.softmax_scale > 0:
        # the kernels take the running maximum over raw scores (a positive scale keeps its order)
        return f"softmax_scale={call.softmax_scale} (the kernels need a positive scale)"
    if not check_device:
        return None
    return usable_here()


def check_supported(call, *, check_device: bool = True) -> None:
    """Raise ``UnsupportedFeature`` naming :func:`refusal`'s reason."""
    reason = refusal(call, check_device=check_device)
    if reason is not None:
        raise UnsupportedFeature(f"{NAME}: {reason}")


def export_disabled_checks() -> list:
    """``jax.export``'s ``disabled_checks`` for programs that call these kernels (module docstring)."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in _native.TARGETS]


# ---- the FFI calls ---------------------------------------------------------------------------------


def _attributes(scale: float, causal: bool, window: tuple[int, int] | None, softcap: float | None) -> dict:
    """The kernels' attributes with the FFI types of the contract (numpy scalars fix f32 / i64)."""
    left, right = (-1, -1) if window is None else window
    return dict(softmax_scale=np.float32(scale), causal=bool(causal), window_left=np.int64(left),
                window_right=np.int64(right), softcap=np.float32(softcap or 0.0))


# The kernels' grids put the batch on CUDA's z axis (65535 blocks at most): larger batches (a vmap folded into
# the batch, many short sequences) run in launches of this many.
MAX_LAUNCH_BATCH = 65535


def _in_batch_chunks(function):
    """``function`` (of arrays whose axis 0 is the batch, returning such arrays) run on batch chunks of at most
    :data:`MAX_LAUNCH_BATCH`, the results concatenated."""

    def chunked(*arrays):
        batch = arrays[0].shape[0]
        if batch <= MAX_LAUNCH_BATCH:
            return function(*arrays)
        parts = [function(*(a[start:start + MAX_LAUNCH_BATCH] for a in arrays))
                 for start in range(0, batch, MAX_LAUNCH_BATCH)]
        return tuple(jnp.concatenate(pieces, axis=0) for pieces in zip(*parts))

    return chunked


def _folded(function):
    """``function`` (of arrays whose axis 0 is the batch) under ``jax.custom_batching.custom_vmap``: a
    vmapped call moves the mapped axis in front, broadcasts unmapped arguments, folds it into the batch axis,
    runs once and unfolds every result; batches past the grid's limit in chunks (:func:`_in_batch_chunks`)."""
    function = _in_batch_chunks(function)
    mapped = jax.custom_batching.custom_vmap(function)

    @mapped.def_vmap
    def _rule(axis_size, in_batched, *arguments):
        flat = []
        for argument, batched in zip(arguments, in_batched):
            if not batched:
                argument = jnp.broadcast_to(argument, (axis_size, *argument.shape))
            flat.append(argument.reshape(axis_size * argument.shape[1], *argument.shape[2:]))
        results = mapped(*flat)
        unfolded = tuple(r.reshape(axis_size, r.shape[0] // axis_size, *r.shape[1:]) for r in results)
        return unfolded, (True,) * len(unfolded)

    return mapped


def _result(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """An FFI result's type, varying over the manual mesh axes ``like`` varies over: inside ``shard_map`` the
    custom VJP checks that each gradient has its input's type (jax 0.11's ``manual_axis_type``)."""
    aval = jax.typeof(like)
    varying = getattr(aval, "manual_axis_type", None)
    if varying is None or varying.empty:
        return jax.ShapeDtypeStruct(shape, dtype)
    # the varying axes are named by the (abstract) mesh of the array: the result's sharding carries it
    sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=varying)


@functools.lru_cache(maxsize=None)
def _forward_call(scale, causal, window, softcap):
    attributes = _attributes(scale, causal, window, softcap)

    def forward_call(q, k, v, sinks, q_segments, kv_segments):
        b, sq, hq, _ = q.shape
        shapes = (_result(q.shape, q.dtype, q), _result((b, hq, sq), jnp.float32, q), _result((1,), jnp.int32, q))
        out, lse, _ = jax.ffi.ffi_call(_native.FORWARD_TARGET, shapes)(q, k, v, sinks, q_segments, kv_segments,
                                                                       **attributes)
        return out, lse

    return _folded(forward_call)


@functools.lru_cache(maxsize=None)
def _backward_call(scale, causal, window, softcap):
    attributes = _attributes(scale, causal, window, softcap)

    def backward_call(q, k, v, d_out, lse, delta, sinks, q_segments, kv_segments):
        b, sq, hq, d = q.shape
        accumulator = _result((b, hq, -(-sq // 64) * 64, d), jnp.float32, q)
        shapes = (*(_result(x.shape, x.dtype, x) for x in (q, k, v)), accumulator)
        dq, dk, dv, _ = jax.ffi.ffi_call(_native.BACKWARD_TARGET, shapes)(
            q, k, v, d_out, lse, delta, sinks, q_segments, kv_segments, **attributes)
        return dq, dk, dv

    return _folded(backward_call)


def _varying_like(x, like):
    """``x`` made to vary over the manual mesh axes ``like`` varies over (inside ``shard_map``: a replicated sink
    array feeding per-shard kernels; its gradient is then summed over the shards by ``pcast``'s transpose)."""
    axes = getattr(getattr(jax.typeof(like), "manual_axis_type", None), "varying", frozenset())
    have = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())
    missing = tuple(sorted(axes - have))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _extras(q, k, sinks, q_segment_ids, kv_segment_ids):
    """The kernels' optional inputs in their FFI form: sinks float32 [B, Hq, n] (n = 0: none; broadcast over the
    batch, so a vmap folds them like the other inputs), segment ids int32 [B, Sq] / [B, Sk] (both [B, 0]: none)."""
    b, _, hq, _ = q.shape
    sinks = jnp.zeros((hq, 0), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(hq, -1)
    if q_segment_ids is None:
        q_segment_ids = kv_segment_ids = jnp.zeros((b, 0), jnp.int32)
    extras = (jnp.broadcast_to(sinks, (b, *sinks.shape)), q_segment_ids.astype(jnp.int32),
              kv_segment_ids.astype(jnp.int32))
    return tuple(_varying_like(x, q) for x in extras)


def forward(q, k, v, *, scale: float, causal: bool, window: tuple[int, int] | None = None,
            softcap: float | None = None, sinks=None, q_segment_ids=None, kv_segment_ids=None):
    """``(out [B, Sq, Hq, D], lse [B, Hq, Sq] float32)`` of the forward kernel (module docstring); ``sinks``:
    ``[Hq]`` or ``[Hq, n]`` logits in every row's denominator; segment ids ``[B, Sq]`` and ``[B, Sk]``."""
    _native.ensure_registered()
    return _forward_call(float(scale), bool(causal), window, softcap)(
        q, k, v, *_extras(q, k, sinks, q_segment_ids, kv_segment_ids))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention(q, k, v, sinks, q_segments, kv_segments, scale, causal, window, softcap):
    """Differentiable in q, k, v and sinks (``_extras``'s FFI forms; segment ids get no gradient)."""
    return _forward_call(scale, causal, window, softcap)(q, k, v, sinks, q_segments, kv_segments)[0]


def _attention_fwd(q, k, v, sinks, q_segments, kv_segments, scale, causal, window, softcap):
    out, lse = _forward_call(scale, causal, window, softcap)(q, k, v, sinks, q_segments, kv_segments)
    return out, (q, k, v, sinks, q_segments, kv_segments, out, lse)


def _attention_bwd(scale, causal, window, softcap, residuals, d_out):
    q, k, v, sinks, q_segments, kv_segments, out, lse = residuals
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = _backward_call(scale, causal, window, softcap)(q, k, v, d_out, lse, delta, sinks, q_segments,
                                                                  kv_segments)
    # a sink only joins the denominators: d sink[h, j] = -sum over rows of P(sink j) * delta
    d_sinks = -jnp.einsum("bhs,bhsn->bhn", delta, jnp.exp(sinks[:, :, None, :] - lse[..., None]))
    no_gradient = np.zeros(q_segments.shape, jax.dtypes.float0)
    return dq, dk, dv, d_sinks, no_gradient, np.zeros(kv_segments.shape, jax.dtypes.float0)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, scale: float, causal: bool, window: tuple[int, int] | None, softcap: float | None, *,
              sinks=None, q_segment_ids=None, kv_segment_ids=None):
    """Flash attention of whole arrays on the native kernels, differentiable (in q, k, v and sinks)."""
    _native.ensure_registered()
    return _attention(q, k, v, *_extras(q, k, sinks, q_segment_ids, kv_segment_ids), float(scale), bool(causal),
                      window, softcap)


def _packed_self_attention(call) -> bool:
    """A varlen call whose queries and keys share one ``cum_seqlens`` array over equal lengths: each sequence's
    queries then sit at the positions of its keys (ejkernel aligns them per sequence), so causal and window
    rules on the packed positions are the per-sequence ones, and the sequences run as segment ids."""
    return (call.cum_seqlens_q is not None and call.cum_seqlens_q is call.cum_seqlens_k
            and call.query.shape[1] == call.key.shape[1])


def _sequence_ids(cum_seqlens, length: int, outside: int):
    """``[1, length]`` int32: each packed token's sequence index; ``outside`` past the last sequence."""
    positions = jnp.arange(length, dtype=jnp.int32)
    ids = jnp.searchsorted(cum_seqlens, positions, side="right").astype(jnp.int32) - 1
    return jnp.where(positions < cum_seqlens[-1], ids, outside)[None]


def call_attention(call):
    """:func:`attention` of a validated ``FlashAttentionCall`` (refused calls raise ``UnsupportedFeature``);
    packed varlen self-attention runs as segment ids (tokens past the last sequence see nothing)."""
    check_supported(call)
    q_segment_ids, kv_segment_ids = call.q_segment_ids, call.kv_segment_ids
    if call.cum_seqlens_q is not None:
        length = call.query.shape[1]
        q_segment_ids = _sequence_ids(call.cum_seqlens_q, length, outside=-1)
        kv_segment_ids = _sequence_ids(call.cum_seqlens_k, length, outside=-2)
    return attention(call.query, call.key, call.value, call.softmax_scale, bool(call.causal), call.sliding_window,
                     call.logits_soft_cap, sinks=call.softmax_aux, q_segment_ids=q_segment_ids,
                     kv_segment_ids=kv_segment_ids)
