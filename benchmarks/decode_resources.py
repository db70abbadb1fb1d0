"""Shared memory, registers and spills of the Triton serving kernels for sm_90, compiled on any machine (no GPU:
Triton's TTGIR -> PTX, then the ptxas Triton ships, `-v`). What the decode heuristic's residency model
(`ejkernel_triton.decode.config.resident_programs`) and the mixed-batch notes rest on (NOTES.md).

    JAX_PLATFORMS=cpu python benchmarks/decode_resources.py
    JAX_PLATFORMS=cpu python benchmarks/decode_resources.py --decode "block_n=32,prefetch=3" \
        --mixed "fused=True,block_m=64,num_warps=4"

Each line: the kernel, its warps and stages, shared memory (bytes), registers per thread, spill stores (bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

TESTS = Path(__file__).resolve().parents[1] / "packages" / "ejkernel-triton" / "tests"


def compile_info(kernel, args, constexprs, num_warps, num_stages) -> tuple[int, str, str]:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from ejkernel_triton.ttgir import _pointer_type

    signature = {name: _pointer_type(arg) for name, arg in zip(kernel.arg_names, args)}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t[0] == "*"}
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    metadata = {"target": target, **options.__dict__}
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        module = stages[stage](module, metadata)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(module)
    try:
        out = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True)
    finally:
        os.unlink(f.name)
    text = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return metadata.get("shared"), ",".join(regs) or "?", ",".join(spills) or "?"


def recorded_launches(modules, run):
    """The (kernel, args + outputs, constexprs, warps, stages) of every launch ``run()`` makes (no GPU)."""
    launches = []

    def record(kernel, args, out_shapes, grid, *, num_warps, num_stages, interpret, zeroed_outputs=(), **c):
        launches.append((kernel, [*args, *out_shapes], c, num_warps, num_stages))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    saved = [m.launch for m in modules]
    for m in modules:
        m.launch = record
    try:
        run()
    finally:
        for m, f in zip(modules, saved):
            m.launch = f
    return launches


def parse(text: str) -> dict:
    return eval(f"dict({text})") if text else {}  # noqa: S307 (a command-line tool)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", action="append", default=[],
                   help="TritonDecodeConfig fields, e.g. block_n=32,prefetch=3")
    p.add_argument("--mixed", action="append", default=[],
                   help="TritonRaggedPageConfig fields replaced in the heuristic's config of the mixed batch")
    p.add_argument("--page-sizes", default="16,64")
    p.add_argument("--kv-dtype", default="", help="the decode caches' dtype when quantized (e.g. float8_e4m3fn)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from test_decode import _paged_call, _ragged_call  # noqa: PLC0415
    from test_ragged_page_attention import _call as _mixed_call  # noqa: PLC0415

    from ejkernel_triton.decode import TritonDecodeConfig, kernels
    from ejkernel_triton.decode.page_attention import IMPLEMENTATION as PAGED
    from ejkernel_triton.decode.ragged_decode_attention import IMPLEMENTATION as RAGGED
    from ejkernel_triton.ragged_page_attention import IMPLEMENTATION as MIXED
    from ejkernel_triton.ragged_page_attention import kernels as mixed_kernels

    decode = args.decode or ([] if args.mixed else ["block_n=64,prefetch=2", "block_n=32,prefetch=3"])
    mixed = args.mixed or ([] if args.decode else [""])
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    for text in decode:
        cfg = TritonDecodeConfig(**parse(text))
        calls = [(f"paged p{ps}", PAGED, _paged_call(num_seqs=2, context=4096, page_size=ps)) for ps in page_sizes]
        calls.append(("dense", RAGGED, _ragged_call(batch=2, heads=32, kv_heads=8, dim=128, seq_len=4096)))
        if args.kv_dtype:
            def quantized(call, names):
                return dataclasses.replace(call, **{n: jax.ShapeDtypeStruct(getattr(call, n).shape, args.kv_dtype)
                                                    for n in names})
            calls = [(name, impl, quantized(call, ("key_cache", "value_cache") if impl is PAGED else ("key", "value")))
                     for name, impl, call in calls]
        for name, impl, call in calls:
            run = lambda impl=impl, call=call: jax.eval_shape(lambda x: impl(x, cfg), call)  # noqa: E731
            for kernel, a, c, w, s in recorded_launches([kernels], run)[:1]:
                print(f"decode {name:9s} {text:30s} warps {w} stages {s}: shared, registers, spills =",
                      compile_info(kernel, a, c, w, s), flush=True)
    for text in mixed:
        for ps in page_sizes:
            call = _mixed_call(page_size=ps)
            cfg = dataclasses.replace(MIXED.heuristic_config(call), **parse(text))
            for kernel, a, c, w, s in recorded_launches([kernels, mixed_kernels],
                                                        lambda: jax.eval_shape(lambda x: MIXED(x, cfg), call)):
                name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
                print(f"mixed p{ps} {text or 'heuristic':40s} {name} warps {w} stages {s}: shared, registers, spills =",
                      compile_info(kernel, a, c, w, s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
