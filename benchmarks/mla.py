"""multi_head_latent_attention (DeepSeek MLA): every ejkernel platform registered for it on this machine's
device and usable here against a plain-JAX einsum reference (up-project the latent, dense softmax attention),
forward and forward+backward.

    python3 benchmarks/mla.py                        # the standard shapes on this machine's device
    python3 benchmarks/mla.py --quick                # tiny shapes: a smoke run (CPU, seconds)
    bash scripts/device/run.sh python3 benchmarks/mla.py --out $OUT   # on the device

Shapes: DeepSeek-V2-Lite's attention (hidden 2048): 16 heads, ``kv_lora_rank`` 512, ``head_dim``
(qk_nope) 128, ``rope_dim`` (qk_rope) 64, ``v_head_dim`` 128, as many kv heads as heads (``w_kc`` [512, 16,
128], ``w_vc`` [512, 16, 128]), ``b_q`` per head [B, S, 16, 64], ``b_k`` shared [B, S, 64]; 16384 tokens
(batch = 16384 / S) at S = 2048 and 8192, causal and not, bf16; inputs fresh random values of unit scale
(``w_kc``, ``w_vc`` ~ N(0, 1/512)). Columns: ``ejkernel-<platform>``; ``jax-einsum``: keys and values
up-projected (``key_value @ w_kc``, ``@ w_vc``), float32 logits ``(q·k + b_q·b_k) / sqrt(192)``, softmax, ``P
@ v`` (O(S²) memory: at S = 8192 the float32 logits are 8 GiB). ``jax.nn.dot_product_attention`` is no peer
here: it needs one head width for q, k and v (192 / 192 / 128). TFLOP/s: forward 2·B·S·rank·H·(D + Dv) (the
up-projections) + 2·B·H·S²·(D + R + Dv) (½ causal), forward+backward 3× the first + 3.5× the second.
Timing as ``_harness.time_calls`` (jit, warm-up, median of ``--reps`` samples of ``--calls`` back-to-back
calls over rotating fresh inputs). Numerics at ``--errors``: relative L2 error of the output and the six
inputs' gradients against the float32 einsum reference. Writes ``<device>-<date>-mla`` .json (after every
row) and .png into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

OPERATIONS = ("multi_head_latent_attention",)  # the ops this script benchmarks (tests/ reads it)
GRADIENTS = ("out", "dq", "dkv", "dw_kc", "dw_vc", "db_q", "db_k")
DEEPSEEK_V2_LITE = dict(heads=16, rank=512, head_dim=128, rope_dim=64, v_head_dim=128)
QUICK = dict(heads=2, rank=32, head_dim=16, rope_dim=8, v_head_dim=16)


def einsum_mla(q, kv, w_kc, w_vc, b_q, b_k, causal):
    """Plain-JAX MLA (one kv head per head): up-project, float32 logits and softmax, ``P @ v``."""
    f32 = jnp.float32
    keys = jnp.einsum("bsr,rhd->bshd", kv, w_kc, preferred_element_type=f32).astype(q.dtype)
    values = jnp.einsum("bsr,rhd->bshd", kv, w_vc, preferred_element_type=f32).astype(q.dtype)
    logits = (jnp.einsum("bqhd,bkhd->bhqk", q, keys, preferred_element_type=f32)
              + jnp.einsum("bqhr,bkr->bhqk", b_q, b_k, preferred_element_type=f32))
    logits = logits / np.sqrt(q.shape[-1] + b_k.shape[-1])
    if causal:
        seq = q.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, values, preferred_element_type=f32).astype(q.dtype)


def random_inputs(seed: int, batch: int, seq: int, shape: dict, dtype, sets: int) -> list[tuple]:
    """``sets`` tuples (query, key_value, w_kc, w_vc, b_q, b_k, d_out) of fresh random values."""
    heads, rank, d, r, dv = (shape[k] for k in ("heads", "rank", "head_dim", "rope_dim", "v_head_dim"))
    dims = [((batch, seq, heads, d), 1.0), ((batch, seq, rank), 1.0), ((rank, heads, d), rank ** -0.5),
            ((rank, heads, dv), rank ** -0.5), ((batch, seq, heads, r), 1.0), ((batch, seq, r), 1.0),
            ((batch, seq, heads, dv), 1.0)]
    out = []
    for s in range(sets):
        keys = jax.random.split(jax.random.key(seed * 1000 + s), len(dims))
        out.append(tuple((jax.random.normal(k, dim, jnp.float32) * scale).astype(dtype)
                         for k, (dim, scale) in zip(keys, dims)))
    return out


def columns() -> list[h.Column]:
    from ejkernel.modules import multi_head_latent_attention

    out = []
    for platform in h.usable_platforms("multi_head_latent_attention"):
        def attend(q, kv, w_kc, w_vc, b_q, b_k, causal, platform=platform):
            return multi_head_latent_attention(q, kv, w_kc, w_vc, b_q, b_k, causal=causal, platform=platform)

        out.append(h.Column(f"ejkernel-{platform}", attend))
    return out + [h.Column("jax-einsum", einsum_mla)]


def mla_flops(shape: dict, causal: bool, mode: str) -> float:
    b, s, heads = shape["batch"], shape["seq"], shape["heads"]
    projections = 2.0 * b * s * shape["rank"] * heads * (shape["head_dim"] + shape["v_head_dim"])
    attention = 2.0 * b * heads * s * s * (shape["head_dim"] + shape["rope_dim"] + shape["v_head_dim"])
    attention *= 0.5 if causal else 1.0
    return projections + attention if mode == "fwd" else 3.0 * projections + 3.5 * attention


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_common_args(p)
    h.add_sweep_args(p, seqs="2048,8192", errors="2048")
    args = h.parse(p, argv)
    dims = DEEPSEEK_V2_LITE
    if args.quick:
        args.seqs, args.errors, args.causal, args.tokens, dims = "32", "32", "yes", 64, QUICK
    dtype = jnp.dtype(args.dtype)
    rec = h.Recorder(args, "mla", tokens=args.tokens, **dims, kv_heads=dims["heads"], b_q="per head",
                     flops="fwd 2*B*S*rank*H*(D+Dv) + 2*B*H*S^2*(D+R+Dv) (x0.5 causal); fwd+bwd 3x + 3.5x")

    def inputs(seed, batch, seq):
        return random_inputs(seed, batch, seq, dims, dtype, args.sets)

    h.sweep(rec, args, dims, inputs, columns(), mla_flops, einsum_mla, GRADIENTS,
            f"multi_head_latent_attention {dims}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
