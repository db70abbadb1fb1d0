"""Small shared helpers of the Pallas backend's tests: random inputs, error metric, abstract devices."""

from __future__ import annotations

import contextlib
import os
import types

import jax
import jax.numpy as jnp
from jax._src.mesh import AbstractDevice, AbstractMesh

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def rel_err(actual, expected) -> float:
    a = jnp.asarray(actual, jnp.float32)
    e = jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm((a - e).ravel()) / jnp.maximum(jnp.linalg.norm(e.ravel()), 1e-30))


def blocks(fwd_q=None, fwd_kv=None, bwd_q=None, bwd_kv=None, dq_q=None, dq_kv=None):
    """A stand-in for FlashAttentionConfig carrying only block sizes."""
    return types.SimpleNamespace(
        fwd_params=FwdParams(q_blocksize=fwd_q, kv_blocksize=fwd_kv),
        bwd_params=BwdParams(q_blocksize=bwd_q, kv_blocksize=bwd_kv, blocksize_m=dq_q, blocksize_n=dq_kv),
    )


@contextlib.contextmanager
def abstract_device(device_kind: str, platform: str, num_cores: int = 1):
    """Lower for a device this machine does not have (jax 0.11 reads the target from the abstract mesh)."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform))
    with jax.sharding.use_abstract_mesh(mesh):
        yield


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
