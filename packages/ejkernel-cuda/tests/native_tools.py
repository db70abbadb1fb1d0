"""What the native-kernel test files share: the NVIDIA tools (nvcc, cuobjdump) and the SASS of the library."""

from __future__ import annotations

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
    """cuobjdump's output (nvdisasm, which ``-sass`` runs, found beside it); skips where there is none."""
    tool = nvidia_tool("cuobjdump")
    if tool is None:
        pytest.skip("no cuobjdump (the dev group's nvidia-cuda-cuobjdump) to read the SASS with")
    nvdisasm = nvidia_tool("nvdisasm")
    env = dict(os.environ, PATH=os.pathsep.join(filter(None, [nvdisasm and str(Path(nvdisasm).parent),
                                                               os.environ.get("PATH")])))
    result = subprocess.run([tool, *arguments], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def mnemonics(sass: str) -> set[str]:
    """The instruction names of a SASS listing."""
    return set(re.findall(r"\b([A-Z][A-Z0-9]+)(?=[.\s])", sass))
