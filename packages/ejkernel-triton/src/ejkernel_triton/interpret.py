"""Running Triton kernels on the host in Triton's interpreter (the CPU tests' path; fp32/fp16).

TRITON_INTERPRET=1 must be set before triton is imported: it turns every ``@triton.jit`` function,
triton.language's own included, into an interpreted one. :func:`ejkernel_triton.launch.launch` then
sends each kernel call here, where it runs inside a ``jax.pure_callback`` on numpy copies of its inputs.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import triton


def interpreting() -> bool:
    """Whether triton was imported with TRITON_INTERPRET=1 (kernels then run on the host)."""
    return bool(triton.knobs.runtime.interpret)


_PATCHED_HELPERS: set = set()
_LAUNCH_LOCK = threading.Lock()


def _patch_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter, applied only when it runs our kernels.

    It turns 1-element arrays into ints with int(array), which numpy >= 2.5 refuses for arrays that
    are not 0-d (loop bounds computed at run time hit it): take the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ejkernel_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._ejkernel_patched = True
    interpreter._patch_lang_tensor = patched

    # A helper called from a kernel re-patches triton.language on every call, which dominates the
    # interpreter's time: patch once per helper and launch (`run_on_host` empties the set).
    def call_helper(self, *args, **kwargs):
        if self.fn not in _PATCHED_HELPERS:
            interpreter._patch_lang(self.fn)
            _PATCHED_HELPERS.add(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call_helper


class _HostDtype:
    # Triton reads a tensor's dtype through its string form ("torch.float16"). One object per dtype: Triton's
    # native argument specialization caches the type of a dtype object by its address, so a freed object whose
    # address a new one of another dtype reuses would come back with the old type (seen: an int32 pointer
    # typed fp32 after a few hundred launches in one process).
    _interned: dict[str, _HostDtype] = {}

    def __new__(cls, dtype: np.dtype):
        name = np.dtype(dtype).name
        if name not in cls._interned:
            obj = super().__new__(cls)
            obj.name = name
            cls._interned[name] = obj
        return cls._interned[name]

    def __str__(self) -> str:
        return "torch." + self.name


class _HostTensor:
    """The few torch.Tensor methods Triton's interpreter calls, over a numpy array in host memory."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = _HostDtype(array.dtype)

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args, **kwargs):
        return _HostTensor(self.array[:0])

    def set_(self, storage, offset, size, stride):
        self.array, self.dtype = storage.array, storage.dtype
        return self

    def copy_(self, other):
        return self


def run_on_host(kernel, args, out_shapes, grid, input_output_aliases=None, **constexprs):
    """`kernel[grid](*args, *outputs, **constexprs)` in the interpreter, as a JAX callback; returns the outputs
    (zero-initialized, so every output is "zeroed"; an output named in `input_output_aliases` ``{argument
    index: output index}`` starts as a copy of that argument)."""
    aliases = dict(input_output_aliases or {})
    _patch_interpreter()
    array_idx = [i for i, a in enumerate(args) if not isinstance(a, (int, float, np.floating))]

    def host(*arrays):
        call_args = [float(a) if isinstance(a, np.floating) else a for a in args]
        for i, a in zip(array_idx, arrays):
            call_args[i] = _HostTensor(np.ascontiguousarray(np.asarray(a)))
        outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
        for arg_index, out_index in aliases.items():
            outs[out_index] = np.array(call_args[arg_index].array, dtype=out_shapes[out_index].dtype)
        # XLA may run independent callbacks (the dK/dV and dQ kernels) on two threads at once, and the
        # interpreter patches triton.language globally per launch: one launch at a time.
        with _LAUNCH_LOCK:
            _PATCHED_HELPERS.clear()
            kernel[grid](*call_args, *map(_HostTensor, outs), **constexprs)
        return tuple(outs)

    return jax.pure_callback(host, tuple(out_shapes), *[args[i] for i in array_idx])
