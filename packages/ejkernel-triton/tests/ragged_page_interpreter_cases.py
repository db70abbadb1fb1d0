"""Numerics of Triton ``ragged_page_attention`` through Triton's interpreter, on the host (run by
test_ragged_page_attention.py in a subprocess: TRITON_INTERPRET=1 must be set before triton is imported).

Each case builds a mixed batch with the shared suite's ``make_inputs`` (decode rows, prefill chunks, empty and
inactive slots, padding rows, random block tables whose unused tail entries are -1), runs it with an explicit
small ``TritonRaggedPageConfig``, compares with the float64 reference of ``ejkernel.testing``, and prints one
JSON line.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ejkernel.modules import ragged_page_attention  # noqa: E402
from ejkernel.testing.ragged_page_attention import (  # noqa: E402
    RaggedPageAttentionConformance,
    reference_ragged_page_attention,
)
from ejkernel_triton.ragged_page_attention import TritonRaggedPageConfig  # noqa: E402
from ejkernel.testing.numerics import relative_error  # noqa: E402
from ejkernel.testing.quantized_cache import quantized_cache  # noqa: E402
from interpreter_support import gradient_outcome, print_row  # noqa: E402

# small tiles: several prefill tiles per sequence and several key steps; decode with three splits
SMALL = TritonRaggedPageConfig(block_m=16, block_n=16, num_warps=4, prefetch=1, decode_block_n=16,
                               decode_num_splits=3, decode_prefetch=1)
# one launch for the decode programs and the prefill tiles (with one split, and with three + the combine pass)
ONE_PASS_FUSED = TritonRaggedPageConfig(block_m=32, block_n=16, num_warps=4, prefetch=1, decode_block_n=16,
                                        decode_num_splits=1, decode_prefetch=1, fused=True)
# one launch in all, decode and prefill programs alternating in the grid
SMALL_FUSED = dataclasses.replace(SMALL, fused=True, decode_inline_combine=True, interleave=True)

# (num_q_heads, num_kv_heads, head_dim, page_size, [(q_len, kv_len) per active sequence], inactive, padding)
CASES = {
    # GQA 4, pages of 16 (one table entry per step): decode rows over contexts 1 and 40, a chunk of 20 over 37,
    # an empty sequence (q_len 0) with cached keys, a full prefill; one inactive slot, padding rows
    "gqa4_pages16_mixed": (dict(shape=(8, 2, 32, 16, [(1, 40), (20, 37), (0, 9), (1, 1), (18, 18)], 1, 3),
                                dtype=jnp.float32, config=SMALL, gradient=True), {}),
    # pages of 12 (per-row lookups), MHA (group 1), window, soft cap, sinks, scale
    "mha_pages12_window_softcap_sinks": (dict(shape=(2, 2, 16, 12, [(1, 50), (9, 30), (1, 7), (13, 13)], 0, 2),
                                              dtype=jnp.float32, config=ONE_PASS_FUSED, num_sinks=2, scale=3.0),
                                         dict(sliding_window=10, logits_soft_cap=5.0, softmax_scale=0.4)),
    # MQA with group 8 (tile rows = 2 tokens x 8 heads), pages of 8 (several per step), fp16, window + splits
    "mqa_group8_pages8_fp16": (dict(shape=(8, 1, 24, 8, [(1, 33), (5, 21), (1, 64)], 1, 0), dtype=jnp.float16,
                                    config=SMALL_FUSED), dict(sliding_window=20)),
    # int8 pages with per-page scales (keys and values their own), decode rows and prefill chunks in one launch;
    # and per-kv-head scales through the separate launches (float8 does not run in the interpreter)
    "int8_page_scales_fused": (dict(shape=(4, 2, 32, 16, [(1, 40), (20, 37), (1, 5)], 1, 2), dtype=jnp.float32,
                                    config=SMALL_FUSED, quantized=("int8", "page")), {}),
    "int8_head_scales_window": (dict(shape=(4, 2, 32, 8, [(1, 30), (9, 26)], 0, 1), dtype=jnp.float16,
                                     config=SMALL, quantized=("int8", "head")), dict(sliding_window=12)),
}


def run(name):
    spec, static = CASES[name]
    t0 = time.time()
    suite = RaggedPageAttentionConformance()
    inputs = suite.make_inputs(len(name), spec["shape"], spec["dtype"], scale=spec.get("scale", 1.0),
                               num_sinks=spec.get("num_sinks"))
    if spec.get("quantized"):
        cache_dtype, kind = spec["quantized"]
        shape = inputs["kv_pages"].shape
        scale_shape = {"head": (shape[2] // 2,), "page": (shape[0], shape[2] // 2)}[kind]
        inputs["kv_pages"], key_scale = quantized_cache(len(name) + 1, shape, cache_dtype, scale_shape)
        _, value_scale = quantized_cache(len(name) + 2, shape, cache_dtype, scale_shape)
        static = dict(static, key_scale=key_scale, value_scale=value_scale)
    out = ragged_page_attention(*inputs.values(), platform="triton", cfg=spec["config"], **static)
    f64 = {k: v.astype(jnp.float64) if v is not None and jnp.issubdtype(v.dtype, jnp.floating) else v
           for k, v in inputs.items()}
    static64 = {k: v.astype(jnp.float64) if isinstance(v, jax.Array) else v for k, v in static.items()}
    ref = jax.jit(functools.partial(reference_ragged_page_attention, **static64))(*f64.values())  # one compilation
    used = int(inputs["query_start_loc"][int(inputs["num_seqs"][0])])
    row = dict(name=name, dtype=jnp.dtype(spec["dtype"]).name, out=relative_error(out, ref),
               finite=bool(np.all(np.isfinite(np.asarray(out, np.float64)))),
               padding_zero=bool(np.all(np.asarray(out)[used:] == 0)))
    if spec.get("gradient"):
        row["gradient"] = gradient_outcome(lambda: jax.grad(
            lambda q: ragged_page_attention(q, *list(inputs.values())[1:], platform="triton", cfg=spec["config"],
                                            **static).astype(jnp.float32).sum())(inputs["queries"]))
    print_row(row, t0)


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        run(name)
