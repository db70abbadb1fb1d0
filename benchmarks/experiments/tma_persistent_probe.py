"""Which masks make the persistent TMA block-sparse forward hang (issue #12)? Each probe runs in its own
subprocess under a timeout, forward only, and prints `probe <name>: ok <error> | HANG | FAIL`.

    python3 benchmarks/experiments/tma_persistent_probe.py            # every probe
    python3 benchmarks/experiments/tma_persistent_probe.py one <name>  # one probe, in this process

Shape: B=2, S=2048, 8 heads / 2 kv heads, D=128, bf16, 128-blocks (16 x 16 per head), non-causal; rows of
the mask visit at least `min_visits` blocks (0: some rows visit none), random otherwise; `programs`: the
persistent grid's programs per SM (1: 132 programs over 256 items, some take two).
"""

from __future__ import annotations

import subprocess
import sys

PROBES = {
    # name: (min_visits, max_visits, single_item)
    "rows-ge-2": (2, 16, False),
    "rows-eq-1": (1, 1, False),
    "rows-1-or-2": (1, 2, False),
    "rows-0-some": (0, 16, False),
    "rows-0-some-one-item-kernel": (0, 16, True),
    "rows-ge-2-odd-trips": (3, 3, False),
}


def one(name: str) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ejkernel.modules import blocksparse_attention
    from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention
    from ejkernel_triton.blocksparse_attention import IMPLEMENTATION, tma_forward_applies

    low, high, single = PROBES[name]
    b, s, h, hkv, d, n = 2, 2048, 8, 2, 128, 16
    rng = np.random.default_rng(0)
    mask = np.zeros((b, h, n, n), bool)
    for idx in np.ndindex(b, h, n):
        count = rng.integers(low, high + 1)
        if low == 0 and idx[2] == n // 2:
            count = 0
        mask[idx][rng.choice(n, size=count, replace=False)] = True
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    kw = dict(block_mask=jnp.asarray(mask), block_size=128, causal=False)
    call = BlockSparseAttention().validate(q, k, v, **kw)
    cfg = dataclasses.replace(IMPLEMENTATION.heuristic_config(call), fwd_block_q=128, fwd_block_kv=128,
                              fwd_num_warps=4, fwd_num_stages=2, tma_forward=True,
                              persistent_forward=0 if single else 1)
    assert tma_forward_applies(call, cfg)
    got = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, platform="triton", cfg=cfg, **kw))(q, k, v)
    ref = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, platform="xla", **kw))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    print(f"relative error {np.linalg.norm(got - ref) / np.linalg.norm(ref):.2e}", flush=True)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "one":
        one(sys.argv[2])
        return 0
    for name in PROBES:
        try:
            done = subprocess.run([sys.executable, __file__, "one", name], capture_output=True, text=True,
                                  timeout=45)
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            print(f"probe {name}: {'ok' if done.returncode == 0 else 'FAIL'} {tail[0][:200]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"probe {name}: HANG (45 s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
