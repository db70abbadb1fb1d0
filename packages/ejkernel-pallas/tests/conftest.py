import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture
def pallas_interpret(monkeypatch):
    """EJKERNEL_PALLAS_INTERPRET=1 for one test, with the plugin's cached availability re-read."""
    from ejkernel.plugins import get_backend

    monkeypatch.setenv("EJKERNEL_PALLAS_INTERPRET", "1")
    backend = get_backend("pallas")
    if backend is not None:
        backend._usable = None
    yield
    if backend is not None:
        backend._usable = None

