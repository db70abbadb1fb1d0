"""Helpers for the cross-package tests: running commands, clean child environments, fresh venvs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ejkernel-core", "ejkernel-xla", "ejkernel-triton", "ejkernel-pallas", "ejkernel-cuda")
TEST_PLUGINS = REPO / "tests" / "plugins"
UV = str(Path(sys.executable).with_name("uv"))


def cuda_wheel_unbuildable() -> str | None:
    """Why the ejkernel-cuda wheel cannot be built on this machine (its build hook finds no nvcc), or None."""
    hook_path = REPO / "packages" / "ejkernel-cuda" / "hatch_build.py"
    spec = importlib.util.spec_from_file_location("ejkernel_cuda_build_hook", hook_path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return None if hook.find_nvcc() else f"the ejkernel-cuda wheel needs nvcc: {hook.INSTALL_HINT}"


def run(command: list[str], *, env: dict | None = None, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command, and on failure show its output in the test report."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"command failed ({result.returncode}): {' '.join(command)}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: CPU jax, no inherited plugin controls."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EJKERNEL_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


@dataclasses.dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return run([self.python, *args], env=env or clean_env(), check=check)

    def ejkernel(self, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return run([str(self.bin / "ejkernel"), *args], env=env or clean_env(), check=check)


