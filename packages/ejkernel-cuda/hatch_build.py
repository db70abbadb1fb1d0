"""Hatchling build hook: compiles ``csrc/**/*.cu`` with nvcc into ``src/ejkernel_cuda/_lib/libejkernel_cuda.so``.

The library holds the native kernels' XLA FFI handlers (:mod:`ejkernel_cuda._native` loads it). It is built
for sm_90a only (wgmma and TMA: H100 / H200 / GH200), against the CUTLASS/CuTe headers of the
``nvidia-cutlass`` distribution and the XLA FFI headers of ``jaxlib`` (both build requirements).

- A wheel build ships the library inside the wheel (platform-specific tag) and fails without nvcc, saying
  what to install.
- An editable build (``uv sync`` of the workspace) compiles in place when nvcc is found and otherwise warns
  and goes on: the backend then reports the native kernels' library missing.

nvcc is taken from ``PATH``, else ``$CUDA_HOME/bin/nvcc``, else the ``nvidia-cuda-nvcc`` wheel. A library
newer than every source (and this file) is reused, and so is an object (``build/nvcc/``) newer than its
source and every header; objects compile in parallel (one nvcc per source). ptxas's report of each unit
(``-Xptxas -v``: registers, stack, spills, performance warnings per kernel) is kept beside its object and, for the
library, in ``ptxas-report.txt`` beside it, where the CPU tests check the kernels for spills without compiling
again.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

LIBRARY = "libejkernel_cuda.so"
LIBRARY_IN_WHEEL = f"ejkernel_cuda/_lib/{LIBRARY}"
PTXAS_REPORT = "ptxas-report.txt"  # beside the library: "== <unit>" then ptxas -v's lines, per unit
ARCH_FLAGS = ("-gencode", "arch=compute_90a,code=sm_90a")
NVCC_FLAGS = ("-O3", "-std=c++17", *ARCH_FLAGS, "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-lineinfo")
INSTALL_HINT = ("install the CUDA toolkit 12.8+ or 13 (nvcc on PATH, or set CUDA_HOME), or "
                "`pip install nvidia-cuda-nvcc`")


class BuildError(RuntimeError):
    """The native library could not be built (the message says why and what to do)."""


def find_nvcc() -> str | None:
    """nvcc from PATH, else ``$CUDA_HOME/bin/nvcc``, else the ``nvidia-cuda-nvcc`` wheel's."""
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-nvcc wheels install nvidia/{cu13,cuda_nvcc}/bin/nvcc
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/nvcc")):
            if candidate.is_file():
                return str(candidate)
    return None


def _package_dir(module: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"{distribution} is not installed in the build environment (a build requirement of "
                         "ejkernel-cuda's pyproject.toml)")
    return Path(list(spec.submodule_search_locations)[0])


def include_dirs(csrc: Path) -> list[Path]:
    """``csrc``, CUTLASS/CuTe (``nvidia-cutlass``) and the XLA FFI headers (``jaxlib/include``; found without
    importing jax, which would take seconds)."""
    cutlass = _package_dir("cutlass_library", "nvidia-cutlass") / "source" / "include"
    ffi = _package_dir("jaxlib", "jaxlib") / "include"
    for path, what in ((cutlass / "cute", "nvidia-cutlass's CuTe headers"),
                       (ffi / "xla" / "ffi", "jaxlib's XLA FFI headers")):
        if not path.is_dir():
            raise BuildError(f"{what} are not at {path}")
    return [csrc, cutlass, ffi]


def sources(csrc: Path) -> tuple[list[Path], list[Path]]:
    """(``.cu`` files, headers) under ``csrc``, sorted."""
    return sorted(csrc.rglob("*.cu")), sorted([*csrc.rglob("*.cuh"), *csrc.rglob("*.h"), *csrc.rglob("*.hpp")])


def up_to_date(library: Path, inputs: list[Path]) -> bool:
    """Whether ``library`` exists and is newer than every input (then nothing is recompiled)."""
    return library.is_file() and all(library.stat().st_mtime >= path.stat().st_mtime for path in inputs)


def build_library(csrc: Path, library: Path, objects: Path, nvcc: str, log=print) -> bool:
    """Compile every ``.cu`` under ``csrc`` (in parallel) and link them into ``library``. Returns False where
    nothing had to be done (the library is newer than every source and header). Raises BuildError."""
    units, headers = sources(csrc)
    if not units:
        raise BuildError(f"no CUDA sources (*.cu) under {csrc}")
    shared = [*headers, Path(__file__)]  # any header may be included by any unit
    if up_to_date(library, [*units, *shared]):
        return False
    includes = [f"-I{path}" for path in include_dirs(csrc)]
    objects.mkdir(parents=True, exist_ok=True)

    def compile_unit(unit: Path) -> Path:
        target = objects / (unit.relative_to(csrc).as_posix().replace("/", "__") + ".o")
        report = target.with_suffix(".ptxas.txt")
        if not up_to_date(target, [unit, *shared]) or not report.is_file():  # an edit recompiles that unit only
            partial = target.with_suffix(".o.partial")
            output = _run([nvcc, *NVCC_FLAGS, "-Xptxas", "-v", *includes, "-c", str(unit), "-o", str(partial)],
                          f"compiling {unit.name}")
            report.write_text(output)
            partial.replace(target)
        return target

    log(f"ejkernel-cuda: building {library.name} from {len(units)} CUDA source(s) with {nvcc} for sm_90a")
    workers = max(1, min(len(units), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # each worker waits on its own nvcc process
        compiled = list(pool.map(compile_unit, units))
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(".so.partial")  # a failed link never leaves a library that looks current
    _run([nvcc, *ARCH_FLAGS, "-shared", "-cudart", "static", "-o", str(partial), *map(str, compiled)], "linking")
    (library.parent / PTXAS_REPORT).write_text(
        "".join(f"== {unit.relative_to(csrc).as_posix()}\n{target.with_suffix('.ptxas.txt').read_text()}"
                for unit, target in zip(units, compiled)))
    partial.replace(library)
    log(f"ejkernel-cuda: built {library}")
    return True


def _run(command: list[str], what: str) -> str:
    """nvcc's output (stdout and stderr, where ptxas reports); raises BuildError if it failed."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"nvcc failed {what} (exit {result.returncode}):\n{' '.join(command)}\n"
                         f"{result.stdout}{result.stderr}")
    return result.stdout + result.stderr


class CudaLibraryHook(BuildHookInterface):
    """See the module docstring."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        csrc = root / "csrc"
        library = root / "src" / "ejkernel_cuda" / "_lib" / LIBRARY
        editable = version == "editable"
        nvcc = find_nvcc()
        try:
            if nvcc is None:
                raise BuildError(f"the native kernels need nvcc, which was not found: {INSTALL_HINT}")
            build_library(csrc, library, root / "build" / "nvcc", nvcc, log=self.app.display_info)
        except BuildError as error:
            if not editable:
                raise
            # editable installs (the workspace's `uv sync`) go on: the backend reports the library missing
            self.app.display_warning(f"ejkernel-cuda: the native kernels' library was not built: {error}")
            print(f"ejkernel-cuda: native library not built: {error}", file=sys.stderr)
            return
        if not editable:  # editable installs load it from src/ (in place); a wheel carries it
            build_data["force_include"][str(library)] = LIBRARY_IN_WHEEL
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
