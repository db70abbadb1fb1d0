"""Where a 2-GPU causal ring's forward spends its time beyond the kernels (issue #13), on one GPU: each
step of rank r of a zig-zag ring at S=64k (local 32k tokens, 16 heads, D=128, bf16) timed alone, with
and without the schedule's plumbing (branch, padding, log-sum-exp merge)."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import time_calls  # noqa: E402

from ejkernel.modules.operations import _ring_schedule as rs  # noqa: E402
from ejkernel_cuda.ring_attention import CudnnRingBlocks  # noqa: E402

S = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
L, H, D = S // 2, 16, 128
h = L // 2
keys = jax.random.split(jax.random.key(0), 6)
q, k, v = (jax.random.normal(kk, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for kk in keys[:3])
blocks = CudnnRingBlocks(D ** -0.5)


def t(name, fn, *args):
    f = jax.jit(fn)
    ms = time_calls(lambda c: f(*args), 2, 7, 10) * 1e3
    print(f"{name:55s} {ms:8.3f} ms", flush=True)
    return ms


t("diag  q32k x kv32k causal (cudnn)", lambda q, k, v: blocks.forward(q, k, v, None, None, True), q, k, v)
t("full  q32k x kv32k", lambda q, k, v: blocks.forward(q, k, v, None, None, False), q, k, v)
t("first-kv-half q32k x kv16k", lambda q, k, v: blocks.forward(q, k[:, :h], v[:, :h], None, None, False), q, k, v)
t("second-q-half q16k x kv32k", lambda q, k, v: blocks.forward(q[:, h:], k, v, None, None, False), q, k, v)
for kind, name in ((rs.FULL_FIRST_KV_HALF, "first-kv-half"), (rs.FULL_SECOND_Q_HALF, "second-q-half")):
    t(f"_forward_step {name} (padding, f32)", functools.partial(rs._forward_step, blocks, kind), q, k, v, None, None)
o0, l0 = jax.jit(lambda q, k, v: blocks.forward(q, k, v, None, None, True))(q, k, v)
o1, l1 = jax.jit(functools.partial(rs._forward_step, blocks, rs.FULL_FIRST_KV_HALF))(q, k, v, None, None)
t("merge (f32 out) + cast", lambda a, b, c, d: rs._merge(a.astype(jnp.float32), b, c, d)[0].astype(jnp.bfloat16),
  o0, l0, o1, l1)


def two_steps(q, k, v, k2, v2, idx):
    out, lse = rs._forward_step(blocks, rs.DIAGONAL, q, k, v, None, None)
    branches = [functools.partial(rs._forward_step, blocks, kind) for kind in rs._visitor_kinds(True, "zigzag")]
    so, sl = lax.switch(idx, branches, q, k2, v2, None, None)
    out, lse = rs._merge(out, lse, so, sl)
    return out.astype(q.dtype), lse


k2, v2 = (jax.random.normal(kk, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for kk in keys[3:5])
for idx in (0, 1):
    t(f"both steps, switch index {idx} (no communication)", two_steps, q, k, v, k2, v2, jnp.int32(idx))
