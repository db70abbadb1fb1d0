"""The Triton mean_pooling on a CPU-only machine: the shared conformance suite in Triton's interpreter (in a
pytest subprocess), a check that it ran the Triton kernels, split sizing, and sm_90 lowering."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules.operations.mean_pooling import MeanPooling
from ejkernel_triton import launch, plugin
from ejkernel_triton.mean_pooling import IMPLEMENTATION, TARGET_PROGRAMS, TritonMeanPoolingConfig, _num_splits
from interpreter_support import CUDA_LOWERING, run_interpreter_suite

SUITE = Path(__file__).with_name("mean_pooling_interpreter_suite.py")


def test_conformance_suite_in_the_interpreter():
    output = run_interpreter_suite(SUITE, 600, "-x")
    assert "skipped" not in output.splitlines()[-1], output[-1000:]


def test_registered():
    assert plugin.IMPLEMENTATIONS["mean_pooling"] == "ejkernel_triton.mean_pooling:IMPLEMENTATION"


def test_splits_fill_the_gpu_only_when_sequences_are_long():
    assert _num_splits(num_seqs=4, tokens=4 * 32768, feature_blocks=2, block_tokens=16) * 4 * 2 >= TARGET_PROGRAMS
    assert _num_splits(num_seqs=4096, tokens=4096 * 512, feature_blocks=2, block_tokens=16) == 1
    assert _num_splits(num_seqs=1, tokens=40, feature_blocks=1, block_tokens=32) == 1


def test_config_checks():
    with pytest.raises(ValueError, match="block_tokens"):
        TritonMeanPoolingConfig(block_tokens=24)
    with pytest.raises(ValueError, match="num_warps"):
        TritonMeanPoolingConfig(num_warps=3)
    call = MeanPooling().validate(jnp.zeros((7, 3, 100), jnp.bfloat16), cu_seqlens=jnp.array([0, 7], jnp.int32))
    config = IMPLEMENTATION.heuristic_config(call)
    assert config.block_features == 512 and config.block_tokens * config.block_features == 8192


@CUDA_LOWERING
def test_fwd_bwd_compile_for_sm90(monkeypatch):
    monkeypatch.setenv(launch.COMPUTE_CAPABILITY_ENV, "90")
    cu = jnp.array([0, 100, 1000, 4000], jnp.int32)

    def loss(x):
        call = MeanPooling().validate(x, cu_seqlens=cu)
        return IMPLEMENTATION(call, IMPLEMENTATION.heuristic_config(call)).astype(jnp.float32).sum()

    text = jax.jit(jax.value_and_grad(loss)).trace(jax.ShapeDtypeStruct((4096, 8, 96), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("triton_kernel_call") == 2
