import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture
def pallas_interpret(monkeypatch):
    """EJKERNEL_PALLAS_INTERPRET=1 for one test, as if it had been set before ``import ejkernel``.

    The plugin registers its CPU (interpret-mode) implementations only when the variable is set at load,
    so this swaps the pallas registrations for the interpret-mode set and re-reads the cached
    availability; both are restored afterwards.
    """
    from ejkernel.kernels._registry import kernel_registry
    from ejkernel.plugins import get_backend
    from ejkernel_pallas import plugin

    backend = get_backend("pallas")

    def register(declared):
        if backend is None:
            return
        kernel_registry.unregister_plugin(backend.name)
        declared.register(kernel_registry, backend.name)
        backend._usable = None

    monkeypatch.setenv(plugin.INTERPRET_ENV, "1")
    register(dataclasses.replace(plugin.BACKEND, implementations=plugin.implementations(True)))
    yield
    register(plugin.BACKEND)  # what the plugin registered at load
