"""Does the ring's key/value ``ppermute`` overlap the cuDNN kernel on two GPUs (issue #13)? Times the
causal zig-zag ring forward at S=64k and prints the order of collectives and kernels in the compiled
program; run it under different ``XLA_FLAGS`` to compare schedulers."""

import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import time_calls  # noqa: E402

from ejkernel.modules import ring_attention, zigzag_shard  # noqa: E402

S, H, D = int(sys.argv[1]) if len(sys.argv) > 1 else 65536, 16, 128
devices = jax.device_count()
mesh = jax.make_mesh((devices,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
spec = P(None, "sp")
ring = jax.jit(jax.shard_map(lambda q, k, v: ring_attention(q, k, v, causal=True, axis_name="sp",
                                                             sequence_layout="zigzag"),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
sets = [[zigzag_shard(jax.random.normal(kk, (1, S, H, D), jnp.float32).astype(jnp.bfloat16), devices)
         for kk in jax.random.split(jax.random.key(i), 3)] for i in range(2)]
ms = time_calls(lambda c: ring(*sets[c % 2]), 3, 7, 10) * 1e3
print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: ring forward {ms:.3f} ms", flush=True)
text = ring.lower(*sets[0]).compile().as_text()
order = [m.group(0) for m in re.finditer(r"(collective-permute(-start|-done)?|custom-call\(|__cudnn\$\w+|conditional\()",
                                         text)]
print("schedule:", " ".join(o for o in order if "cudnn" in o or "collective" in o or "conditional" in o)[:1500])
