"""The shared native_sparse_attention conformance suite with platform="triton", run in Triton's interpreter
(collected only by test_native_sparse_attention.py, in a pytest subprocess started with TRITON_INTERPRET=1:
the variable has to be set before triton is imported)."""

from __future__ import annotations

import os

import pytest

from ejkernel.testing.native_sparse_attention import NativeSparseAttentionConformance

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (through test_native_sparse_attention.py)", allow_module_level=True)


class TestTritonNativeSparseAttentionInterpreted(NativeSparseAttentionConformance):
    platform = "triton"

    # Triton's interpreter computes on numpy, which has no bfloat16 (its bf16 dots come out wrong): float32
    # and float16 here, bfloat16 in the GPU suite.
    @pytest.mark.parametrize("dtype", ["float32", "float16"])
    def test_forward_and_gradients(self, dtype):
        super().test_forward_and_gradients(dtype)


def test_the_kernels_run(monkeypatch):
    """The suite above goes through the Triton kernels: forward, dQ and dK/dV are launched."""
    import jax
    import jax.numpy as jnp

    from ejkernel.modules import native_sparse_attention
    from ejkernel_triton import native_sparse_attention as module

    launched = []

    def counting(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        return real(kernel, *args, **kwargs)

    real = module.launch
    monkeypatch.setattr(module, "launch", counting)
    # a shape no other test used: a cached trace would launch nothing
    inputs, static = NativeSparseAttentionConformance().make_inputs(8, (3, 21, 4, 2, 32, 32, 8, 3), "float32")

    def loss(q):
        return jnp.sum(native_sparse_attention(**{**inputs, "query": q}, **static, platform="triton") ** 2)

    jax.grad(loss)(inputs["query"])
    assert {"_forward_kernel", "_dq_kernel", "_dkv_kernel"} <= set(launched), launched
