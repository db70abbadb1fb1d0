"""The distributions as users get them: hatchling wheels, installed alone or in pairs into fresh venvs."""

from __future__ import annotations

import json
import zipfile

import pytest
from support import PACKAGES, cuda_wheel_unbuildable


def _metadata(wheel) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(name).decode()


def _entry_points(wheel) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return archive.read(names[0]).decode() if names else ""


def test_versions_move_in_lockstep_and_backends_pin_core(wheelhouse):
    versions = {name: _metadata(wheel).split("\nVersion: ")[1].split("\n")[0] for name, wheel in wheelhouse.items()}
    assert len(set(versions.values())) == 1, versions
    core_version = versions["ejkernel-core"]
    for name in [name for name in PACKAGES[1:] if name in wheelhouse]:
        metadata = _metadata(wheelhouse[name])
        assert f"Requires-Dist: ejkernel-core=={core_version}" in metadata
        assert "Requires-Python: >=3.12" in metadata
        backend = name.removeprefix("ejkernel-")
        assert f"{backend} = ejkernel_{backend}.plugin" in _entry_points(wheelhouse[name])
    core = _metadata(wheelhouse["ejkernel-core"])
    # ranges, not pins, for third-party dependencies; nothing heavy in core
    assert "Requires-Dist: jax>=0.11.2" in core and "triton" not in core
    assert "ejkernel = ejkernel.cli:main" in _entry_points(wheelhouse["ejkernel-core"])


def test_cuda_wheel_ships_the_native_library_for_its_platform(wheelhouse):
    """Built with nvcc, ejkernel-cuda's wheel carries the kernels' library and a platform tag (not py3-none)."""
    reason = cuda_wheel_unbuildable()
    if reason:
        pytest.skip(reason)
    wheel = wheelhouse["ejkernel-cuda"]
    assert "-cp312-cp312-linux_x86_64.whl" in wheel.name or "-linux_" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as archive:
        assert "ejkernel_cuda/_lib/libejkernel_cuda.so" in archive.namelist()


@pytest.fixture(scope="module")
def core_and_xla(make_venv, wheelhouse):
    return make_venv("core_xla", wheelhouse["ejkernel-core"], wheelhouse["ejkernel-xla"])


def test_core_plus_one_backend_lists_just_that_backend_and_runs(core_and_xla):
    rows = json.loads(core_and_xla.ejkernel("list-backends", "--json").stdout)
    assert [(r["name"], r["status"]) for r in rows] == [("xla", "ok")]
    code = (
        "import jax, ejkernel; from ejkernel.modules import flash_attention;"
        "q = jax.random.normal(jax.random.key(0), (1, 33, 2, 16));"
        "print(flash_attention(q, q * 0.5, q + 1.0, causal=True).shape)"
    )
    assert core_and_xla.run("-c", code).stdout.strip() == "(1, 33, 2, 16)"


def test_core_alone_explains_what_to_install(make_venv, wheelhouse):
    venv = make_venv("core_only", wheelhouse["ejkernel-core"])
    assert "No ejkernel backend plugins are installed" in venv.ejkernel("list-backends").stdout
    code = (
        "import jax; from ejkernel.modules import flash_attention\n"
        "q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))\n"
        "try:\n    flash_attention(q, q, q)\nexcept ValueError as e:\n    print(e)\n"
    )
    message = venv.run("-c", code).stdout
    assert "flash_attention" in message and "pip install ejkernel-xla" in message
