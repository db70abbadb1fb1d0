"""Small shared helpers of the Pallas backend's tests: random inputs, error metric, abstract devices, and
the flash-attention reference."""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from ejkernel.modules.operations._precision import matmul_precision
from ejkernel.testing.flash_attention import reference_flash_attention
from ejkernel.testing.numerics import INTERPRET_COMPILER_OPTIONS, program


class InterpretedConformance:
    """Mixin (first base) of a shared conformance suite run through ``platform="pallas"`` on CPU: every test
    runs the TPU kernels in interpret mode, compiled without XLA's CPU optimizations (the interpreted kernels
    are compile-bound on CPU)."""

    platform = "pallas"
    compiler_options = INTERPRET_COMPILER_OPTIONS

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield


FLOAT32_DOTS_TAKE_THE_CALLS_PRECISION = pytest.mark.parametrize(
    "dtype,precision,expected",
    [("float32", None, jax.lax.Precision.HIGHEST), ("float32", "high", jax.lax.Precision.HIGH),
     ("bfloat16", None, jax.lax.Precision.DEFAULT)],
)
"""The cases of a kernel's precision test: Mosaic's default dot is bf16 passes, so a float32 call's
precision must reach the kernel's dots, and a bfloat16 call's dots stay at DEFAULT."""


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def rel_err(actual, expected) -> float:
    a = jnp.asarray(actual, jnp.float32)
    e = jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm((a - e).ravel()) / jnp.maximum(jnp.linalg.norm(e.ravel()), 1e-30))


def flash_call(query, key, value, bias=None, **keywords):
    """The validated ``FlashAttentionCall`` the public ``flash_attention`` would hand a backend."""
    from ejkernel.modules import FlashAttention

    return FlashAttention().validate(query, key, value, bias, **keywords)


def flash_reference(query, key, value, bias=None, **keywords):
    """``docs/flash_attention.md`` computed densely (``ejkernel.testing``), float32 products at full precision."""
    with matmul_precision(jax.lax.Precision.HIGHEST):
        return reference_flash_attention(query, key, value, bias, **keywords).astype(query.dtype)


@contextlib.contextmanager
def abstract_device(device_kind: str, platform: str, num_cores: int = 1):
    """Lower for a device this machine does not have (jax 0.11 reads the target from the abstract mesh)."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
    mesh = AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def equations(fn, *args, primitive: str) -> list:
    """The equations of ``primitive`` in ``fn``'s jaxpr (nested jaxprs and kernel bodies included), in
    program order."""
    return [eqn for _, eqn in program(jax.make_jaxpr(fn)(*args).jaxpr) if eqn.primitive.name == primitive]


def jaxprs(fn, *args) -> list:
    """``fn``'s jaxpr and every jaxpr nested in it that holds an equation, in program order."""
    return list(dict.fromkeys(jaxpr for jaxpr, _ in program(jax.make_jaxpr(fn)(*args).jaxpr)))


def grads_of(fn, argnums):
    """Gradients of a fixed projection of ``fn``'s output (jit-compiled once)."""
    both = out_and_grads(fn, argnums)
    return lambda *args: both(*args)[1]


def out_and_grads(fn, argnums):
    """``(output, gradients)`` of a fixed projection of ``fn``'s output, in one compiled function."""

    def loss(*args):
        out = fn(*args)
        o32 = out.astype(jnp.float32)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(o32 * weights), out

    grad = jax.grad(loss, argnums=argnums, has_aux=True)
    return jax.jit(lambda *args: grad(*args)[::-1])


CONFORMANCE_ENV = "EJKERNEL_PALLAS_CONFORMANCE"


def full_conformance() -> bool:
    """``EJKERNEL_PALLAS_CONFORMANCE=1``: the shared suites at their full size (ring attention on 8
    devices instead of 4); CI runs the CI-sized variant (about 2 minutes on 2 cores, see NOTES.md)."""
    return os.environ.get(CONFORMANCE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
