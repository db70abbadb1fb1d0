"""What the native-kernel test files share: the NVIDIA tools (nvcc, cuobjdump) and the SASS of the library."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def nvidia_tool(name: str) -> str | None:
    """``name`` from PATH, else from the nvidia-cuda-* wheels of the dev group (nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    import nvidia  # namespace package of the NVIDIA wheels

    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
            return str(candidate)
    return None


NVCC = nvidia_tool("nvcc") or shutil.which("nvcc", path=os.path.join(os.environ.get("CUDA_HOME", "/none"), "bin"))
needs_nvcc = pytest.mark.skipif(not NVCC, reason="no nvcc on this machine: the native library cannot be built here")


def cuobjdump(*arguments: str) -> str:
    """cuobjdump's output (nvdisasm, which ``-sass`` runs, found beside it); skips where there is none. The same
    call on an unchanged file is answered once per process (the library's SASS takes ~12 s to disassemble)."""
    tool = nvidia_tool("cuobjdump")
    if tool is None:
        pytest.skip("no cuobjdump (the dev group's nvidia-cuda-cuobjdump) to read the SASS with")
    stamps = tuple(os.stat(argument).st_mtime_ns if os.path.isfile(argument) else None for argument in arguments)
    return _cuobjdump(tool, arguments, stamps)


@functools.lru_cache(maxsize=8)
def _cuobjdump(tool: str, arguments: tuple[str, ...], stamps: tuple[int | None, ...]) -> str:
    """``stamps``: the files' modification times, so that a rebuilt library is read again."""
    nvdisasm = nvidia_tool("nvdisasm")
    env = dict(os.environ, PATH=os.pathsep.join(filter(None, [nvdisasm and str(Path(nvdisasm).parent),
                                                               os.environ.get("PATH")])))
    result = subprocess.run([tool, *arguments], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def mnemonics(sass: str) -> set[str]:
    """The instruction names of a SASS listing."""
    return set(re.findall(r"\b([A-Z][A-Z0-9]+)(?=[.\s])", sass))


def ptxas_report(unit: str) -> str:
    """ptxas's report (``-Xptxas -v``) of one source of the library, e.g. ``flash_attention/forward.cu``, from the
    build's ``ptxas-report.txt`` beside the library (hatch_build.py); skips where the library was built without it."""
    from ejkernel_cuda import _native

    path = Path(_native.LIBRARY_PATH).parent / "ptxas-report.txt"
    if not path.is_file():
        pytest.skip(f"no ptxas report beside the library ({path}): it was not built by this checkout's hatch_build")
    parts = re.split(r"^== (\S+)\n", path.read_text(), flags=re.MULTILINE)
    units = dict(zip(parts[1::2], parts[2::2]))
    assert unit in units, sorted(units)
    return units[unit]


def ptxas_kernels(report: str, kernel: str) -> list[tuple[str, int, int, int, int]]:
    """(name, stack bytes, spill stores, spill loads, registers) of each function of ``report`` whose name holds
    ``kernel``."""
    entries = re.findall(rf"Function properties for (\S*{kernel}\S*)\n\s*(\d+) bytes stack frame, (\d+) bytes "
                         rf"spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers", report, flags=re.DOTALL)
    return [(name, *map(int, numbers)) for name, *numbers in entries]
