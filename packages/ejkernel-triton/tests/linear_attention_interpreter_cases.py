"""Numerics of the Triton chunked linear attention kernels through Triton's interpreter, on the host (run by
test_linear_attention.py).

TRITON_INTERPRET=1 must be set before triton is imported, so these cases run in a process of their own.
Each case runs a public operation (``gla_attention``, ``recurrent_attention``, ``lightning_attention``) with
``platform="triton"`` on a fresh random problem spanning several chunks of 64 (the last one partial), takes
the output, the final state and the gradient of every differentiable input (the initial state's too) under
one random cotangent of both outputs (so the final state's cotangent flows back), compares them with the
float64 recurrence of ``ejkernel.testing.recurrent`` and prints one JSON line per case.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import zlib

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import ejkernel.modules as modules  # noqa: E402
from ejkernel.testing.lightning_attention import reference_lightning_attention  # noqa: E402
from ejkernel.testing.numerics import normal_array, relative_error  # noqa: E402
from ejkernel.testing.recurrent import log_sigmoid_gate, reference_recurrent  # noqa: E402
from ejkernel_triton.linear_attention import TritonLinearAttentionConfig, vjp  # noqa: E402
from ejkernel_triton.linear_attention.forward import _intra_kernel  # noqa: E402

# The flags of the intra kernel's first launch (1: a sub-chunk left to the exact pair loop), recorded when they
# are computed, so a case can tell how many sub-chunks took the split dots.
EXACT_FLAGS = []
_launch = vjp.launch


def _recording_launch(kernel, *args, **kwargs):
    outputs = _launch(kernel, *args, **kwargs)
    if kernel is _intra_kernel and kwargs.get("ACROSS") and not kwargs.get("INSIDE"):
        jax.debug.callback(lambda flags: EXACT_FLAGS.append(np.asarray(flags)), outputs[1])
    return outputs


vjp.launch = _recording_launch


def _inputs(seed, batch, total, heads, kv_heads, dk, dv, dtype, *, gate="vector", strength=1.0, gate_scale=1.0,
            gamma=False, initial_state=True, bounds=None):
    inputs = dict(
        query=normal_array(seed, (batch, total, heads, dk), dtype),
        key=normal_array(seed + 1, (batch, total, kv_heads, dk), dtype),
        value=normal_array(seed + 2, (batch, total, kv_heads, dv), dtype),
    )
    if gate == "vector":
        inputs["g"] = log_sigmoid_gate(seed + 3, (batch, total, heads, dk), strength) * gate_scale
    elif gate == "scalar":
        inputs["g"] = log_sigmoid_gate(seed + 3, (batch, total, heads), strength) * gate_scale
    if gamma:
        inputs["g_gamma"] = -jnp.linspace(0.05, 0.5, heads, dtype=jnp.float32)
    if initial_state:
        rows = batch if bounds is None else len(bounds) - 1
        inputs["initial_state"] = normal_array(seed + 4, (rows, heads, dk, dv), jnp.float32)
    if bounds is not None:
        inputs["cu_seqlens"] = jnp.asarray(bounds, jnp.int32)
    return inputs


def run_case(name, *, operation="gla_attention", shape=(1, 150, 2, 2, 16, 32), dtype="float32", cfg=None,
             static=None, vmap=False, **gates):
    static = dict(static or {})
    batch, total, heads, kv_heads, dk, dv = shape
    inputs = _inputs(zlib.crc32(name.encode()) % 1000, batch, total, heads, kv_heads, dk, dv, dtype, **gates)
    if "cu_seqlens" in inputs:  # not differentiable: bound like the static arguments
        static["cu_seqlens"] = inputs.pop("cu_seqlens")
    if operation == "lightning_attention":
        inputs.pop("g", None)
        reference = functools.partial(reference_lightning_attention, **static)
    else:
        reference = functools.partial(reference_recurrent, **static)
    ours = functools.partial(getattr(modules, operation), platform="triton", cfg=cfg, **static)
    names = list(inputs)
    if vmap:  # two problems stacked on a new leading axis
        other = _inputs(zlib.crc32(name.encode()) % 1000 + 50, batch, total, heads, kv_heads, dk, dv, dtype, **gates)
        if operation == "lightning_attention":
            other.pop("g", None)
        inputs = {n: jnp.stack([inputs[n], other[n]]) for n in names}

    def flat(fn, *xs):
        if vmap:
            out, final = jax.vmap(lambda *ys: fn(**dict(zip(names, ys))))(*xs)
        else:
            out, final = fn(**dict(zip(names, xs)))
        return jnp.concatenate([out.astype(final.dtype).ravel(), final.ravel()])

    start = time.perf_counter()
    EXACT_FLAGS.clear()
    got, pullback = jax.vjp(functools.partial(flat, ours), *inputs.values())
    cotangent = normal_array(99, got.shape, jnp.float32)
    grads = pullback(cotangent)
    jax.block_until_ready(grads)
    elapsed = time.perf_counter() - start
    f64 = [x.astype(jnp.float64) for x in inputs.values()]

    @jax.jit  # one compilation instead of one per primitive (the reference's scan, its transpose, the glue)
    def reference_and_vjp(xs, d_out):
        want, ref_vjp = jax.vjp(functools.partial(flat, reference), *xs)
        return want, ref_vjp(d_out)

    want, want_grads = reference_and_vjp(f64, cotangent.astype(jnp.float64))
    states = batch if "cu_seqlens" not in static else static["cu_seqlens"].shape[0] - 1
    out_size = got.size - states * heads * dk * dv * (2 if vmap else 1)
    row = dict(name=name, dtype=dtype, seconds=round(elapsed, 2), finite=bool(np.all(np.isfinite(got))),
               out=relative_error(got[:out_size], want[:out_size]), final_state=relative_error(got[out_size:], want[out_size:]))
    for n, a, b in zip(names, grads, want_grads):
        row["d_" + n] = relative_error(a, b)
        row["finite"] &= bool(np.all(np.isfinite(np.asarray(a, np.float64))))
    if EXACT_FLAGS:  # (flags of sub-chunks past a short chunk's end stay as allocated: zeros here)
        row["exact_sub_chunks"] = float(np.mean(np.concatenate([f.ravel() for f in EXACT_FLAGS])))
    print(json.dumps(row), flush=True)


CASES = {
    # three chunks (the last one 2 tokens), per-dimension gates, initial state; K=40, V=24: two key tiles of 32
    # and two value tiles of 16, the second of each masked; the state kernels on 3 x 2 tiles of 16 x 16 and
    # with the decayed keys written by the cumulative-gate kernel; A by its own kernel (sub-chunks past the end)
    "gla_vector_gates_odd_dims": dict(shape=(1, 130, 1, 1, 40, 24),
                                      cfg=TritonLinearAttentionConfig(block_k=32, block_v=16, output_block_v=16,
                                                                      state_block_k=16, state_block_v=16,
                                                                      decayed_keys=True, intra_kernel=True)),
    # gates 40x stronger than log-sigmoid: every exponent stays <= 0, nothing overflows
    "gla_strong_gates": dict(shape=(1, 70, 1, 1, 16, 16), strength=8.0, gate_scale=40.0),
    # gates whose span inside a sub-chunk is above SPAN_LIMIT in about half the sub-chunks: the intra kernel's
    # and the backward's exact pair loops beside their split dots in one call; varlen with the two intra
    # launches (the second reads the first's flags), and fixed lengths with one launch
    "gla_mixed_spans_varlen": dict(shape=(1, 200, 2, 2, 16, 32), strength=8.0, gate_scale=2.5,
                                   bounds=(0, 70, 70, 150, 190)),
    "gla_mixed_spans_one_launch": dict(shape=(1, 192, 2, 2, 16, 32), strength=8.0, gate_scale=2.5,
                                       cfg=TritonLinearAttentionConfig(intra_split=False)),
    # scalar gate + g_gamma, GQA 2:1, reverse, float16
    "recurrent_scalar_gamma_gqa_reverse_fp16": dict(operation="recurrent_attention", shape=(1, 80, 2, 1, 16, 16),
                                                     dtype="float16", gate="scalar", gamma=True,
                                                     static=dict(reverse=True)),
    # varlen: sequences of 70, 0, 80 and 40 tokens (several chunks each, short last chunks, an empty one,
    # 10 tokens past the end), reverse, initial states; A by the intra kernel in one launch (the others: two
    # launches, the second aliased to the first's output)
    "gla_varlen_reverse": dict(shape=(1, 200, 1, 1, 16, 16), bounds=(0, 70, 70, 150, 190),
                               static=dict(reverse=True),
                               cfg=TritonLinearAttentionConfig(decayed_keys=True, intra_split=False)),
    # the scalar-gate path (A as one matmul): varlen as above with two key tiles (each program's share of the
    # gate gradient added in JAX) and masked value tiles; and gates 40x stronger than log-sigmoid
    "recurrent_scalar_varlen_odd_dims": dict(operation="recurrent_attention", shape=(1, 200, 2, 2, 40, 24),
                                             gate="scalar", bounds=(0, 70, 70, 150, 190),
                                             cfg=TritonLinearAttentionConfig(block_k=32, block_v=16, output_block_v=16,
                                                                             state_block_k=16, state_block_v=16)),
    "recurrent_scalar_strong_gates": dict(operation="recurrent_attention", shape=(1, 70, 1, 1, 16, 16),
                                          gate="scalar", strength=8.0, gate_scale=40.0),
    # the carried-state forward over segments (fixed lengths): 7 chunks in 3 segments of 3, 3 and 1 chunks, two
    # value tiles (the second masked), K=40 as one padded tile; the backward's states and state gradients per
    # segment (the state gradients' carries in JAX), batch 2, GQA, initial state
    "recurrent_scalar_segments": dict(operation="recurrent_attention", shape=(2, 400, 2, 1, 40, 24), gate="scalar",
                                      cfg=TritonLinearAttentionConfig(segments=3, carried_block_v=16,
                                                                      state_block_k=16, state_block_v=16)),
    # per-dimension gates, A by the intra kernel, keys decayed in the state loops (not by the cumulative-gate
    # kernel): 5 chunks in 4 segments (the last one empty), under vmap (the entering states folded into the
    # batch like every residual)
    "gla_segments_empty_last": dict(shape=(1, 300, 2, 2, 16, 32), strength=4.0, vmap=True,
                                    cfg=TritonLinearAttentionConfig(segments=4, decayed_keys=False)),
    # float16 through the carried kernel over 3 segments: scalar gate + g_gamma, reverse, GQA
    "recurrent_scalar_gamma_segments_fp16": dict(operation="recurrent_attention", shape=(1, 400, 2, 1, 16, 16),
                                                 dtype="float16", gate="scalar", gamma=True,
                                                 static=dict(reverse=True),
                                                 cfg=TritonLinearAttentionConfig(segments=3)),
    # varlen through the carried forward (opt-in): sequences of 70, 0, 80 and 40 tokens (+10 past the end) in
    # runs of one chunk (the 80 and 70 as two runs, the empty one as an empty run), reverse, initial states;
    # per-dimension gates with the intra kernel, and scalar gates over two value tiles
    "gla_varlen_carried": dict(shape=(1, 200, 1, 1, 16, 16), bounds=(0, 70, 70, 150, 190),
                               static=dict(reverse=True),
                               cfg=TritonLinearAttentionConfig(carried_varlen=True, carried_varlen_run=1)),
    "recurrent_scalar_varlen_carried": dict(operation="recurrent_attention", shape=(1, 200, 2, 2, 40, 24),
                                            gate="scalar", bounds=(0, 70, 70, 150, 190),
                                            cfg=TritonLinearAttentionConfig(carried_varlen=True, carried_varlen_run=1,
                                                                            carried_block_v=16)),
    # the stored-state forward at fixed lengths (carried_state off), scalar gates
    "recurrent_scalar_stored_states": dict(operation="recurrent_attention", shape=(1, 150, 1, 1, 16, 16),
                                           gate="scalar", cfg=TritonLinearAttentionConfig(carried_state=False)),
    # lightning (g_gamma only), no initial state, under vmap (folded into the batch)
    "lightning_vmap": dict(operation="lightning_attention", shape=(1, 64, 2, 2, 16, 16), gate=None,
                           initial_state=False, static=dict(layer_idx=1, num_layers=4), vmap=True),
}


def main(names):
    for name in names:
        run_case(name, **CASES[name])


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
