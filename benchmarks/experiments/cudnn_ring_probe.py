"""Probe (issue #13): can cuDNN's fused attention serve as ring blocks? Checks on one GPU that
``return_residual`` gives the natural-log LSE of the scaled logits [B, N, T], that the backward primitive
taken with the *merged* output/LSE of two key halves gives the exact full-attention gradients, that both work
under ``shard_map``, and times cuDNN against ours at the issue's shapes."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa

B, S, H, HK, D = 1, 1024, 4, 2, 128
scale = D ** -0.5
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, S, H, D), jnp.bfloat16)
k = jax.random.normal(ks[1], (B, S, HK, D), jnp.bfloat16)
v = jax.random.normal(ks[2], (B, S, HK, D), jnp.bfloat16)
do = jax.random.normal(ks[3], (B, S, H, D), jnp.bfloat16)
version = fa.check_cudnn_version()
print("cudnn", version)


def ref(q, k, v, causal):
    kr = jnp.repeat(k.astype(jnp.float32), H // HK, axis=2)
    vr = jnp.repeat(v.astype(jnp.float32), H // HK, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), vr), lse


def fwd(q, k, v, causal):
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, return_residual=True)


def bwd(q, k, v, out, lse, d_out, causal):
    empty = jnp.zeros(0, q.dtype)
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return tuple(fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, empty, empty, empty, empty, empty, empty, empty, lse, out, d_out,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None))


for causal in (False, True):
    out, lse = jax.jit(fwd, static_argnums=3)(q, k, v, causal)
    want, want_lse = ref(q, k, v, causal)
    print("causal", causal, "lse shape", lse.shape, lse.dtype, "lse err", float(jnp.max(jnp.abs(lse - want_lse))),
          "lse/log2 err", float(jnp.max(jnp.abs(lse * np.log(2) - want_lse))),
          "out err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))))

# two key halves merged, then backward from the merged out/lse
h = S // 2
o1, l1 = jax.jit(fwd, static_argnums=3)(q, k[:, :h], v[:, :h], False)
o2, l2 = jax.jit(fwd, static_argnums=3)(q, k[:, h:], v[:, h:], False)
lse = jnp.logaddexp(l1, l2)
w = lambda l: jnp.moveaxis(jnp.exp(l - lse), 1, 2)[..., None]  # noqa: E731
out = (o1.astype(jnp.float32) * w(l1) + o2.astype(jnp.float32) * w(l2)).astype(q.dtype)
g1 = jax.jit(bwd, static_argnums=6)(q, k[:, :h], v[:, :h], out, lse, do, False)
g2 = jax.jit(bwd, static_argnums=6)(q, k[:, h:], v[:, h:], out, lse, do, False)
dq = g1[0].astype(jnp.float32) + g2[0].astype(jnp.float32)
dk = jnp.concatenate([g1[1], g2[1]], 1).astype(jnp.float32)
dv = jnp.concatenate([g1[2], g2[2]], 1).astype(jnp.float32)
_, pull = jax.vjp(lambda q, k, v: ref(q, k, v, False)[0], q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
wdq, wdk, wdv = pull(do.astype(jnp.float32))
for n, a, b in (("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
    print("merged-halves", n, "max err", float(jnp.max(jnp.abs(a - b))), "scale", float(jnp.max(jnp.abs(b))))

# under shard_map (one device)
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
f = jax.jit(jax.shard_map(lambda q, k, v: fwd(q, k, v, True), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                          out_specs=(P(None, "sp"), P(None, None, "sp"))))
o, l = f(q, k, v)
print("shard_map fwd ok", float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref(q, k, v, True)[0]))))
g = jax.jit(jax.shard_map(lambda *a: bwd(*a, True), mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(None, "sp"), P(None, None, "sp"), P(None, "sp")),
                          out_specs=(P(None, "sp"),) * 3))(q, k, v, o, l, do)
print("shard_map bwd ok", [x.shape for x in g])

# timing at the shapes: cuDNN vs ejkernel's best (if installed)
def bench(fn, *args, n=10):
    fn(*args)[0].block_until_ready()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(fn(*args)); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3

for S2 in (32768, 65536):
    qs = [jax.random.normal(kk, (1, S2, 16, 128), jnp.bfloat16) for kk in jax.random.split(jax.random.key(1), 3)]
    for causal in (False, True):
        f1 = jax.jit(lambda q, k, v: fwd(q, k, v, causal))
        print(f"S={S2} causal={causal} cudnn fwd+lse {bench(f1, *qs):.2f} ms")
