"""Numerics of the Triton decode kernels through Triton's interpreter, on the host (run by test_decode.py).

TRITON_INTERPRET=1 must be set before triton is imported, so these cases run in a process of their own.
Each case runs ``page_attention`` or ``ragged_decode_attention`` with ``platform="triton"`` and an explicit
``TritonDecodeConfig`` (one split, or several merged by the combine kernel) on a fresh random problem,
compares with the float64 reference of ``ejkernel.testing``, and prints one JSON line.
"""

from __future__ import annotations

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

from ejkernel.modules import page_attention, ragged_decode_attention  # noqa: E402
from ejkernel.testing.numerics import normal_array, relative_error  # noqa: E402
from ejkernel.testing.page_attention import random_block_tables, reference_page_attention, sinks_for  # noqa: E402
from ejkernel.testing.quantized_cache import quantized_cache  # noqa: E402
from ejkernel.testing.ragged_decode_attention import reference_ragged_decode_attention  # noqa: E402
from ejkernel_triton.decode import TritonDecodeConfig  # noqa: E402
from interpreter_support import gradient_outcome, print_row  # noqa: E402


def _f64(x):
    return x.astype(jnp.float64) if x is not None and jnp.issubdtype(x.dtype, jnp.floating) else x


def paged_case(seed, *, heads, kv_heads, dim, page_size, max_pages, lengths, dtype, config, vmap=False,
               quantized=None, **kw):
    """``quantized``: (cache dtype, "head" or "page"): the caches quantized (:func:`quantized_cache`), their
    scales passed to both the kernel and the reference."""
    num_seqs = len(lengths)
    num_pages = num_seqs * max_pages + 3
    lengths = np.asarray(lengths, np.int32)
    inputs = dict(
        query=normal_array(seed, (num_seqs, heads, dim), dtype, 2.0),
        key_cache=normal_array(seed + 1, (num_pages, kv_heads, page_size, dim), dtype),
        value_cache=normal_array(seed + 2, (num_pages, kv_heads, page_size, dim), dtype),
        context_lens=jnp.asarray(lengths),
        # entries past each sequence's last page are -1 (never read)
        block_tables=jnp.asarray(random_block_tables(seed, num_seqs, max_pages, num_pages, lengths, page_size)),
    )
    if quantized is not None:
        shape = inputs["key_cache"].shape
        cache_dtype, scale_kind = quantized
        scale_shape = {"head": shape[1:2], "page": shape[:2]}[scale_kind]
        inputs["key_cache"], kw["key_scale"] = quantized_cache(seed + 1, shape, cache_dtype, scale_shape)
        inputs["value_cache"], kw["value_scale"] = quantized_cache(seed + 2, shape, cache_dtype, scale_shape)
    ours = lambda **a: page_attention(**a, platform="triton", cfg=config, **kw)  # noqa: E731
    reference = jax.jit(functools.partial(reference_page_attention, **kw))  # one compilation, not one per primitive
    if vmap:  # a stack of query sets over one cache
        queries = jnp.stack([inputs["query"], inputs["query"][::-1] * 0.5])
        out = jax.vmap(lambda q: ours(**{**inputs, "query": q}))(queries)
        ref = jnp.stack([reference(**{k: _f64(v) for k, v in {**inputs, "query": q}.items()}) for q in queries])
    else:
        out = ours(**inputs)
        ref = reference(**{k: _f64(v) for k, v in inputs.items()})
    empty = lengths == 0 if not vmap else None
    return out, ref, empty, lambda: jax.grad(lambda q: ours(**{**inputs, "query": q}).astype(jnp.float32).sum())(
        inputs["query"])


def ragged_case(seed, *, heads, kv_heads, dim, seq_len, ranges, dtype, config, num_sinks=None, quantized=None, **kw):
    """``quantized``: the buffers' dtype; they are quantized with one scale per kv head (:func:`quantized_cache`)."""
    batch = len(ranges)
    inputs = dict(
        query=normal_array(seed, (batch, heads, dim), dtype, 2.0),
        key=normal_array(seed + 1, (batch, seq_len, kv_heads, dim), dtype),
        value=normal_array(seed + 2, (batch, seq_len, kv_heads, dim), dtype),
        sequence_start=jnp.asarray([s for s, _ in ranges], jnp.int32),
        sequence_end=jnp.asarray([e for _, e in ranges], jnp.int32),
        softmax_aux=sinks_for(seed + 3, heads, num_sinks),
    )
    if quantized is not None:
        shape = inputs["key"].shape
        inputs["key"], kw["key_scale"] = quantized_cache(seed + 1, shape, quantized, (kv_heads,))
        inputs["value"], kw["value_scale"] = quantized_cache(seed + 2, shape, quantized, (kv_heads,))
    out = ragged_decode_attention(**inputs, platform="triton", cfg=config, **kw)
    ref = jax.jit(functools.partial(reference_ragged_decode_attention, **kw))(**{k: _f64(v) for k, v in inputs.items()})
    window = kw.get("sliding_window")
    empty = np.asarray([max(s, e - 1 - window[0] if window else s) >= e for s, e in ranges])
    return out, ref, empty, None


SPLITS = TritonDecodeConfig(block_n=16, num_splits=3, prefetch=1)
ONE_PASS = TritonDecodeConfig(block_n=16, num_splits=1, prefetch=2)
INLINE = TritonDecodeConfig(block_n=16, num_splits=3, prefetch=1, inline_combine=True)  # the last split merges

CASES = {
    # pages of 16 = one block-table entry per step; contexts 0 and 1, a partial last page, three splits
    "paged_gqa4_splits": (paged_case, dict(seed=1, heads=8, kv_heads=2, dim=32, page_size=16, max_pages=5,
                                           lengths=[0, 79, 1, 16], dtype=jnp.float32, config=SPLITS)),
    "paged_gqa4_inline_combine": (paged_case, dict(seed=7, heads=8, kv_heads=2, dim=32, page_size=16, max_pages=5,
                                                   lengths=[0, 79, 1, 33], dtype=jnp.float32, config=INLINE)),
    # pages of 12 (neither a power of two nor a multiple of the step): per-row page lookup, one pass
    "paged_odd_pages_group8_one_pass": (paged_case, dict(seed=2, heads=8, kv_heads=1, dim=24, page_size=12,
                                                         max_pages=4, lengths=[37, 12, 1, 0], dtype=jnp.float32,
                                                         config=ONE_PASS)),
    # pages of 8 (several per step), MQA, fp16, soft cap, scale and max_context_len
    "paged_mqa_fp16_softcap_max_len": (paged_case, dict(seed=3, heads=4, kv_heads=1, dim=16, page_size=8,
                                                        max_pages=8, lengths=[61, 5, 40], dtype=jnp.float16,
                                                        config=SPLITS, attn_scale=0.3, attn_logits_soft_cap=5.0,
                                                        max_context_len=50)),
    # an int8 cache dequantized per (page, kv head), pages of 12 (per-row lookups of the scales too), splits
    "paged_int8_page_scales_splits": (paged_case, dict(seed=8, heads=8, kv_heads=2, dim=32, page_size=12,
                                                       max_pages=6, lengths=[70, 1, 0, 25], dtype=jnp.float32,
                                                       config=SPLITS, quantized=("int8", "page"))),
    # an int8 cache with one scale per kv head, pages of 16 (one table entry per step), soft cap
    "paged_int8_head_scales_softcap": (paged_case, dict(seed=9, heads=4, kv_heads=2, dim=16, page_size=16,
                                                        max_pages=4, lengths=[64, 17], dtype=jnp.float16,
                                                        config=ONE_PASS, quantized=("int8", "head"),
                                                        attn_logits_soft_cap=3.0)),
    "paged_mha_vmap": (paged_case, dict(seed=4, heads=2, kv_heads=2, dim=32, page_size=16, max_pages=3,
                                        lengths=[33, 20], dtype=jnp.float32, config=SPLITS, vmap=True)),
    # window (only its left side hides keys), sinks, soft cap; empty ranges give zeros
    "ragged_gqa_window_sinks_splits": (ragged_case, dict(seed=5, heads=8, kv_heads=2, dim=32, seq_len=45,
                                                         ranges=[(0, 45), (3, 20), (17, 18), (30, 30)],
                                                         dtype=jnp.float32, config=SPLITS, num_sinks=2,
                                                         sliding_window=(20, 0), logit_soft_cap=4.0,
                                                         softmax_scale=0.3)),
    # an int8 buffer with one scale per kv head, window and sinks, splits
    "ragged_int8_head_scales_window_splits": (ragged_case, dict(seed=10, heads=8, kv_heads=2, dim=32, seq_len=45,
                                                                ranges=[(0, 45), (3, 20), (30, 30)],
                                                                dtype=jnp.float32, config=SPLITS, num_sinks=1,
                                                                sliding_window=(20, 0), quantized="int8")),
    "ragged_mha_odd_dim_fp16_one_pass": (ragged_case, dict(seed=6, heads=3, kv_heads=3, dim=17, seq_len=40,
                                                           ranges=[(0, 1), (5, 40), (25, 25)], dtype=jnp.float16,
                                                           config=ONE_PASS, num_sinks=0)),
}


def run(name):
    fn, kwargs = CASES[name]
    t0 = time.time()
    out, ref, empty, grad = fn(**kwargs)
    row = dict(name=name, dtype=jnp.dtype(kwargs["dtype"]).name, out=relative_error(out, ref),
               finite=bool(np.all(np.isfinite(np.asarray(out, np.float64)))))
    if empty is not None and empty.any():
        row["empty_rows_zero"] = bool(np.all(np.asarray(out)[empty] == 0))
    if grad is not None:
        row["gradient"] = gradient_outcome(grad)
    print_row(row, t0)


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        run(name)
