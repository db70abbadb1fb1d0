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
    from ejkernel_triton.launch import compile_to

    signature = {name: _pointer_type(arg) for name, arg in zip(kernel.arg_names, args)}
    module, _ = compile_to(kernel, signature, constexprs, num_warps, num_stages, compute_capability, "ttgir")
    return str(module)
