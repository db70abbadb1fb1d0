"""Dispatch on a CPU-only machine: what the plugin says and what the kernel refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules.operations.flash_attention import FlashAttention
from ejkernel_triton import plugin
from ejkernel_triton.flash_attention import IMPLEMENTATION, TritonFlashConfig, tuning


def _call(dtype=jnp.bfloat16, d=64, **kwargs):
    """A validated call on [1, 128, 4, d] inputs (zeros: only shapes, dtypes and features matter)."""
    q = jnp.zeros((1, 128, 4, d), dtype)
    return FlashAttention().validate(q, q, q, **kwargs)


def test_plugin_lists_flash_attention():
    assert plugin.IMPLEMENTATIONS["flash_attention"] == "ejkernel_triton.flash_attention:IMPLEMENTATION"
    assert IMPLEMENTATION.config_type is TritonFlashConfig


def test_plugin_unusable_without_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible")  # CI machines have none
    reason = plugin.check_usable()
    assert reason and "GPU" in reason


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(bias=jnp.zeros((1, 4, 128, 128), jnp.float32)), "bias"),
        (dict(attention_mask=jnp.ones((1, 1, 128, 128), jnp.bool_)), "attention_mask"),
    ],
)
def test_refuses_unimplemented_features(kwargs, needle):
    with pytest.raises(UnsupportedFeature, match=needle):
        IMPLEMENTATION.supports(_call(**kwargs))


def test_core_refuses_what_the_kernels_never_see():
    """Out-of-range dropout and integer inputs stop at core's validation (a ValueError naming the argument)."""
    with pytest.raises(ValueError, match="dropout_prob"):
        _call(dropout_prob=1.0, dropout_seed=0)
    with pytest.raises(ValueError, match="query"):
        _call(jnp.int8)


def test_refuses_head_dims_outside_8_to_256():
    IMPLEMENTATION.supports(_call(d=256))
    with pytest.raises(UnsupportedFeature, match="head dims"):
        IMPLEMENTATION.supports(_call(d=512))


def test_honours_every_precision():
    for precision in ("default", "high", "highest"):
        IMPLEMENTATION.supports(_call(jnp.float32, precision=precision))


def test_heuristic_and_candidate_configs():
    call = _call(d=128)
    config = IMPLEMENTATION.heuristic_config(call)
    assert isinstance(config, TritonFlashConfig) and config.fwd_block_q and config.dkv_block_kv
    space = IMPLEMENTATION.candidate_configs(call)
    if tuning.shipped_entries(jax.devices()[0].device_kind if jax.default_backend() == "gpu" else ""):
        assert space == ()  # a tuned device kind has nothing to autotune
    else:
        assert len(space) > 1 and space[0] == config


def test_config_fields_are_checked():
    with pytest.raises(ValueError, match="fwd_block_q"):
        TritonFlashConfig(fwd_block_q=48)
    with pytest.raises(ValueError, match="bwd_num_warps"):
        TritonFlashConfig(bwd_num_warps=3)


def _real_qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(kk, (1, 32, 2, 16), jnp.float32) for kk in keys)


def test_auto_falls_back_to_xla_with_reason_logged(caplog):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible")
    from ejkernel.modules.operations.flash_attention import flash_attention

    q, k, v = _real_qkv()
    with caplog.at_level("DEBUG", logger="ejkernel"):
        out = flash_attention(q, k, v, causal=True)
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    text = caplog.text.lower()
    assert "triton" in text and "gpu" in text, caplog.text


def test_explicit_triton_platform_on_cpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible")
    from ejkernel.modules.operations.flash_attention import flash_attention

    q, k, v = _real_qkv()
    with pytest.raises(Exception, match="(?i)triton.*(gpu|usable)|(gpu|usable).*triton"):
        flash_attention(q, k, v, platform="triton")


def test_tuned_tables_for_hopper_only():
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        entry = tuning.shipped_entries(kind)["d128-full"]
        tuned = tuning.heuristic_config(128, 128, jnp.bfloat16, device_kind=kind, causal=False)
        assert (tuned.fwd_block_q, tuned.dkv_block_kv) == (entry["fwd_block_q"], entry["dkv_block_kv"])
        # head dims without an entry keep the shared-memory-safe defaults
        assert tuning.heuristic_config(256, 256, jnp.bfloat16, device_kind=kind).fwd_block_q == 64
    assert tuning.shipped_entries("NVIDIA A100-SXM4-80GB") is None
    assert tuning.heuristic_config(128, 128, jnp.bfloat16, device_kind="NVIDIA A100-SXM4-80GB") == (
        tuning.heuristic_config(128, 128, jnp.bfloat16, device_kind=""))


def test_tuned_device_kind_has_nothing_to_autotune(monkeypatch):
    import ejkernel_triton.flash_attention as fa

    call = _call(d=128)
    monkeypatch.setattr(fa, "gpu_device_kind", lambda: "NVIDIA H200")
    assert IMPLEMENTATION.candidate_configs(call) == ()
    assert IMPLEMENTATION.heuristic_config(call) == tuning.tuned_config("NVIDIA H200", 128, causal=False)
    monkeypatch.setattr(fa, "gpu_device_kind", lambda: "NVIDIA A100-SXM4-80GB")
    assert len(IMPLEMENTATION.candidate_configs(call)) > 1
