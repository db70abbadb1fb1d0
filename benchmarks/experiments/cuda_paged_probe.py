"""The prefill part of the mixed batch (``decode.py``'s ``MIXED``: 4 chunks of 512 new tokens over 4096-token
contexts, 32 q / 8 kv heads, D = 128, bf16, pages of 64 shuffled over the cache) on ejkernel-cuda's paged
forward, beside the same attention on the dense native forward (contiguous [4, 4096, 8, 128] K/V, causal
bottom-right: the work without the pages) and the Triton paged path, in one process.

    python3 benchmarks/experiments/cuda_paged_probe.py [--library path/to/libejkernel_cuda.so] [--impls ...]

``--library`` as in ``cuda_flash_probe.py`` (A/B of builds: one process per library). Prints one JSON line per
measurement (microseconds, TFLOP/s of the causal pairs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import time_calls  # noqa: E402
from decode import MIXED, mixed_inputs  # noqa: E402

ARGUMENTS = ("queries", "kv_pages", "context_lens", "block_tables", "query_start_loc", "num_seqs")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--library", default="")
    p.add_argument("--impls", default="cuda-paged,cuda-dense,triton-paged")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args()
    if args.library:
        from ejkernel_cuda import _native

        _native.LIBRARY_PATH = Path(args.library)
    os.environ.setdefault("EJKERNEL_UNVERIFIED_KERNELS", "1")
    from ejkernel.modules import ragged_page_attention
    from ejkernel_cuda import native_flash

    seqs, new, context, heads, kv_heads, d = MIXED["prefills"], MIXED["prefill_len"], MIXED["context"], 32, 8, 128
    scale = 1 / math.sqrt(d)
    sets = [mixed_inputs(jax.random.key(i), [(new, context)] * seqs, heads, kv_heads, d, args.page_size,
                         jnp.bfloat16, i) for i in range(3)]
    pairs = seqs * heads * (new * (context - new) + new * (new + 1) // 2)
    impls = {
        "cuda-paged": (lambda x: ragged_page_attention(*(x[n] for n in ARGUMENTS), softmax_scale=scale,
                                                       platform="cuda"), [x for x, _ in sets]),
        "triton-paged": (lambda x: ragged_page_attention(*(x[n] for n in ARGUMENTS), softmax_scale=scale,
                                                         platform="triton"), [x for x, _ in sets]),
        "cuda-dense": (lambda x: native_flash.attention(x[0], x[1], x[2], scale, True, None, None),
                       [(q.reshape(seqs, new, heads, d), k, v) for _, (q, k, v, _, _) in sets]),
    }
    for name in args.impls.split(","):
        fn, inputs = impls[name]
        step = jax.jit(fn)
        seconds = time_calls(lambda c: step(inputs[c % len(inputs)]), 3, args.reps, 5)
        row = dict(impl=name, library=args.library or "installed", us=seconds * 1e6,
                   tflops=4 * pairs * d / seconds / 1e12)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
