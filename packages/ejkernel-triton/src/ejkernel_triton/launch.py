"""Launching Triton kernels from JAX: the one place every kernel call goes through (:func:`launch`).

:func:`launch` sends a kernel to one of three launchers: jax-triton (the pointer kernels on a GPU), this
module's own custom call (kernels with TMA descriptors or warp specialization, below), or Triton's
interpreter on the host (``TRITON_INTERPRET=1``: the CPU tests; ``ejkernel_triton.interpret``).

Launching compiled Triton kernels with what jax-triton 0.3.1 leaves out.

jax-triton compiles a kernel and hands it to jaxlib's Triton custom call, but it sizes the launch from
the ``num_warps`` it was asked for and gives the kernel no global scratch memory. Both matter on
Hopper: a warp-specialized loop (``tl.range(..., warp_specialize=True)``) compiles to more warps than
requested (producer + consumer warpgroups), and device-side TMA descriptors
(``tl.make_tensor_descriptor``) are written into per-program global scratch. jaxlib's launcher already
allocates that scratch when told its size; this module compiles through Triton's own ``triton.compile``
(which reports the compiled warp count and scratch size) and builds the same custom call.

Interface: :func:`triton_call` takes the kernel's arguments in order (arrays, and scalars as numpy
scalars), the output shapes (outputs follow the inputs in the kernel's parameter list, as in
jax-triton), the grid, and constexpr keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import jax.extend as jex
import numpy as np
from jax._src import dispatch
from jax.interpreters import mlir

_TRITON_TYPES = {
    np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(np.float64): "fp64",
    np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.uint32): "u32",
    np.dtype(np.uint64): "u64", np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8",
    np.dtype(np.int16): "i16", np.dtype(np.bool_): "i1",
    np.dtype(jnp.float8_e4m3fn): "fp8e4nv", np.dtype(jnp.float8_e5m2): "fp8e5",
}


def _triton_type(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return "bf16"
    try:
        return _TRITON_TYPES[dtype]
    except KeyError:
        raise TypeError(f"no Triton type for dtype {dtype}") from None


@dataclasses.dataclass(frozen=True)
class _Compiled:
    name: str
    num_warps: int  # after warp specialization: what the launch must use
    shared: int
    ptx: str
    scratch_size: int
    scratch_align: int


_COMPILED: dict[Any, _Compiled] = {}


def compile_to(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int, compute_capability: int,
               last_stage: str):
    """Triton's own compile pipeline for a CUDA target, in memory, up to `last_stage` ("ttgir", "ptx"):
    (module, metadata). `signature`: each runtime argument's Triton type by name ("*bf16", "i32"); pointers
    are declared 16-byte aligned, as jax-triton does. No GPU is needed (jaxlib assembles the PTX itself).
    triton.compile would also write a disk cache under ~/.triton, which a read-only home refuses."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty in signature.items() if ty.startswith("*")}
    src = triton.compiler.ASTSource(fn=kernel, signature={**signature, **{name: "constexpr" for name in constexprs}},
                                    constexprs=dict(constexprs), attrs=attrs)
    target = GPUTarget("cuda", compute_capability, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    metadata: dict[str, Any] = {"target": target, **options.__dict__}
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    order = ("ttir", "ttgir", "llir", "ptx")
    for stage in order[:order.index(last_stage) + 1]:
        module = stages[stage](module, metadata)
    return module, metadata


def _compile(kernel, signature: tuple, constexprs: tuple, num_warps: int, num_stages: int,
             compute_capability: int) -> _Compiled:
    key = (kernel, signature, constexprs, num_warps, num_stages, compute_capability)
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    ptx, metadata = compile_to(kernel, dict(signature), dict(constexprs), num_warps, num_stages, compute_capability,
                               "ptx")
    out = _Compiled(name=metadata["name"], num_warps=metadata["num_warps"], shared=metadata["shared"], ptx=ptx,
                    scratch_size=metadata["global_scratch_size"], scratch_align=metadata["global_scratch_align"])
    _COMPILED[key] = out
    return out


_call_p = jex.core.Primitive("ejkernel_triton_call")
_call_p.multiple_results = True
_call_p.def_impl(functools.partial(dispatch.apply_primitive, _call_p))


@_call_p.def_abstract_eval
def _abstract_eval(*avals, out_shapes, **_):
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes]


def _lowering(ctx, *arrays, **params):
    from jax._src.lib import gpu_triton

    kernel = params["kernel"]
    slots: list[tuple[str, Any]] = [("array", a) for a in ctx.avals_in]
    for index, value in params["scalars"]:
        slots.insert(index, ("scalar", value))
    slots.extend(("output", a) for a in ctx.avals_out)
    signature = []
    for arg_name, (kind, value) in zip(kernel.arg_names, slots):
        dtype = value.dtype if kind != "scalar" else np.asarray(value).dtype
        signature.append((arg_name, ("*" if kind != "scalar" else "") + _triton_type(dtype)))
    cc = params["compute_capability"]
    compiled = _compile(kernel, tuple(signature), params["constexprs"], params["num_warps"],
                        params["num_stages"], cc)
    zeroed = set(params["zeroed_outputs"])
    kernel_params = []
    n_out = 0
    for (kind, value), (_, ty) in zip(slots, signature):
        if kind == "scalar":
            kernel_params.append(gpu_triton.create_scalar_parameter(np.asarray(value).item(), ty))
            continue
        zero_bytes = 0
        if kind == "output":
            if n_out in zeroed:
                zero_bytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
            n_out += 1
        kernel_params.append(gpu_triton.create_array_parameter(zero_bytes, 16))
    triton_kernel = gpu_triton.TritonKernel(
        compiled.name, compiled.num_warps, 1, compiled.shared, compiled.ptx, "", cc,
        compiled.scratch_size, compiled.scratch_align)
    call = gpu_triton.TritonKernelCall(triton_kernel, *params["grid"], kernel_params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2,
                                backend_config=zlib.compress(call.to_proto(params["name"], b"")))
    return rule(ctx, *arrays)


mlir.register_lowering(_call_p, _lowering, platform="cuda")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this jaxlib's Triton custom call takes global scratch: without it, kernels with TMA
    descriptors cannot run, and callers keep the pointer kernels."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return False
    return "global_scratch_size" in (gpu_triton.TritonKernel.__init__.__doc__ or "")


@functools.lru_cache(maxsize=None)
def device_compute_capability() -> int:
    from jax._src.lib import gpu_triton

    return int(gpu_triton.get_compute_capability(0))


def triton_call(*args, kernel, out_shape, grid, num_warps: int = 4, num_stages: int = 3,
                zeroed_outputs=(), compute_capability: int | None = None, **constexprs):
    """Launch `kernel` on `args` (arrays and numpy scalars, in parameter order); returns the outputs."""
    arrays = [a for a in args if not isinstance(a, (np.generic, int, float))]
    scalars = tuple((i, np.asarray(a)[()] if isinstance(a, np.generic) else np.int32(a) if isinstance(a, int)
                     else np.float32(a)) for i, a in enumerate(args) if isinstance(a, (np.generic, int, float)))
    grid = tuple(grid) + (1,) * (3 - len(grid))
    cc = compute_capability or device_compute_capability()
    return _call_p.bind(
        *arrays, kernel=kernel, scalars=scalars, out_shapes=tuple(out_shape), grid=grid,
        num_warps=num_warps, num_stages=num_stages, constexprs=tuple(sorted(constexprs.items())),
        zeroed_outputs=tuple(zeroed_outputs), compute_capability=cc, name=kernel.__name__)


COMPUTE_CAPABILITY_ENV = "EJKERNEL_TRITON_COMPUTE_CAPABILITY"
"""Compile for this compute capability instead of the visible GPU's (lowering on a CPU-only machine)."""


def gpu_device_kind() -> str:
    """``device_kind`` of the first visible GPU ("NVIDIA H200"); "" without one."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return ""
    return device.device_kind if device.platform == "gpu" else ""


def target_compute_capability() -> int:
    """Compute capability the kernels compile for: EJKERNEL_TRITON_COMPUTE_CAPABILITY, else the GPU's; 0 without."""
    cc = os.environ.get(COMPUTE_CAPABILITY_ENV)
    if cc:
        return int(cc)
    return device_compute_capability() if gpu_device_kind() else 0


def launch(kernel, args, out_shapes, grid, *, num_warps: int, num_stages: int, zeroed_outputs=(), interpret: bool,
           tma: bool = False, input_output_aliases=None, **constexprs):
    """Call `kernel` on `args` (arrays and np.float32 scalars, in kernel order); outputs follow inputs.

    Scalars go as np.float32: jax-triton passes a Python float as fp64, which would promote the
    kernel's float32 arithmetic to fp64. `interpret`: run in Triton's interpreter on the host. `tma`: the
    kernel makes TMA descriptors (or is warp-specialized), which needs :func:`triton_call` on a GPU (global
    scratch, the compiled warp count). `input_output_aliases` ``{argument index: output index}``: the output
    starts as that argument's values (a kernel that writes part of an array another launch filled)."""
    if interpret:
        from ejkernel_triton.interpret import run_on_host

        return run_on_host(kernel, args, out_shapes, grid, input_output_aliases=input_output_aliases, **constexprs)
    if input_output_aliases and tma:
        raise NotImplementedError("launch: input_output_aliases with tma=True")
    if tma:
        return triton_call(*args, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
                           num_stages=num_stages, zeroed_outputs=zeroed_outputs,
                           compute_capability=target_compute_capability(), **constexprs)
    import jax_triton as jt

    cc = os.environ.get(COMPUTE_CAPABILITY_ENV)
    return jt.triton_call(
        *args, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps, num_stages=num_stages,
        zeroed_outputs=zeroed_outputs, compute_capability=int(cc) if cc else None,
        input_output_aliases=_operand_aliases(args, input_output_aliases), **constexprs)


def _operand_aliases(args, input_output_aliases) -> dict[int, int]:
    """jax-triton numbers aliased inputs among the array operands (scalars are not operands): argument
    indices translated."""
    operand = {}
    for index, arg in enumerate(args):
        if not isinstance(arg, (np.generic, int, float)):
            operand[index] = len(operand)
    return {operand[arg_index]: out_index for arg_index, out_index in (input_output_aliases or {}).items()}
