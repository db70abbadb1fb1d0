"""Plugin discovery: isolation of broken plugins, env controls, cheap side-effect-free import, and
third-party plugins that are really installed (into a fresh virtual environment) winning dispatch."""

from __future__ import annotations

import json
import types

import pytest
from support import REPO, TEST_PLUGINS, clean_env, run

from ejkernel import BackendInfo, hookimpl
from ejkernel.kernels import KernelRegistry
from ejkernel.plugins import PluginHost, PluginWarning


def _plugin(name: str, *, info=None, register=None) -> types.SimpleNamespace:
    namespace = types.SimpleNamespace(__name__=name)
    if info is not None:
        namespace.ejkernel_backend_info = hookimpl(info)
    if register is not None:
        namespace.ejkernel_register_kernels = hookimpl(register)
    return namespace


def _info(name: str, **extra) -> callable:
    return lambda: BackendInfo(name=name, distribution=f"dist-{name}", version="1.0", platforms=("xla",),
                               targets=("cpu",), **extra)


def test_a_good_plugin_registers_lazily_and_is_ok():
    host = PluginHost(KernelRegistry())

    def register(registry, plugin):
        registry.register_lazy("algo", "xla", "any", "json:dumps", plugin=plugin)

    backend = host.load_plugin(_plugin("good", info=_info("good"), register=register), name="good")
    assert backend.status == "ok" and backend.implementations == 1
    assert host.registry.get("algo")({"a": 1}) == '{"a": 1}'


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (_plugin("no_info"), "does not implement the required hook ejkernel_backend_info"),
        (_plugin("wrong_type", info=lambda: {"name": "x"}), "returned dict, expected BackendInfo"),
        (_plugin("future", info=_info("future", api_version=99)), "plugin API 99"),
    ],
)
def test_broken_plugins_are_recorded_and_warned_not_raised(plugin, message):
    host = PluginHost(KernelRegistry())
    with pytest.warns(PluginWarning, match=message):
        backend = host.load_plugin(plugin, name=plugin.__name__)
    assert backend.status.startswith("error:") and message in backend.status


def test_a_hook_that_raises_halfway_leaves_nothing_registered_and_other_plugins_work():
    host = PluginHost(KernelRegistry())

    def explode(registry, plugin):
        registry.register_lazy("algo", "xla", "any", "json:dumps", priority=99, plugin=plugin)
        raise RuntimeError("boom")

    with pytest.warns(PluginWarning, match="RuntimeError: boom"):
        broken = host.load_plugin(_plugin("bad", info=_info("bad"), register=explode), name="bad")
    good = host.load_plugin(
        _plugin("good", info=_info("good"),
                register=lambda registry, plugin: registry.register_lazy("algo", "xla", "any", "json:loads", plugin=plugin)),
        name="good",
    )
    assert broken.implementations == 0 and good.status == "ok"
    assert [s.plugin for s in host.registry.list_implementations("algo")] == ["good"]


def test_availability_check_reasons_and_failures_are_reported():
    host = PluginHost(KernelRegistry())
    unavailable = host.load_plugin(_plugin("u", info=_info("u", check_usable=lambda: "no GPU visible")), name="u")
    assert unavailable.status == "unavailable: no GPU visible"

    def crash():
        raise OSError("driver exploded")

    crashing = host.load_plugin(_plugin("c", info=_info("c", check_usable=crash)), name="c")
    assert crashing.status == "unavailable: availability check raised OSError: driver exploded"


def test_a_raising_shipped_config_hook_is_skipped():
    host = PluginHost(KernelRegistry())
    good = _plugin("g", info=_info("g"))
    good.ejkernel_shipped_configs = hookimpl(lambda algorithm, platform, device_kind: {"k": 1})
    bad = _plugin("b", info=_info("b"))

    def raising(algorithm, platform, device_kind):
        raise KeyError("oops")

    bad.ejkernel_shipped_configs = hookimpl(raising)
    host.load_plugin(good, name="g")
    host.load_plugin(bad, name="b")
    with pytest.warns(PluginWarning, match="ejkernel_shipped_configs raised KeyError"):
        assert host.shipped_configs("a", "xla", "cpu") == {"k": 1}


def _import_probe(env: dict) -> dict:
    code = (
        "import json, os, sys; before = dict(os.environ); import ejkernel; from ejkernel.plugins import backends;"
        "print(json.dumps({'backends': sorted(backends()), 'env_unchanged': before == dict(os.environ),"
        " 'heavy': sorted(m for m in ('triton', 'jax_triton', 'beartype', 'ejkernel_xla.flash_attention')"
        " if m in sys.modules)}))"
    )
    return json.loads(run([str(REPO / ".venv" / "bin" / "python"), "-c", code], env=env).stdout)


def test_import_discovers_all_first_party_backends_without_heavy_imports_or_side_effects(tmp_path):
    env = clean_env(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    probe = _import_probe(env)
    assert probe["backends"] == ["cuda", "pallas", "triton", "xla"]
    assert probe["env_unchanged"] and probe["heavy"] == []
    assert not (tmp_path / "home").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("controls", "expected"),
    [
        ({"EJKERNEL_DISABLE_PLUGIN_AUTOLOAD": "1"}, []),
        ({"EJKERNEL_PLUGINS": "xla,triton"}, ["triton", "xla"]),
        ({"EJKERNEL_BLOCK_PLUGINS": "cuda, pallas"}, ["triton", "xla"]),
    ],
)
def test_env_controls_choose_which_plugins_load(controls, expected):
    assert _import_probe(clean_env(**controls))["backends"] == expected


@pytest.fixture(scope="module")
def third_party_env(make_venv, wheelhouse):
    """core + xla wheels, plus the example and broken plugin distributions, really installed."""
    return make_venv(
        "third_party",
        wheelhouse["ejkernel-core"],
        wheelhouse["ejkernel-xla"],
        TEST_PLUGINS / "ejkernel-example-backend",
        TEST_PLUGINS / "ejkernel-broken-backend",
    )


def test_third_party_and_broken_plugins_are_listed_honestly(third_party_env):
    listing = third_party_env.ejkernel("list-backends", "--json")
    rows = {row["name"]: row for row in json.loads(listing.stdout)}
    assert set(rows) == {"xla", "example", "broken_import", "broken_hook", "broken_api"}
    assert rows["example"]["status"] == "ok" and rows["example"]["distribution"] == "ejkernel-example-backend"
    assert rows["example"]["version"] == "1.2.3" and rows["example"]["implementations"] == 2
    assert "a_package_that_is_not_installed" in rows["broken_import"]["status"]
    assert rows["broken_hook"]["status"] == "error: RuntimeError: registration exploded halfway"
    assert rows["broken_hook"]["implementations"] == 0
    assert "plugin API 99" in rows["broken_api"]["status"]
    # each broken plugin is warned about once, on stderr, without failing the command
    assert listing.stderr.count("was skipped") == 3
    check = third_party_env.ejkernel("list-backends", "--check", check=False)
    assert check.returncode == 1 and "broken_api" in check.stderr
    table = third_party_env.ejkernel("list-backends").stdout
    assert "example" in table and "error: RuntimeError: registration exploded halfway" in table


def test_third_party_plugin_wins_dispatch_by_priority_and_falls_back_when_it_cannot(third_party_env):
    code = """
import warnings; warnings.simplefilter("ignore")
import jax, jax.numpy as jnp, json
from ejkernel import NoConfig
from ejkernel.kernels import kernel_registry
from ejkernel.modules import flash_attention
from ejkernel_example_backend import double, flash_attention as example
q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 8)) for i in range(3))
plain = flash_attention(q, k, v)
calls_after_plain = example.CALLS["flash_attention"]
causal = flash_attention(q, k, v, causal=True)
calls_after_causal = example.CALLS["flash_attention"]
configured = flash_attention(q, k, v, cfg=example.ExampleFlashConfig(probabilities_in_input_dtype=True))
print(json.dumps({
    "top": [s.plugin for s in kernel_registry.list_implementations("flash_attention")][0],
    "plain_calls": calls_after_plain,
    "causal_calls": calls_after_causal - calls_after_plain,
    "cfg_calls": example.CALLS["flash_attention"] - calls_after_causal,
    "new_algorithm": float(kernel_registry.get("example_double")(double.DoubleCall(jnp.ones(())), NoConfig())),
    "finite": bool(jnp.isfinite(plain).all() and jnp.isfinite(causal).all() and (configured == plain).all()),
    "contract": kernel_registry.validate_signatures("flash_attention"),
}))
"""
    result = json.loads(third_party_env.run("-c", code).stdout.strip().splitlines()[-1])
    assert result == {"top": "example", "plain_calls": 1, "causal_calls": 0, "cfg_calls": 1, "new_algorithm": 2.0,
                      "finite": True, "contract": True}


def test_declared_backend_registers_plain_and_per_backend_keys():
    from ejkernel.plugins.declare import DeclaredBackend

    declared = DeclaredBackend(
        name="declared", distribution="dist-declared", platform="pallas", targets=("tpu", "gpu"),
        implementations={"everywhere": "json:dumps", ("tpu_only", "tpu"): "json:loads"}, priority=7,
        check_usable=lambda: "no TPU or GPU visible",
    )
    info_hook, register_hook = declared.hooks()
    module = types.SimpleNamespace(ejkernel_backend_info=info_hook, ejkernel_register_kernels=register_hook)
    host = PluginHost(KernelRegistry())
    backend = host.load_plugin(module, name="declared")
    assert backend.status == "unavailable: no TPU or GPU visible" and backend.implementations == 3
    assert {(s.algorithm, s.backend.value, s.priority) for a in ("everywhere", "tpu_only")
            for s in host.registry.list_implementations(a)} == {
        ("everywhere", "tpu", 7), ("everywhere", "gpu", 7), ("tpu_only", "tpu", 7)}


@pytest.mark.parametrize("requested", [False, True])
def test_declared_backend_registers_unverified_kernels_only_when_asked(monkeypatch, requested):
    from ejkernel.plugins.checks import UNVERIFIED_ENV
    from ejkernel.plugins.declare import DeclaredBackend

    monkeypatch.setenv(UNVERIFIED_ENV, "1" if requested else "0")
    declared = DeclaredBackend(
        name="declared", distribution="dist-declared", platform="pallas", targets=("gpu",),
        implementations={"checked": "json:dumps"}, unverified={"unchecked": "json:loads"},
    )
    info_hook, register_hook = declared.hooks()
    module = types.SimpleNamespace(ejkernel_backend_info=info_hook, ejkernel_register_kernels=register_hook)
    host = PluginHost(KernelRegistry())
    assert host.load_plugin(module, name="declared").implementations == (2 if requested else 1)
    assert bool(host.registry.list_implementations("unchecked")) is requested


def test_a_platform_a_plugin_declares_is_accepted_everywhere_and_undeclared_names_are_refused():
    import dataclasses

    import jax.numpy as jnp

    from ejkernel import Implementation
    from ejkernel.kernels import Platform
    from ejkernel.modules import flash_attention
    from ejkernel.plugins import host

    with pytest.raises(ValueError, match=r"platform='mytpu' is not a platform; .*declares in BackendInfo.platforms"):
        flash_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), platform="mytpu")

    @dataclasses.dataclass(frozen=True)
    class MyTpuConfig:
        scale: float = 1.0

    class MyTpuFlash(Implementation):
        config_type = MyTpuConfig

        def __call__(self, call, config):
            return call.query * config.scale

    def register(registry, plugin):
        registry.register("flash_attention", "mytpu", "any", priority=-1, plugin=plugin)(MyTpuFlash())

    plugins_host = host()
    plugins_host.load_plugin(
        _plugin("mytpu_backend", info=lambda: BackendInfo(name="mytpu_backend", distribution="dist-mytpu", version="1",
                                                         platforms=("mytpu",), targets=("cpu",)),
                register=register),
        name="mytpu_backend",
    )
    try:
        assert Platform("mytpu") is Platform("MyTPU".lower()) == "mytpu" and Platform("mytpu").value == "mytpu"
        assert "mytpu" not in [p.value for p in Platform]  # the spec's five members stay the members
        q = jnp.arange(64.0).reshape(1, 4, 2, 8)
        assert (flash_attention(q, q, q, platform="mytpu") == q).all()
        assert (flash_attention(q, q, q, cfg=MyTpuConfig(scale=2.0)) == 2 * q).all()  # its config selects it
        assert [s.platform for s in plugins_host.registry.find("flash_attention", "mytpu")] == [Platform("mytpu")]
    finally:
        plugins_host.registry.unregister_plugin("mytpu_backend")
        plugins_host.manager.unregister(name="mytpu_backend")
        plugins_host.backends.pop("mytpu_backend", None)

    private = PluginHost(KernelRegistry())
    with pytest.warns(PluginWarning, match="platform name 'My TPU' must be a lower-case identifier"):
        bad = private.load_plugin(_plugin("bad_name", info=lambda: BackendInfo(
            name="bad_name", distribution="d", version="1", platforms=("My TPU",), targets=("cpu",))), name="bad_name")
    assert bad.status.startswith("error: ValueError")
    with pytest.raises(ValueError, match="platform='undeclared_tpu' is not a platform"):
        KernelRegistry().register("a", "undeclared_tpu", "cpu")
