"""The examples of the spec's overview and modules-base pages run unchanged (registry examples:
test_registry.py; ops-framework examples: packages/ejkernel-core/tests/ops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.kernels import Platform
from ejkernel.testing._attention_reference import reference_flash_attention
from ejkernel.testing.numerics import jax_float64, relative_error


def test_project_overview_usage_example():
    from ejkernel.modules import FlashAttention, create_default_executor

    # Initialize
    with pytest.warns(DeprecationWarning, match="create_default_executor"):
        executor = create_default_executor()
    attention = FlashAttention()
    # Create inputs
    batch, seq_len, num_heads, head_dim = 2, 1024, 8, 64
    key = jax.random.PRNGKey(0)
    q = k = v = jax.random.normal(key, (batch, seq_len, num_heads, head_dim))
    # Execute attention with automatic optimization
    output = executor(
        attention, q, k, v,
        causal=True,
        dropout_prob=0.1,
        logits_soft_cap=30.0  # Gemma-2 style soft capping
    )
    assert output.shape == (batch, seq_len, num_heads, head_dim) and bool(jnp.isfinite(output).all())
    with jax.enable_x64(True):
        expected = reference_flash_attention(
            *jax_float64((q, k, v)), causal=True, dropout_prob=0.1, dropout_seed=0, logits_soft_cap=30.0
        )
    assert relative_error(output, expected) < 1e-5


def test_modules_base_examples(tmp_path):
    from ejkernel.modules.base import create_default_executor

    batch, seq_len, num_heads, head_dim = 1, 128, 2, 32
    q = k = v = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, num_heads, head_dim))

    with pytest.warns(DeprecationWarning):
        executor = create_default_executor(str(tmp_path / "kernel_cache"))

    from ejkernel.ops import AutotunePolicy, ConfigCache, ConfigSelectorChain, Executor, PersistentCache, Tuner

    executor = Executor(
        ConfigSelectorChain(
            cache=ConfigCache(),
            policy=AutotunePolicy(allow_autotune=True),
            tuner=Tuner(warmup=2, iters=5),
            persistent=PersistentCache(str(tmp_path / "kernel_cache")),
        )
    )

    from ejkernel.modules import FlashAttention

    attn = FlashAttention()
    output = executor(attn, q, k, v, causal=True)
    assert output.shape == q.shape


def test_detect_platform_examples():
    from ejkernel.modules.base import detect_platform

    platform = detect_platform("flash_attention", platform="auto")
    assert platform == Platform.XLA  # the only usable flash_attention on a CPU-only machine
    platform = detect_platform("flash_attention", platform="xla")
    assert platform == Platform.XLA
    assert f"Selected: {detect_platform('flash_attention')}" == "Selected: xla"
    with pytest.raises(ValueError, match="not available for 'flash_attention'"):
        detect_platform("flash_attention", platform="cute")


def test_kernel_config_defaults_and_validation():
    from ejkernel.modules.base import KernelConfig

    config = KernelConfig()
    assert (config.block_q, config.block_k, config.block_d, config.num_warps, config.num_stages) == (128, 128, 64, 4, 2)
    assert config.platform == "auto" and config.backend == "any" and config.priority == 0
    with pytest.raises(ValueError, match="KernelConfig.block_q"):
        KernelConfig(block_q=0)
    with pytest.raises(ValueError, match="KernelConfig.platform"):
        KernelConfig(platform="tpu-magic")
