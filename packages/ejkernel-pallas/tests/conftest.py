import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


def _interpret_registrations(monkeypatch, value: str):
    """EJKERNEL_PALLAS_INTERPRET=``value`` for one test, as if it had been set before ``import ejkernel``.

    The plugin registers its CPU (interpret-mode) implementations only when the variable is set at load,
    so this swaps the pallas registrations for that mode's set and re-reads the cached availability; the
    test gets a fresh default executor (configs chosen for the other set's implementations are of other
    types). All three are restored afterwards.
    """
    from ejkernel.kernels._registry import kernel_registry
    from ejkernel.ops import set_default_executor
    from ejkernel.plugins import get_backend
    from ejkernel_pallas import plugin

    backend = get_backend("pallas")

    def register(declared):
        if backend is None:
            return
        kernel_registry.unregister_plugin(backend.name)
        declared.register(kernel_registry, backend.name)
        backend._usable = None

    monkeypatch.setenv(plugin.INTERPRET_ENV, value)
    register(dataclasses.replace(plugin.BACKEND, implementations=plugin.implementations(plugin.interpret_mode())))
    executor = set_default_executor(None)
    yield
    set_default_executor(executor)
    register(plugin.BACKEND)  # what the plugin registered at load


@pytest.fixture
def pallas_interpret(monkeypatch):
    """The TPU kernels registered for the CPU, in Pallas' generic interpreter (EJKERNEL_PALLAS_INTERPRET=1)."""
    yield from _interpret_registrations(monkeypatch, "1")


@pytest.fixture
def pallas_interpret_gpu(monkeypatch):
    """The GPU (Triton-lowered) kernels registered for the CPU, interpreted (EJKERNEL_PALLAS_INTERPRET=gpu)."""
    yield from _interpret_registrations(monkeypatch, "gpu")
