"""The Triton native_sparse_attention on a CPU-only machine: the shared conformance suite in Triton's
interpreter (in a pytest subprocess, with a check that the kernels ran), registration (only in the
interpreter or under EJKERNEL_UNVERIFIED_KERNELS=1 until a GPU run has checked it), refusals, configs, the
inverted index of the dK/dV kernel, and sm_90 lowering of the forward and backward."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations.native_sparse_attention import NativeSparseAttention
from ejkernel.testing.native_sparse_attention import random_block_indices
from ejkernel_triton import launch
from ejkernel_triton.native_sparse_attention import IMPLEMENTATION, TritonNsaConfig, _inverted_index
from interpreter_support import CUDA_LOWERING, run_interpreter_suite

SUITE = Path(__file__).with_name("native_sparse_attention_interpreter_suite.py")


def test_conformance_suite_in_the_interpreter():
    output = run_interpreter_suite(SUITE, 900, "-x")
    assert "skipped" not in output.splitlines()[-1], output[-1000:]


def _call(head_dim=64, block_size=64, **kw):
    q = jnp.zeros((1, 256, 4, head_dim), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, head_dim), jnp.bfloat16)
    g = jnp.zeros((1, 256, 4), jnp.bfloat16)
    return NativeSparseAttention().validate(q, k, k, g_cmp=g, block_counts=4, block_size=block_size, **kw)


@pytest.mark.parametrize("kw,match", [(dict(head_dim=8), "head dims 8/8"), (dict(head_dim=512), "head dims 512"),
                                      (dict(block_size=256), "block_size 256")])
def test_refuses_what_the_xla_implementation_takes(kw, match):
    with pytest.raises(UnsupportedFeature, match=match):
        IMPLEMENTATION.supports(_call(**kw))


def test_config_checks():
    with pytest.raises(ValueError, match="block_tokens"):
        TritonNsaConfig(block_tokens=8)
    with pytest.raises(ValueError, match="num_warps"):
        TritonNsaConfig(num_warps=3)
    assert IMPLEMENTATION.heuristic_config(_call()) in IMPLEMENTATION.candidate_configs(_call())


def test_inverted_index_lists_each_selection_once_by_block():
    slots = jnp.asarray([[[[0, -1]], [[1, 0]], [[-1, -1]], [[2, 1]]]], jnp.int32)  # [B=1, T=4, HK=1, n=2]
    tokens, starts = _inverted_index(slots, num_blocks=3)
    tokens, starts = np.asarray(tokens[0]), np.asarray(starts[0])
    by_block = [sorted(tokens[starts[c]:starts[c + 1]].tolist()) for c in range(3)]
    assert by_block == [[0, 1], [1, 3], [3]]
    assert starts[-1] == 5  # the cleaned-away slots sort after the last block


@CUDA_LOWERING
@pytest.mark.parametrize("dtype,group", [("bfloat16", 16), ("float32", 1)])
def test_forward_and_backward_compile_for_sm90(monkeypatch, dtype, group):
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    seq, kv_heads, d = 512, 2, 128
    indices = random_block_indices(0, 1, seq, kv_heads, 4, 64)

    def loss(q, k, v):
        call = NativeSparseAttention().validate(q, k, v, block_indices=indices, block_counts=4, block_size=64)
        return IMPLEMENTATION(call, IMPLEMENTATION.heuristic_config(call)).astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((1, seq, kv_heads * group, d), dtype)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, d), dtype)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == 3  # forward, dQ, dK/dV
