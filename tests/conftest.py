"""Fixtures shared by the cross-package tests: wheels built from this tree, and fresh virtual
environments that install them (really installed, entry points and all) next to the pinned jax."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import PACKAGES, REPO, UV, Venv, cuda_wheel_unbuildable, run


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory) -> dict[str, Path]:
    """Wheels of the five distributions, built once per session with hatchling (through uv build); without
    nvcc on the machine ejkernel-cuda's is left out (its build compiles the native kernels)."""
    out = tmp_path_factory.mktemp("wheels")
    wheels = {}
    for name in PACKAGES:
        if name == "ejkernel-cuda" and cuda_wheel_unbuildable():
            continue
        run([UV, "build", "--wheel", "--quiet", "--package", name, "--out-dir", str(out), str(REPO)])
        (wheel,) = out.glob(name.replace("-", "_") + "-*.whl")
        wheels[name] = wheel
    return wheels


@pytest.fixture(scope="session")
def pinned_constraints(tmp_path_factory) -> Path:
    """The lock's exact third-party pins, so fresh environments get the same jax as the workspace."""
    path = tmp_path_factory.mktemp("constraints") / "constraints.txt"
    run([UV, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--all-packages", "--quiet",
         "--directory", str(REPO), "-o", str(path)])
    return path


@pytest.fixture(scope="session")
def make_venv(tmp_path_factory, pinned_constraints):
    """``make_venv(name, *requirements)`` -> a fresh :class:`Venv` with those installed (wheels, paths)."""

    def make(name: str, *requirements: str | Path) -> Venv:
        root = tmp_path_factory.mktemp(name) / "venv"
        run([UV, "venv", "--quiet", "--python", sys.executable, str(root)])
        venv = Venv(root)
        run([UV, "pip", "install", "--quiet", "--python", venv.python, "--constraint", str(pinned_constraints),
             *map(str, requirements)])
        return venv

    return make
