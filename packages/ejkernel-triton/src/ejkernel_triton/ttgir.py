"""Triton's TTGIR of a kernel for a GPU target, compiled on any machine (no GPU, no ptxas): what tests read
to check the software pipeline Triton builds (shared-memory buffers, `async_wait` depths)."""

from __future__ import annotations

import numpy as np


def _pointer_type(arg) -> str:
    from ejkernel_triton.launch import _triton_type

    return ("" if isinstance(arg, np.generic | int | float) else "*") + (
        "i32" if isinstance(arg, int) else "fp32" if isinstance(arg, float) else _triton_type(arg.dtype))


def kernel_ttgir(kernel, args, constexprs: dict, num_warps: int, num_stages: int, compute_capability: int = 90) -> str:
    """TTGIR (after software pipelining) of `kernel` called with `args` (arrays or shape structs, numpy or
    Python scalars; outputs included, in kernel order) and `constexprs`."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    signature = {name: _pointer_type(arg) for name, arg in zip(kernel.arg_names, args)}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t[0] == "*"}
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", compute_capability, 32)
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
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return str(module)
