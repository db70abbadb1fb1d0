"""Dispatch on a CPU-only machine: what the plugin says and what the kernel refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel import UnsupportedFeature
from ejkernel_triton import plugin
from ejkernel_triton.flash_attention import check_supported, config_space, heuristic_cfg


def _qkv(dtype=jnp.bfloat16, d=64):
    spec = jax.ShapeDtypeStruct((1, 128, 4, d), dtype)
    return spec, spec, spec


def test_plugin_lists_flash_attention():
    assert plugin.IMPLEMENTATIONS["flash_attention"] == "ejkernel_triton.flash_attention:flash_attention"


def test_plugin_unusable_without_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible")  # CI machines have none
    reason = plugin.check_usable()
    assert reason and "GPU" in reason


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(bias=jax.ShapeDtypeStruct((1, 4, 128, 128), jnp.float32)), "bias"),
        (dict(attention_mask=jax.ShapeDtypeStruct((1, 1, 128, 128), jnp.bool_)), "attention_mask"),
        (dict(dropout_prob=1.0, dropout_seed=0), "dropout_prob"),
    ],
)
def test_refuses_unimplemented_features(kwargs, needle):
    q, k, v = _qkv()
    bias = kwargs.pop("bias", None)
    with pytest.raises(UnsupportedFeature, match=needle):
        check_supported(q, k, v, bias, **kwargs)


def test_refuses_bad_dtypes_and_head_dims():
    q, k, v = _qkv(jnp.int8)
    with pytest.raises(UnsupportedFeature, match="dtypes"):
        check_supported(q, k, v)
    q, k, v = _qkv(d=512)
    with pytest.raises(UnsupportedFeature, match="head dims"):
        check_supported(q, k, v)


def test_heuristic_and_config_space():
    class Inv:
        args = _qkv(d=128)
        kwargs = {}

    cfg = heuristic_cfg(Inv())
    assert cfg.fwd_params.q_blocksize and cfg.bwd_params.kv_blocksize
    space = config_space(Inv())
    assert len(space) > 1 and space[0] == cfg


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


def test_shipped_configs_for_hopper_only():
    import jax.numpy as jnp

    from ejkernel_triton.flash_attention import heuristic_tuning

    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        table = plugin.ejkernel_shipped_configs("flash_attention", "triton", kind)
        assert set(table) == {"*"} and table["*"].fwd_params is None  # blocks come from the tuned table
        tuned = heuristic_tuning(128, 128, jnp.bfloat16, device_kind=kind, causal=False)
        entry = plugin.tuned_entries(kind)["d128-full"]
        assert (tuned.fwd_block_q, tuned.dkv_block_kv) == (entry["fwd_block_q"], entry["dkv_block_kv"])
        # head dims without an entry keep the shared-memory-safe defaults
        assert heuristic_tuning(256, 256, jnp.bfloat16, device_kind=kind).fwd_block_q == 64
    assert plugin.ejkernel_shipped_configs("flash_attention", "triton", "NVIDIA A100-SXM4-80GB") is None
    assert plugin.ejkernel_shipped_configs("page_attention", "triton", "NVIDIA H200") is None
