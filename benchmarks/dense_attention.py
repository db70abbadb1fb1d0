"""The dense attention operations, ``scaled_dot_product_attention`` and ``attention`` (which also returns the
attention weights): every ejkernel platform registered for each on this machine's device and usable here
against ``jax.nn.dot_product_attention`` (``implementation="xla"`` and, on a GPU, ``"cudnn"``) and, for
``attention``, a plain-JAX einsum + softmax that also returns the weights; forward and forward+backward.

    python3 benchmarks/dense_attention.py                   # the standard shapes on this machine's device
    python3 benchmarks/dense_attention.py --quick           # tiny shapes: a smoke run (CPU, seconds)
    python3 benchmarks/dense_attention.py --ops attention --seqs 1024,2048,4096
    bash scripts/device/run.sh python3 benchmarks/dense_attention.py --out $OUT   # on the device

Shapes: 16384 tokens (batch = 16384 / S), hidden 2048 (head_dim 128 -> 16 heads, as many kv heads), bf16,
S = 2048 and 8192, causal and not. Both operations may materialize the [B, H, S, S] logits (``attention``
returns the weights, B·H·S² values in the input dtype: 4 GiB at S = 8192), so memory is O(S²); a size that
does not fit records its error and the run goes on. Columns: ``ejkernel-<platform> sdpa`` and
``ejkernel-<platform> attention``, ``xla`` and ``cudnn`` (``jax.nn.dot_product_attention``: output only),
``jax-einsum+weights`` (output and weights, the same work as ``attention``). The ``attention`` columns'
forward returns (out, weights); forward+backward differentiates ``out`` (cotangent: fresh random values)
and returns the weights too. TFLOP/s: forward 4·B·H·S²·D (½ causal), forward+backward 3.5× that (the weights'
writes are not counted). Timing (``_harness.time_calls``): jit, warm-up, median of ``--reps`` samples, each
the mean of ``--calls`` back-to-back calls over ``--sets`` rotating sets of fresh random inputs. Numerics at
``--errors``: relative L2 error of out, dq, dk, dv against float32 ``jax.nn.dot_product_attention`` (XLA).
Writes ``<device>-<date>-dense-attention`` .json (after every row) and .png into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from attention import attention_flops, random_inputs  # noqa: E402

OPERATIONS = ("scaled_dot_product_attention", "attention")  # the ops this script benchmarks (tests/ reads it)
SHORT = {"scaled_dot_product_attention": "sdpa", "attention": "attention"}
GRADIENTS = ("out", "dq", "dk", "dv")


def jax_nn(implementation: str):
    def attend(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    return attend


def einsum_with_weights(q, k, v, causal):
    """Plain-JAX dense attention returning ``(out, weights)`` like ``attention``: float32 logits and softmax,
    weights in the input dtype ([B, H, Sq, Skv]), ``out = weights @ v``."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    if causal:
        seq_q, seq_k = q.shape[1], k.shape[1]
        visible = jnp.arange(seq_q)[:, None] + (seq_k - seq_q) >= jnp.arange(seq_k)[None, :]
        logits = jnp.where(visible, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=jnp.float32).astype(q.dtype)
    return out, weights


REFERENCE = jax_nn("xla")  # of the numerics (one function: its float32 steps are compiled once)


def columns(ops) -> list[h.Column]:
    from ejkernel.modules import attention, scaled_dot_product_attention

    functions = {"scaled_dot_product_attention": scaled_dot_product_attention, "attention": attention}
    out = []
    for op in ops:
        for platform in h.usable_platforms(op):
            def attend(q, k, v, causal, fn=functions[op], platform=platform):
                return fn(q, k, v, causal=causal, platform=platform)

            out.append(h.Column(f"ejkernel-{platform} {SHORT[op]}", attend, has_aux=op == "attention"))
    out.append(h.Column("xla", jax_nn("xla")))
    if jax.default_backend() == "gpu":
        out.append(h.Column("cudnn", jax_nn("cudnn")))
    else:
        print(f"# skipping cudnn: jax.nn.dot_product_attention(implementation='cudnn') needs an NVIDIA GPU "
              f"(backend here: {jax.default_backend()})", file=sys.stderr)
    if "attention" in ops:
        out.append(h.Column("jax-einsum+weights", einsum_with_weights, has_aux=True))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_common_args(p)
    h.add_sweep_args(p, seqs="2048,8192", errors="2048")
    p.add_argument("--ops", default=",".join(SHORT.values()), help="sdpa and/or attention")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    p.add_argument("--head-dim", type=int, default=128)
    args = h.parse(p, argv)
    if args.quick:
        args.seqs, args.errors, args.causal = "64", "64", "yes"
        args.tokens, args.hidden, args.head_dim = 128, 64, 16
    ops = [op for op in OPERATIONS if SHORT[op] in args.ops.split(",")]
    dtype = jnp.dtype(args.dtype)
    d, heads = args.head_dim, args.hidden // args.head_dim
    rec = h.Recorder(args, "dense-attention", ops=ops, tokens=args.tokens, hidden=args.hidden, head_dim=d,
                     heads=heads, flops="fwd 4*B*H*S^2*D (x0.5 causal); fwd+bwd 3.5x fwd")

    def inputs(seed, batch, seq):
        return random_inputs(jax.random.key(seed), batch, seq, heads, d, dtype, args.sets)

    def flops(shape, causal, mode):
        return attention_flops(shape["batch"], shape["heads"], shape["seq"], d, causal, mode)

    h.sweep(rec, args, dict(head_dim=d, heads=heads), inputs, columns(ops), flops, REFERENCE, GRADIENTS,
            f"dense attention ({', '.join(ops)}), hidden {args.hidden}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
