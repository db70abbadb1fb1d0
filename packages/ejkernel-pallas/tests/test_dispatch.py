"""How the Pallas backend registers and routes on a CPU machine: interpret mode, or a clear refusal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import flash_call, flash_reference, normal, rel_err

from ejkernel import UnsupportedFeature
from ejkernel.modules import FlashAttention, flash_attention
from ejkernel_pallas import gpu_flash_attention, plugin, tpu_flash_attention
from ejkernel_pallas.interpret import INTERPRET_ENV, interpret_mode

TPU_TARGET = "ejkernel_pallas.tpu_flash_attention:IMPLEMENTATION"
GPU_TARGET = "ejkernel_pallas.gpu_flash_attention:IMPLEMENTATION"


def test_registers_flash_attention_per_hardware_and_cpu_only_in_interpret_mode():
    assert {k: v for k, v in plugin.implementations(None).items() if k[0] == "flash_attention"} == {
        ("flash_attention", "tpu"): TPU_TARGET, ("flash_attention", "gpu"): GPU_TARGET,
    }
    # interpret mode registers, for the CPU, the family its value names (the TPU kernels but for "gpu")
    for mode, target in (("generic", TPU_TARGET), ("races", TPU_TARGET), ("gpu", GPU_TARGET)):
        assert plugin.implementations(mode)[("flash_attention", "cpu")] == target
    assert plugin.implementations("gpu")[("grouped_matmul", "cpu")].startswith("ejkernel_pallas.grouped_matmul:")
    backends = {backend for (algorithm, backend) in plugin.IMPLEMENTATIONS if algorithm == "flash_attention"}
    assert backends == ({"tpu", "gpu", "cpu"} if plugin.interpret_requested() else {"tpu", "gpu"})


def test_cpu_without_interpret_mode_is_refused_with_the_fix(monkeypatch):
    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    q = jnp.ones((1, 8, 1, 16))
    for implementation in (tpu_flash_attention.IMPLEMENTATION, gpu_flash_attention.IMPLEMENTATION):
        with pytest.raises(UnsupportedFeature) as info:
            implementation.supports(flash_call(q, q, q))
        message = str(info.value)
        # ejkernel-xla is installed here: the message says auto falls back to it (not "pip install" it)
        assert "need a TPU or GPU" in message and f"{INTERPRET_ENV}=1" in message
        assert "platform='auto' runs the installed XLA backend (ejkernel-xla)" in message and "pip install" not in message
        with pytest.raises(UnsupportedFeature, match="need a TPU or GPU"):
            implementation(flash_call(q, q, q), implementation.heuristic_config(flash_call(q, q, q)))
    assert plugin.check_usable() is not None and "EJKERNEL_PALLAS_INTERPRET" in plugin.check_usable()


def test_need_device_message_is_true_for_the_environment(monkeypatch):
    """With the XLA backend loaded: auto falls back to it; without (or broken): how to install it."""
    import ejkernel.plugins
    from ejkernel_pallas.interpret import need_device_message, xla_backend_loaded

    assert xla_backend_loaded()
    assert "platform='xla'" in need_device_message()
    pallas_only = {name: b for name, b in ejkernel.plugins.backends().items() if "xla" not in b.platforms}
    monkeypatch.setattr(ejkernel.plugins, "backends", lambda: pallas_only)
    assert not xla_backend_loaded()
    message = need_device_message()
    assert "pip install ejkernel-xla" in message and f"{INTERPRET_ENV}=1" in message
    assert "installed XLA backend" not in message


def test_interpret_env_values(monkeypatch):
    for value, mode in (("0", None), ("1", "generic"), ("tpu", "tpu"), ("races", "races"), ("gpu", "gpu")):
        monkeypatch.setenv(INTERPRET_ENV, value)
        assert interpret_mode() == mode
    monkeypatch.setenv(INTERPRET_ENV, "yes please")
    with pytest.raises(ValueError, match=INTERPRET_ENV):
        interpret_mode()


@pytest.mark.parametrize(
    "registrations, implementation",
    [
        ("pallas_interpret", tpu_flash_attention.IMPLEMENTATION),
        ("pallas_interpret_gpu", gpu_flash_attention.IMPLEMENTATION),
    ],
)
def test_interpret_mode_runs_its_kernels_on_cpu(request, registrations, implementation):
    """``platform="pallas"`` on CPU runs the family the interpret mode registered."""
    request.getfixturevalue(registrations)
    assert plugin.check_usable() is None
    ks = jax.random.split(jax.random.key(31), 3)
    q, k, v = (normal(kk, (1, 16, 2, 16)) for kk in ks)
    assert FlashAttention().explain(q, k, v, causal=True, platform="pallas").implementation.resolve() is implementation
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, softmax_scale=0.5, causal=True, platform="pallas"))(q, k, v)
    assert rel_err(out, flash_reference(q, k, v, softmax_scale=0.5, causal=True)) < 2e-6
