"""Platform resolution: auto picks the best usable implementation that accepts the call and logs what
it passed over; an explicit platform is honoured or refused with a clear error, never replaced."""

from __future__ import annotations

import logging
import types

import jax
import pytest

from ejkernel import BackendInfo, Implementation, NoConfig, UnsupportedFeature, array_field, canonical_call, hookimpl
from ejkernel.errors import KernelNotFoundError
from ejkernel.modules.operations._dispatch import resolve
from ejkernel.plugins import host

ALGORITHM = "dispatch_probe"


@canonical_call
class ProbeCall:
    x: jax.Array = array_field()
    causal: bool = False


def _backend(name: str, platform: str, target: str, priority: int, unusable: str | None = None, refuse=None,
             ranks=None):
    class Probe(Implementation):
        def priority_for(self, call):
            return None if ranks is None else ranks({"causal": call.causal})

        def supports(self, call):
            options = {"causal": call.causal}
            if refuse is not None and refuse(options):
                raise UnsupportedFeature(f"{name} refuses {options}")

        def __call__(self, call, config):
            return name

    module = types.SimpleNamespace(__name__=name)
    module.ejkernel_backend_info = hookimpl(
        lambda: BackendInfo(name=name, distribution=f"dist-{name}", version="1", platforms=(platform,),
                            targets=(target,), check_usable=lambda: unusable)
    )

    def register(registry, plugin):
        registry.register(ALGORITHM, platform, target, priority=priority, plugin=plugin)(Probe())

    module.ejkernel_register_kernels = hookimpl(register)
    return module


@pytest.fixture
def probe_backends():
    """Three backends for ALGORITHM on the process-wide host; removed afterwards."""
    plugins_host = host()
    names = []

    def add(*args, **kwargs):
        plugin = _backend(*args, **kwargs)
        plugins_host.load_plugin(plugin, name=plugin.__name__)
        names.append(plugin.__name__)

    yield add
    for name in names:
        plugins_host.registry.unregister_plugin(name)
        plugins_host.manager.unregister(name=name)
        plugins_host.backends.pop(name, None)


def _call(causal=False):
    return ProbeCall(jax.numpy.ones((2,)), causal=causal)


def _ran(resolution):
    return resolution.implementation(ProbeCall(jax.numpy.ones((2,))), NoConfig())


def test_auto_falls_back_past_unusable_and_refusing_backends_and_logs_why(probe_backends, caplog):
    probe_backends("gpu_fast", "triton", "gpu", 30, unusable="no GPU visible")
    probe_backends("cpu_picky", "pallas", "cpu", 20, refuse=lambda options: options.get("causal"))
    probe_backends("cpu_plain", "xla", "any", 0)
    with caplog.at_level(logging.INFO, logger="ejkernel.dispatch"):
        plain = resolve(ALGORITHM, "auto", _call(causal=False))
        causal = resolve(ALGORITHM, "auto", _call(causal=True))
    assert _ran(plain) == "cpu_picky"
    assert [name for name, _ in plain.skipped] == ["triton (gpu_fast)"]
    assert _ran(causal) == "cpu_plain"
    assert dict(causal.skipped) == {
        "pallas (cpu_picky)": "cpu_picky refuses {'causal': True}",
        "triton (gpu_fast)": "no GPU visible",
    }
    assert "using pallas instead of triton (gpu_fast): no GPU visible" in caplog.text
    assert "using xla instead of pallas (cpu_picky): cpu_picky refuses" in caplog.text
    assert "passed over: pallas (cpu_picky)" in causal.describe()


def test_explicit_platform_is_never_replaced(probe_backends):
    probe_backends("gpu_fast", "triton", "gpu", 30, unusable="no GPU visible")
    probe_backends("cpu_picky", "pallas", "cpu", 20, refuse=lambda options: options.get("causal"))
    probe_backends("cpu_plain", "xla", "any", 0)
    with pytest.raises(KernelNotFoundError, match="platform='triton' cannot run here: no GPU visible"):
        resolve(ALGORITHM, "triton", _call())
    with pytest.raises(UnsupportedFeature, match="platform='pallas' cannot take this call: cpu_picky refuses"):
        resolve(ALGORITHM, "pallas", _call(causal=True))
    assert _ran(resolve(ALGORITHM, "pallas", _call(causal=False))) == "cpu_picky"
    with pytest.raises(KernelNotFoundError, match="platform='cuda'"):
        resolve(ALGORITHM, "cuda", _call())


def test_nothing_can_take_the_call_lists_every_reason(probe_backends):
    probe_backends("gpu_fast", "triton", "gpu", 30, unusable="no GPU visible")
    probe_backends("cpu_picky", "pallas", "cpu", 20, refuse=lambda options: True)
    with pytest.raises(KernelNotFoundError) as info:
        resolve(ALGORITHM, "auto", _call())
    message = str(info.value)
    assert "pallas (cpu_picky): cpu_picky refuses" in message and "triton (gpu_fast): no GPU visible" in message


def test_flash_attention_on_cpu_runs_xla_and_names_the_gpu_backends_it_passed_over():
    from ejkernel.modules import FlashAttention

    q = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
    resolution = FlashAttention().explain(q, q, q, causal=True)
    assert resolution.platform == "xla"
    passed_over = dict(resolution.skipped)
    assert "no GPU visible" in passed_over["triton (triton)"]
    with pytest.raises(KernelNotFoundError, match="platform='triton' cannot run here: no GPU visible"):
        FlashAttention().explain(q, q, q, platform="triton")


def test_auto_ranks_an_implementation_by_its_priority_for_the_call(probe_backends):
    """An implementation measured faster on some calls ranks above a better-registered one for those calls
    alone (``priority_for``); an explicit platform is unaffected."""
    probe_backends("triton_like", "triton", "cpu", 15)
    probe_backends("pallas_like", "pallas", "cpu", 10, ranks=lambda options: 16 if options["causal"] else None)
    assert _ran(resolve(ALGORITHM, "auto", _call(causal=True))) == "pallas_like"
    assert _ran(resolve(ALGORITHM, "auto", _call(causal=False))) == "triton_like"
    assert _ran(resolve(ALGORITHM, "triton", _call(causal=True))) == "triton_like"


def test_hopper_kernels_rank_by_their_measurements():
    """On Hopper, for the calls cuDNN refuses (soft cap, sinks, windows reaching right, ...): ejkernel-cuda's
    native kernels first, then Pallas' Mosaic GPU kernels, then Triton's (measured in that order, the last run on
    an H200, 2026-11-27: the ranks' comments); cuDNN's rank stays above them all."""
    from ejkernel_cuda import plugin as cuda_plugin
    from ejkernel_cuda.flash_attention import NATIVE_PRIORITY
    from ejkernel_pallas.mosaic_attention import MEASURED_PRIORITY
    from ejkernel_triton import plugin as triton_plugin

    assert triton_plugin.BACKEND.priority < MEASURED_PRIORITY < NATIVE_PRIORITY < cuda_plugin.BACKEND.priority
