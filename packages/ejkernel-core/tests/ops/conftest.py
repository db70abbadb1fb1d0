"""Fixtures of the ejkernel.ops tests: a clean environment and the toy kernel family."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the toy kernels are imported by name, here and in spawned processes
    sys.path.insert(0, str(HERE))

_ENV = (
    "EJKERNEL_AUTOTUNE_POLICY",
    "EJKERNEL_LOG_AUTOTUNE",
    "EJKERNEL_OPS_STAMP",
    "EJKERNEL_OPS_RECORD",
    "EJKERNEL_CACHE_DIR",
    "XDG_CACHE_HOME",
)


@pytest.fixture(autouse=True)
def clean_ops_state(monkeypatch, tmp_path):
    """No ejkernel env vars, a private cache dir, a fresh default executor and recording table."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "ejkernel-cache"))
    from ejkernel.ops import clear_invocations, set_default_executor

    set_default_executor(None)
    clear_invocations()
    yield
    set_default_executor(None)
    clear_invocations()
