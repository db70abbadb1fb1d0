"""Numerics of the Triton block-sparse kernels through Triton's interpreter, on the host (run by
test_blocksparse.py in a subprocess: TRITON_INTERPRET=1 must be set before triton is imported).

Each case runs the forward and the gradients of q, k, v (and the sinks) of a fresh random problem through
the Triton implementation (small tiles, so mask blocks span several kernel tiles), compares them with the
float64 reference of the shared suite (``reference_blocksparse_attention``) and prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention  # noqa: E402
from ejkernel.testing.blocksparse_attention import random_block_mask, reference_blocksparse_attention  # noqa: E402
from ejkernel_triton import interpret  # noqa: E402
from ejkernel_triton.blocksparse_attention import IMPLEMENTATION, TritonBlockSparseConfig  # noqa: E402
from ejkernel_triton.decode import config as decode_config  # noqa: E402
from ejkernel.testing.numerics import relative_error  # noqa: E402
from interpreter_support import compile_for_hopper, random_qkv  # noqa: E402

KERNELS_RUN: list[str] = []
_run_on_host = interpret.run_on_host
interpret.run_on_host = lambda kernel, *a, **kw: KERNELS_RUN.append(kernel.__name__) or _run_on_host(kernel, *a, **kw)

SMALL_TILES = TritonBlockSparseConfig(16, 16, 4, 1, 16, 16, 16, 16, 4, 1)
_sm_count = decode_config.sm_count


def case(name, *, seed, b=1, sq=45, skv=45, h=2, hkv=1, d=64, dv=None, dtype=jnp.float32, blocks=(32, 16),
         mask_batch=1, mask_heads=None, sinks=0, segments=False, vmap=False, config=SMALL_TILES, hopper=False,
         sms=None, **kw):
    """`hopper`: compile as for sm_90, where a config asking for it takes the TMA forward (`_fwd_tma_kernel`);
    `sms`: the SM count the persistent forward sizes its grid by (so each program loops over several items)."""
    decode_config.sm_count = (lambda: sms) if sms else _sm_count
    compile_for_hopper(hopper)
    KERNELS_RUN.clear()
    dv = dv or d
    ks = jax.random.split(jax.random.key(seed), 5)
    lead = (2,) if vmap else ()
    q, k, v = random_qkv(ks, lead=lead, b=b, sq=sq, skv=skv, h=h, hkv=hkv, d=d, dv=dv, dtype=dtype)
    mask = random_block_mask(seed, mask_batch, h if mask_heads is None else mask_heads, sq, skv, *blocks)
    static = dict(block_mask=mask, block_size=blocks, **kw)
    extra = {}
    if sinks:
        extra["softmax_aux"] = jax.random.normal(ks[3], (h, sinks), jnp.float32)
    if segments:
        rng = np.random.default_rng(seed)
        seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, sq)), axis=1), jnp.int32)
        extra.update(q_segment_ids=seg, kv_segment_ids=seg)

    def triton(q, k, v, aux, block_mask):
        args = dict(extra, softmax_aux=aux) if sinks else extra
        call = BlockSparseAttention().validate(q, k, v, **args, **dict(static, block_mask=block_mask))
        return IMPLEMENTATION(call, config or IMPLEMENTATION.heuristic_config(call))

    def reference(q, k, v, aux, block_mask):
        del block_mask  # the reference expands the concrete mask of `static`
        args = dict(extra, softmax_aux=aux) if sinks else dict(extra)
        args = {n: (a.astype(jnp.float64) if n == "softmax_aux" else a) for n, a in args.items()}
        return reference_blocksparse_attention(q.astype(jnp.float64), k.astype(jnp.float64),
                                               v.astype(jnp.float64), **args, **static)

    def forward_and_vjp(fn, q, k, v, aux, d_out, block_mask):
        # One jit per side, the mask a traced argument: a handful of XLA compiles instead of one per eager op.
        if vmap:
            fn = jax.vmap(fn, (0, 0, 0, None, None))
        out, pullback = jax.vjp(lambda q, k, v, aux: fn(q, k, v, aux, block_mask), q, k, v, aux)
        return (out, *pullback(d_out.astype(out.dtype)))

    aux = extra.get("softmax_aux", jnp.zeros((h, 1), jnp.float32))
    start = time.time()
    out_shape = (*lead, b, sq, h, dv)
    d_out = jax.random.normal(ks[4], out_shape, jnp.float32).astype(dtype)
    out, dq, dk, dv_, d_aux = jax.jit(lambda *a: forward_and_vjp(triton, *a))(q, k, v, aux, d_out, mask)
    ref, rdq, rdk, rdv, rd_aux = jax.jit(lambda *a: forward_and_vjp(reference, *a))(
        q, k, v, aux.astype(jnp.float64), d_out.astype(jnp.float64), mask)
    row = dict(name=name, dtype=jnp.dtype(dtype).name, out=relative_error(out, ref), dq=relative_error(dq, rdq), dk=relative_error(dk, rdk),
               dv=relative_error(dv_, rdv), d_aux=relative_error(d_aux, rd_aux) if sinks else 0.0,
               finite=bool(all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in (out, dq, dk, dv_))),
               seconds=round(time.time() - start, 2), kernels=sorted(set(KERNELS_RUN)))
    if not vmap and not segments and mask_batch == 1:
        # The suite's mask turns one whole mask row off: its outputs and query gradients are exact zeros.
        r0 = (mask.shape[2] // 2) * blocks[0]
        rows = slice(r0, r0 + blocks[0])
        row["masked_rows_zero"] = bool(np.all(np.asarray(out[:, rows]) == 0) and np.all(np.asarray(dq[:, rows]) == 0))
    print(json.dumps(row), flush=True)


CASES = {
    # per-head mask, GQA 2:1, causal, two sinks, ragged tails on both axes, mask blocks of 2 and 1 kernel tiles
    "gqa_causal_sinks_ragged": dict(seed=1, sinks=2, causal=True),
    # rectangular, non-causal, shared mask, v head dim 128, fp16, mask blocks of 1 x 2 kernel tiles
    "rect_noncausal_fp16": dict(seed=2, b=2, sq=20, skv=50, h=2, hkv=2, dv=128, dtype=jnp.float16, blocks=(16, 32),
                                mask_heads=1, causal=False),
    # sliding window + soft cap + scale + segment ids + one sink, the heuristic config (fp32: 32-blocks -> 16),
    # under vmap over q/k/v with a per-batch mask (the vmapped axis folds into the batch: schedule b % mask_batch)
    "window_softcap_segments_vmap": dict(seed=3, b=2, sq=40, skv=40, blocks=(16, 16), sinks=1, segments=True,
                                         causal=True, sliding_window=(7, 2), logits_soft_cap=5.0, softmax_scale=0.3,
                                         config=None, mask_batch=2, vmap=True),
    # the opt-in TMA forward on a call whose visited blocks are all full (non-causal, lengths multiples of the
    # blocks): fp16, D=128, GQA, per-head mask, a sink, soft cap; 16-row q tiles, 32-key tiles, 2 per block
    "hopper_tma_forward": dict(seed=5, b=1, sq=64, skv=128, h=2, hkv=1, d=128, dtype=jnp.float16, blocks=(32, 64),
                               sinks=1, causal=False, logits_soft_cap=20.0, hopper=True,
                               config=TritonBlockSparseConfig(16, 32, 4, 2, 16, 16, 16, 16, 4, 1, tma_forward=True)),
    # the persistent TMA forward: one program (sms=1) loops over the 2 x 2 x 4 items; otherwise as above
    "hopper_tma_persistent_forward": dict(
        seed=7, b=2, sq=64, skv=128, h=2, hkv=1, d=128, dtype=jnp.float16, blocks=(32, 64), sinks=1, causal=False,
        logits_soft_cap=20.0, hopper=True, sms=1,
        config=TritonBlockSparseConfig(16, 32, 4, 2, 16, 16, 16, 16, 4, 1, tma_forward=True, persistent_forward=1)),
    # the persistent pointer forward: 3 programs (sms=3 x 1 per SM) loop over 2 x 2 x 3 (batch, head, tile)
    # items longest row first; causal + GQA + per-head mask + a sink + ragged tails
    "persistent_forward": dict(seed=6, b=2, sinks=1, causal=True, sms=3,
                               config=dataclasses.replace(SMALL_TILES, persistent_forward=1)),
}

if __name__ == "__main__":
    for case_name, params in CASES.items():
        case(case_name, **params)
