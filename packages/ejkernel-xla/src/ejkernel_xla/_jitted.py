"""One compiled program per call signature for XLA implementations written as plain JAX functions.

``JittedImplementation.compute(call, config)`` is traced under ``jax.jit`` once per (shapes, static fields,
config) -- eager ``lax.scan``/``lax.map`` would re-trace their bodies on every call -- inside
``matmul_precision(call.precision)``, so the matmuls of plain autodiff around any custom-VJP kernel
(their transposes) run at the call's precision too.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations._precision import matmul_precision

CallT = TypeVar("CallT")
ConfigT = TypeVar("ConfigT")


class JittedImplementation(Implementation[CallT, ConfigT]):
    """An :class:`Implementation` whose ``__call__`` is :meth:`compute`, jitted at the call's precision."""

    def compute(self, call: CallT, config: ConfigT) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement compute(call, config)")

    # unannotated: the registry's contract check would compare the TypeVars with config_type
    def __call__(self, call, config):
        return _jitted(self, call, config)


@functools.partial(jax.jit, static_argnames=("implementation", "config"))
def _jitted(implementation: JittedImplementation, call: Any, config: Any) -> Any:
    with matmul_precision(call.precision):
        return implementation.compute(call, config)
