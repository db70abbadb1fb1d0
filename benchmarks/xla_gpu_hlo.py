"""The kernels XLA compiles for an H100, without a GPU: ejkernel's XLA flash attention next to ``jax.nn``'s.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/xla_gpu_hlo.py                   # the table below
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/xla_gpu_hlo.py --show causal     # kernels of one case
    ... --dump DIR                                                                        # optimized HLO text

Needs the CUDA PJRT plugin installed (``jax[cuda13]``'s ``jax_cuda13_plugin``/``jax_cuda13_pjrt``; the
workspace venv has it) but no GPU, driver or cuDNN: the plugin compiles for a *compile-only* device
described by a GPU target config (``H100_TARGET_CONFIG``: the H100 SXM's figures from XLA's
``backends/gpu/target_config/specs``), as ahead-of-time compilation does. What it shows is XLA's fusion
decisions for sm_90 -- how many kernels a program launches, which of them are Triton GEMM / Triton softmax
("normalization diamond") fusions and which plain loop or reduction fusions, and their output shapes (an S²
output is a pass over the logits). What it cannot show: timings, and the autotuner's tile choices (no
device to time candidates on: XLA takes its default tiles). Kernel counts have matched what the
profile-free device runs showed so far (docs: packages/ejkernel-xla/NOTES.md).

Each row: kernels of the program and the bytes their outputs write (a proxy of the memory traffic the dense
path is bound by); ``--show`` lists each kernel's output shape and kind.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no cuDNN/driver here: compile only

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def compile_only_h100():
    """A compile-only device (no GPU needed) for the CUDA plugin, described by ``H100_TARGET_CONFIG``."""
    from jax._src import xla_bridge

    topology = xla_bridge.make_pjrt_topology("cuda", "", topology="1x1x1", target_config=H100_TARGET_CONFIG)
    return topology._make_compile_only_devices()[0]


def optimized_hlo(fn, *shapes, device) -> str:
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()


_KERNEL = re.compile(r"\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (fusion|custom-call|while|copy|transpose|reduce|dot)\(")


def kernels(hlo: str) -> list[dict]:
    """The launches of the entry computation: name, output shape, op, fusion kind."""
    rows = []
    for line in hlo[hlo.index("\nENTRY"):].splitlines()[1:]:
        m = _KERNEL.match(line)
        if not m:
            continue
        kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(\w+)", line)
        rows.append(dict(name=m.group(1), shape=m.group(2), op=m.group(3), kind=kind.group(1) if kind else ""))
    return rows


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}


def written_bytes(rows: list[dict]) -> int:
    """Bytes of the kernels' outputs (tuple outputs not counted): a proxy of the program's memory traffic,
    which the dense attention path is bound by (each output is read back at least once)."""
    total = 0
    for r in rows:
        m = re.match(r"(\w+)\[([\d,]*)\]", r["shape"])
        if m and m.group(1) in _BYTES:
            total += _BYTES[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d)
    return total


def cases(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """name -> (ejkernel fn, jax.nn fn or None, extra input shapes); the inputs are q, k, v (+ cotangent)."""
    from ejkernel.modules import flash_attention
    from ejkernel_xla.flash_attention import XlaFlashConfig

    def ours(**kw):
        return lambda q, k, v, *extra: flash_attention(q, k, v, platform="xla", cfg=XlaFlashConfig(dense=True), **kw)

    def jnn(**kw):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)

    seg = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return {
        "full": (ours(), jnn(), ()),
        "causal": (ours(causal=True), jnn(is_causal=True), ()),
        "window": (ours(causal=True, sliding_window=(256, 0)), jnn(is_causal=True, local_window_size=(256, 0)), ()),
        "segments": (lambda q, k, v, s: flash_attention(q, k, v, platform="xla", cfg=XlaFlashConfig(dense=True),
                                                        q_segment_ids=s, kv_segment_ids=s), None, (seg,)),
        "softcap": (ours(causal=True, logits_soft_cap=30.0), None, ()),
        "dropout": (ours(causal=True, dropout_prob=0.1, dropout_seed=0), None, ()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cases", default="full,causal,window,segments,softcap,dropout")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--show", default="", help="comma-separated cases whose kernels to list")
    p.add_argument("--dump", default="", help="directory for the optimized HLO texts")
    args = p.parse_args(argv)

    device = compile_only_h100()
    dtype = jnp.dtype(args.dtype)
    kv_heads = args.kv_heads or args.heads
    q = jax.ShapeDtypeStruct((args.batch, args.seq, args.heads, args.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((args.batch, args.seq, kv_heads, args.head_dim), dtype)
    table = cases(args.batch, args.seq, args.heads, kv_heads, args.head_dim, dtype)
    show = set(filter(None, args.show.split(",")))
    print(f"# {device.device_kind} (compile only), B={args.batch} S={args.seq} H={args.heads} Hkv={kv_heads} "
          f"D={args.head_dim} {dtype}; jax {jax.__version__}")
    print("| case | mode | ejkernel kernels | ejkernel MiB written | jax.nn kernels | jax.nn MiB written |")
    print("|---|---|---|---|---|---|")
    for name in filter(None, args.cases.split(",")):
        ours, theirs, extra = table[name]
        for mode in args.modes.split(","):
            cells = []
            for who, fn in (("ejkernel", ours), ("jax.nn", theirs)):
                if fn is None:
                    cells.append("— | —")
                    continue
                if mode == "fwd+bwd":
                    program = (lambda f: lambda q_, k_, v_, do, *e: jax.vjp(lambda a, b, c: f(a, b, c, *e), q_, k_, v_)[1](do))(fn)
                    shapes = (q, kv, kv, q, *extra)
                else:
                    program, shapes = fn, (q, kv, kv, *extra)
                hlo = optimized_hlo(program, *shapes, device=device)
                rows = kernels(hlo)
                cells.append(f"{len(rows)} | {written_bytes(rows) / 2**20:,.0f}")
                if args.dump:
                    Path(args.dump).mkdir(parents=True, exist_ok=True)
                    Path(args.dump, f"{who}-{name}-{mode}.hlo".replace("+", "_")).write_text(hlo)
                if name in show:
                    print(f"  {who} {name} {mode}:", file=sys.stderr)
                    for r in rows:
                        print(f"    {r['name'][:36]:36s} {r['shape'][:44]:44s} {r['op']} {r['kind']}", file=sys.stderr)
            print(f"| {name} | {mode} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
