"""The native kernels' shared library (``_lib/libejkernel_cuda.so``, built by ``hatch_build.py``): where it
is, why it cannot be used, and the registration of its XLA FFI handlers with JAX.

Nothing happens at import: the library is opened (ctypes) and its handlers registered on the first call
that needs them, once per process.

Registration (``jax.ffi.register_ffi_target(..., platform="CUDA")``) goes through jaxlib's table of custom
call handlers: where a CUDA PJRT plugin is installed it registers the handler with it, even when no GPU is
visible (``JAX_PLATFORMS=cpu``); where none is, the registration waits in that table and is harmless. A
plugin that refuses a handler (its FFI API version newer than the jaxlib's) raises; backends are
initialized first so that this happens here, where it is reported, and not inside JAX's plugin start.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

LIBRARY_PATH = Path(__file__).parent / "_lib" / "libejkernel_cuda.so"
FORWARD_TARGET = "EjkFlashForward"
BACKWARD_TARGET = "EjkFlashBackward"
PAGED_TARGET = "EjkPagedForward"  # ragged_page_attention (ragged_page_attention.py)
TARGETS = (FORWARD_TARGET, BACKWARD_TARGET, PAGED_TARGET)
BUILD_HINT = ("build it with nvcc: `uv sync` in the ejkernel workspace (CUDA toolkit 12.8+ or 13 on PATH, or "
              "CUDA_HOME, or the nvidia-cuda-nvcc wheel), or install an ejkernel-cuda wheel built that way "
              "(packages/ejkernel-cuda/README.md)")


@functools.lru_cache(maxsize=1)
def _opened() -> tuple[ctypes.CDLL | None, str | None]:
    if not LIBRARY_PATH.is_file():
        return None, f"the native kernels' library is not built ({LIBRARY_PATH} is missing): {BUILD_HINT}"
    try:
        library = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as error:
        return None, f"the native kernels' library fails to load: {error}"
    missing = [name for name in TARGETS if not hasattr(library, name)]
    if missing:
        return None, f"the native kernels' library {LIBRARY_PATH} does not export {', '.join(missing)}"
    return library, None


def library() -> ctypes.CDLL:
    """The opened library (OSError naming the reason where :func:`library_missing` gives one)."""
    opened, reason = _opened()
    if opened is None:
        raise OSError(reason)
    return opened


def library_missing() -> str | None:
    """Why the library cannot be used (not built: how to build it; fails to load: the dlopen error; a
    symbol missing), or None."""
    return _opened()[1]


@functools.lru_cache(maxsize=1)
def _registration() -> str | None:
    reason = library_missing()
    if reason is not None:
        return reason
    import jax

    jax.devices()  # start the backends (and the CUDA plugin's handler table) before registering: see above
    try:
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library(), name)), platform="CUDA")
    except Exception as error:  # e.g. the jaxlib's FFI API is older than the headers the library was built with
        return f"registering the native kernels' FFI handlers failed ({type(error).__name__}: {error})"
    return None


def registration_failed() -> str | None:
    """Register the FFI targets for the CUDA platform (once per process); why that failed, or None."""
    return _registration()


def ensure_registered() -> None:
    """Register the FFI targets (once) or raise ``UnsupportedFeature`` naming why they cannot be."""
    reason = registration_failed()
    if reason is not None:
        from ejkernel.errors import UnsupportedFeature

        raise UnsupportedFeature(f"cuda native flash attention: {reason}")
