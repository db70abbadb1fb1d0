"""Shipped configs from plugins, vmap/pmap with one selection, device and sharding fingerprints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_toy_kernels import ToyConfig, ToyMatmul, random_inputs

import ejkernel.plugins as plugins
from ejkernel import BackendInfo, hookimpl
from ejkernel.kernels import KernelRegistry
from ejkernel.ops import (
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    default_key_builder_with_sharding,
    device_fingerprint,
    device_kind,
    device_model,
    get_device_platform,
    pmap_with_config,
    sharding_fingerprint,
    to_json,
    vmap_with_config,
)
from ejkernel.plugins import PluginWarning

HERE = Path(__file__).parent


class ShippingPlugin:
    def __init__(self, table):
        self.table, self.calls = table, []

    @hookimpl
    def ejkernel_backend_info(self):
        return BackendInfo(name="shipping", distribution="test", version="0", platforms=("xla",), targets=("cpu",))

    @hookimpl
    def ejkernel_shipped_configs(self, algorithm, platform, device_kind):
        self.calls.append((algorithm, platform, device_kind))
        return self.table.get(algorithm)


@pytest.fixture
def private_host(monkeypatch):
    host = plugins.PluginHost(KernelRegistry())
    monkeypatch.setattr(plugins, "_host", host)
    return host


def test_shipped_configs_come_before_autotuning_and_match_by_signature(private_host):
    kernel = ToyMatmul(space=(ToyConfig(block=4),))
    x, w = random_inputs()
    inv = Invocation(kernel, (x, w))
    plugin = ShippingPlugin(
        {"toy_matmul": {inv.signature: json.loads(to_json(ToyConfig(block=2))), "*": ToyConfig(block=16)}}
    )
    private_host.load_plugin(plugin, name="shipping")
    chain = ConfigSelectorChain(cache=ConfigCache(), autotune=True)
    assert chain.select(inv) == (ToyConfig(block=2), "shipped")
    assert plugin.calls == [("toy_matmul", "xla", device_model())]
    assert chain.select(Invocation(kernel, random_inputs(m=32))) == (ToyConfig(block=16), "shipped")  # "*"
    assert chain.select(Invocation(ToyMatmul(name="unshipped"), (x, w))).source == "autotune"


def test_a_broken_shipped_hook_is_warned_about_and_skipped(private_host):
    class Broken(ShippingPlugin):
        @hookimpl
        def ejkernel_shipped_configs(self, algorithm, platform, device_kind):
            return ["not", "a", "mapping"]

    private_host.load_plugin(Broken({}), name="broken")
    kernel = ToyMatmul()
    with pytest.warns(PluginWarning, match="expected a mapping"):
        selection = ConfigSelectorChain(cache=ConfigCache()).select(Invocation(kernel, random_inputs()))
    assert selection.source == "heuristic"


def test_vmap_with_config_selects_once_from_per_example_shapes():
    kernel = ToyMatmul()
    chain = ConfigSelectorChain(cache=ConfigCache(), shipped=False)
    executor = Executor(chain)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((3, 8, 4)), jnp.float32)
    out = vmap_with_config(kernel, in_axes=(0, 0), executor=executor)(xs, ws, scale=2.0)
    np.testing.assert_allclose(out, np.einsum("bmk,bkn->bmn", xs, ws) * 2.0, rtol=1e-5)
    assert kernel.heuristic_calls == 1
    assert list(chain._heuristics) == [Invocation(kernel, (xs[0], ws[0]), {"scale": 2.0}).cache_key]
    pinned = vmap_with_config(kernel, in_axes=(0, None), executor=executor)(xs, ws[0], cfg=ToyConfig(block=4))
    np.testing.assert_allclose(pinned, np.einsum("bmk,kn->bmn", xs, ws[0]), rtol=1e-5)


def test_pmap_with_config_runs_per_device():
    kernel = ToyMatmul()
    executor = Executor(ConfigSelectorChain(cache=ConfigCache(), shipped=False))
    n = jax.local_device_count()
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((n, 8, 4)), jnp.float32)
    ws = jnp.asarray(np.random.default_rng(2).standard_normal((n, 4, 2)), jnp.float32)
    out = pmap_with_config(kernel, axis_name="devices", executor=executor)(xs, ws)
    np.testing.assert_allclose(out, np.einsum("bmk,bkn->bmn", xs, ws), rtol=1e-5)


def test_device_helpers():
    assert device_kind() == "cpu" and get_device_platform() == "xla" and device_model() == "cpu"
    fingerprint = device_fingerprint()
    assert fingerprint == device_fingerprint(jax.devices()[0])
    assert f"jax={jax.__version__}" in fingerprint and "kind=cpu" in fingerprint


def test_sharding_fingerprint_only_for_multi_device_layouts():
    x = jnp.ones((4, 2))
    assert sharding_fingerprint(x) is None  # one device
    assert sharding_fingerprint(jax.ShapeDtypeStruct((4, 2), jnp.float32)) is None
    kernel = ToyMatmul()
    assert default_key_builder_with_sharding(kernel, (x, x.T)) == Invocation(kernel, (x, x.T)).cache_key


_SUBPROCESS = textwrap.dedent(
    """
    import json, os, sys
    import ejkernel.ops
    report = {{"heavy": sorted(m for m in ("jax", "beartype", "jaxtyping") if m in sys.modules),
               "created": os.path.exists(os.environ["EJKERNEL_CACHE_DIR"])}}
    sys.path.insert(0, {here!r})
    from ops_toy_kernels import ToyMatmul, random_inputs
    from ejkernel.ops import Invocation
    report["key"] = Invocation(ToyMatmul(), random_inputs(), {{"scale": 0.5, "mode": ("a", None)}}).cache_key

    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from ejkernel.ops import default_key_builder_with_sharding, sharding_fingerprint
    mesh = Mesh(jax.devices()[:2], ("data",))
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, PartitionSpec("data")))
    w = jnp.ones((8, 2))
    report["sharding"] = sharding_fingerprint(x)
    report["plain"] = Invocation(ToyMatmul(), (x, w)).cache_key
    report["sharded"] = default_key_builder_with_sharding(ToyMatmul(), (x, w), {{}})
    print(json.dumps(report))
    """
)


def test_import_is_cheap_and_keys_are_stable_across_processes(tmp_path):
    env = {
        **os.environ,
        "EJKERNEL_CACHE_DIR": str(tmp_path / "never-created"),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",  # a real two-device layout
    }
    result = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS.format(here=str(HERE))], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [] and report["created"] is False
    assert (
        report["key"] == Invocation(ToyMatmul(), random_inputs(seed=5), {"scale": 0.5, "mode": ("a", None)}).cache_key
    )
    assert report["sharding"] == "mesh(data=2)spec('data',)"
    assert report["plain"] == Invocation(ToyMatmul(), (jnp.ones((4, 8)), jnp.ones((8, 2)))).cache_key
    assert report["sharded"] == report["plain"].replace("float32[4,8]", "float32[4,8]@mesh(data=2)spec('data',)")


def test_a_kernel_can_ask_for_sharding_in_its_keys():
    class Sharded(ToyMatmul):
        key_includes_sharding = True

    assert Invocation(Sharded(), random_inputs()).include_sharding
    assert Executor(ConfigSelectorChain()).invocation(Sharded(), *random_inputs()).include_sharding
    assert not Invocation(ToyMatmul(), random_inputs()).include_sharding
