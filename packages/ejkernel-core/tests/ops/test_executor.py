"""Executor, invocation keys, config-selection order, policies and JAX transformation composition."""

from __future__ import annotations

import contextvars
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_toy_kernels import PlatformKernel, SpecVjpKernel, ToyConfig, ToyMatmul, TupleVjpKernel, random_inputs

from ejkernel.ops import (
    AutotunePolicy,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    PersistentCache,
    Tuner,
    overlay_cache,
    policy_override,
)


def make_chain(tmp_path=None, **kwargs):
    kwargs.setdefault("tuner", Tuner(warmup=0, iters=1))
    kwargs.setdefault("shipped", False)
    if tmp_path is not None:
        kwargs.setdefault("persistent", PersistentCache(tmp_path / "cache"))
    return ConfigSelectorChain(cache=ConfigCache(), **kwargs)


def test_basic_run_matches_reference():
    x, w = random_inputs()
    out = Executor(make_chain())(ToyMatmul(), x, w, scale=2.0)
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w) * 2.0, rtol=1e-5)


def test_cache_key_names_kernel_shapes_static_args_and_device_not_values():
    kernel = ToyMatmul()
    x, w = random_inputs(seed=0)
    x2, w2 = random_inputs(seed=1)
    key = Invocation(kernel, (x, w), {"scale": 2.0}).cache_key
    assert key == Invocation(kernel, (x2, w2), {"scale": 2.0}).cache_key  # values do not matter
    assert key.startswith("toy_matmul@1|") and "float32[16,8]" in key and "scale=2.0" in key
    assert "jax=" in key and "jaxlib=" in key and "kind=cpu" in key
    assert key != Invocation(kernel, (x, w), {"scale": 3.0}).cache_key  # static args do
    assert key != Invocation(kernel, (x.astype(jnp.bfloat16), w), {"scale": 2.0}).cache_key  # dtypes do
    assert key != Invocation(kernel, random_inputs(m=32), {"scale": 2.0}).cache_key  # shapes do

    class Bumped(ToyMatmul):
        version = "2"

    assert key != Invocation(Bumped(), (x, w), {"scale": 2.0}).cache_key  # kernel version does


def test_abstract_args_and_kwargs():
    x, w = random_inputs()
    inv = Invocation(ToyMatmul(), (x, w), {"scale": 2.0, "bias": w})
    assert inv.abstract_args == (jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    assert inv.abstract_kwargs["scale"] == 2.0
    assert isinstance(inv.abstract_kwargs["bias"], jax.ShapeDtypeStruct)
    assert inv.abstracted().cache_key == inv.cache_key


def test_full_selection_order(tmp_path):
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(block=16)))
    x, w = random_inputs()
    shipped = {}
    chain = make_chain(tmp_path, policy=AutotunePolicy(allow_autotune=True), shipped=lambda inv: shipped.get("cfg"))
    executor = Executor(chain)
    inv = executor.invocation(kernel, x, w)
    key = inv.cache_key
    cfgs = {name: ToyConfig(block=b) for name, b in [("overlay", 1), ("cache", 2), ("persistent", 16), ("shipped", 4)]}
    chain.cache.put(key, cfgs["cache"])
    chain.persistent.put(key, cfgs["persistent"])
    shipped["cfg"] = cfgs["shipped"]
    explicit = ToyConfig(block=2)

    with overlay_cache({key: cfgs["overlay"]}):
        assert chain.select(inv) == (cfgs["overlay"], "overlay")
        assert executor.choose(kernel, x, w) == cfgs["overlay"]
    assert chain.select(inv) == (cfgs["cache"], "cache")
    chain.cache.clear()
    assert chain.select(inv) == (cfgs["persistent"], "persistent")
    assert chain.cache.get(key) == cfgs["persistent"]  # promoted to memory
    chain.cache.clear()
    chain.persistent.delete(key)
    assert chain.select(Invocation(kernel, (x, w))) == (cfgs["shipped"], "shipped")

    # Autotuning (no shipped config for a new key) stores the winner in memory and on disk.
    x2, w2 = random_inputs(m=32)
    cfg, source = chain.select(Invocation(kernel, (x2, w2)))
    assert source == "shipped"
    shipped.clear()
    inv2 = Invocation(ToyMatmul(name="other", space=(ToyConfig(block=4),)), (x2, w2))
    cfg, source = chain.select(inv2)
    assert source == "autotune" and cfg in (ToyConfig(block=4), ToyConfig(block=8))
    assert chain.cache.get(inv2.cache_key) == cfg and PersistentCache(tmp_path / "cache").get(inv2.cache_key) == cfg

    # Heuristics last; the explicit cfg= beats everything and is never cached.
    with policy_override(autotune=False):
        inv3 = Invocation(ToyMatmul(name="third"), (x2, w2))
        assert chain.select(inv3) == (ToyConfig(block=8), "heuristic")
    with overlay_cache({key: cfgs["overlay"]}):
        out = executor(kernel, x, w, cfg=explicit)
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-5)
    assert explicit not in [c for _, c in chain.cache.items()]
    assert explicit not in [c for _, c in chain.persistent.items()]


@pytest.mark.parametrize("policy", ["autotune", "heuristics"])
def test_explicit_cfg_is_used_exactly_under_every_policy(monkeypatch, tmp_path, policy):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", policy)
    seen = []

    class Spy(ToyMatmul):
        def run(self, x, w, *, cfg, scale=1.0):
            seen.append(cfg)
            return super().run(x, w, cfg=cfg, scale=scale)

    chain = make_chain(tmp_path, policy=AutotunePolicy(allow_autotune=True))
    x, w = random_inputs()
    explicit = ToyConfig(block=2)
    Executor(chain)(Spy(), x, w, cfg=explicit)
    assert seen == [explicit]
    assert len(chain.cache) == 0 and len(chain.persistent) == 0


def test_prepare_runs_first_and_its_platform_enters_the_key():
    class Preparing(PlatformKernel):
        def prepare(self, x, *, platform="auto"):
            if not hasattr(x, "shape"):
                raise TypeError(f"x must be an array, got {type(x).__name__}")
            return (x,), {"platform": "triton" if platform == "auto" else platform}

    kernel = Preparing()
    executor = Executor(make_chain())
    x = jnp.arange(3.0)
    np.testing.assert_allclose(executor(kernel, x), x + 3)
    assert kernel.seen_platform == [("run_triton", "triton")]
    assert 'platform="triton"' in executor.invocation(kernel, x).cache_key
    with pytest.raises(TypeError, match="x must be an array"):
        executor(kernel, [1.0])


def test_platform_method_dispatch_and_explicit_platform_untouched():
    kernel = PlatformKernel()
    executor = Executor(make_chain())
    x = jnp.arange(3.0)
    np.testing.assert_allclose(executor(kernel, x), x + 2)  # CPU -> run_xla
    np.testing.assert_allclose(executor(kernel, x, platform="triton"), x + 3)
    np.testing.assert_allclose(executor(kernel, x, platform="pallas"), x + 1)  # no run_pallas -> run
    assert kernel.seen_platform == [("run_xla", None), ("run_triton", "triton"), ("run", "pallas")]


def test_jit_selects_at_trace_time_from_abstract_shapes():
    kernel = ToyMatmul()
    chain = make_chain()
    executor = Executor(chain)
    x, w = random_inputs()
    traced = jax.jit(lambda x, w: executor(kernel, x, w, scale=0.5))
    np.testing.assert_allclose(traced(x, w), np.asarray(x) @ np.asarray(w) * 0.5, rtol=1e-5)
    calls = kernel.heuristic_calls
    traced(x + 1, w)  # cached trace: no selection at run time
    assert kernel.heuristic_calls == calls
    assert executor.invocation(kernel, x, w, scale=0.5).cache_key in chain._heuristics


@pytest.mark.parametrize("kernel_type", [SpecVjpKernel, TupleVjpKernel])
def test_custom_vjp_composes_with_jit_grad_vmap(kernel_type):
    kernel = kernel_type()
    executor = Executor(make_chain())
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)

    def reference(x, w):
        if kernel_type is SpecVjpKernel:
            return jnp.sum(x * w)
        a, b = jnp.sin(x) * w, x + w
        return jnp.sum(a) + jnp.sum(b * b)

    def through_kernel(x, w):
        out = executor(kernel, x, w)
        if kernel_type is SpecVjpKernel:
            return jnp.sum(out)
        return jnp.sum(out[0]) + jnp.sum(out[1] * out[1])

    want = jax.grad(reference, argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(through_kernel, argnums=(0, 1)))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert kernel.backward_calls >= 1
    per_row = jax.vmap(jax.grad(lambda x, w: through_kernel(x[None], w[None])))(x, w)
    np.testing.assert_allclose(per_row, want[0], rtol=1e-5, atol=1e-6)


def test_custom_vjp_keyword_arrays_get_no_gradient_and_static_kwargs_pass():
    kernel = SpecVjpKernel()
    executor = Executor(make_chain())
    x, w = jnp.ones(3), jnp.arange(3.0)
    grads = jax.grad(lambda x, o: jnp.sum(executor(kernel, x, w, offset=o)), argnums=(0, 1))(x, jnp.ones(3))
    np.testing.assert_allclose(grads[0], w)
    np.testing.assert_allclose(grads[1], jnp.zeros(3))


def test_kernel_without_custom_vjp_is_differentiated_by_jax():
    kernel = ToyMatmul()
    executor = Executor(make_chain())
    x, w = random_inputs()
    got = jax.grad(lambda x: jnp.sum(executor(kernel, x, w, scale=3.0)))(x)
    np.testing.assert_allclose(got, np.broadcast_to(np.asarray(w).sum(1) * 3.0, x.shape), rtol=1e-5)


def test_policy_override_is_context_local():
    seen = {}
    barrier = threading.Barrier(2)

    def other_thread():
        barrier.wait()
        from ejkernel.ops.config.selection import effective_policy

        seen["other"] = effective_policy(AutotunePolicy(allow_autotune=True)).allow_autotune

    thread = threading.Thread(target=other_thread)
    thread.start()
    with policy_override(autotune=False):
        from ejkernel.ops.config.selection import effective_policy

        seen["inside"] = effective_policy(AutotunePolicy(allow_autotune=True)).allow_autotune
        barrier.wait()
        thread.join()
        seen["copied context"] = contextvars.copy_context().run(
            lambda: effective_policy(AutotunePolicy(allow_autotune=True)).allow_autotune
        )
    assert seen == {"inside": False, "other": True, "copied context": False}
    with pytest.raises(TypeError, match="unknown field"):
        with policy_override(autotune_everything=True):
            pass


def test_env_policy_switch(monkeypatch):
    from ejkernel.ops.config.selection import effective_policy

    base = AutotunePolicy(allow_autotune=False)
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    assert effective_policy(base).allow_autotune is True
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    assert effective_policy(AutotunePolicy(allow_autotune=True)).allow_autotune is False
    with policy_override(allow_autotune=True):  # code in context beats the environment
        assert effective_policy(base).allow_autotune is True
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "sometimes")
    with pytest.warns(UserWarning, match="EJKERNEL_AUTOTUNE_POLICY='sometimes'"):
        assert effective_policy(base).allow_autotune is False


def test_bad_arguments_get_clear_errors():
    with pytest.raises(TypeError, match="Executor expects a Kernel"):
        Executor(make_chain())(lambda x: x, jnp.ones(2))
    with pytest.raises(TypeError, match="choose"):
        Executor(object())
    with pytest.raises(ValueError, match="Kernel name"):
        ToyMatmul(name="")
    with pytest.raises(TypeError, match="persistent must be a PersistentCache"):
        ConfigSelectorChain(persistent="/tmp/x")
    with pytest.raises(ValueError, match="max_candidates"):
        AutotunePolicy(max_candidates=0)

    class NoSuper(Kernel):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="super"):
        Executor(make_chain())(NoSuper(), jnp.ones(2))


def test_default_executor_and_kernel_call(tmp_path):
    from ejkernel.ops import get_default_executor

    x, w = random_inputs()
    out = ToyMatmul()(x, w)
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-5)
    executor = get_default_executor()
    assert executor is get_default_executor()
    assert executor.chooser.policy.allow_autotune is False  # heuristics unless asked
    assert executor.chooser.persistent.path.parent == tmp_path / "ejkernel-cache"
    assert not executor.chooser.persistent.path.parent.exists()  # nothing written: nothing created


def test_create_default_executor_recipe_constructs(tmp_path):
    executor = Executor(
        ConfigSelectorChain(
            cache=ConfigCache(),
            policy=AutotunePolicy(allow_autotune=True),
            tuner=Tuner(warmup=2, iters=5),
            persistent=PersistentCache(str(tmp_path / "kernel_cache")),
        )
    )
    assert executor.chooser.persistent.path == tmp_path / "kernel_cache" / "configs.json"
    assert ConfigSelectorChain(cache=ConfigCache(), persistent=None, autotune=True).policy.allow_autotune


def test_a_broken_config_space_falls_back_to_the_heuristic_with_a_warning():
    class Broken(ToyMatmul):
        def config_space(self, inv):
            raise KeyError("no table for this GPU")

    kernel = Broken()
    chain = make_chain(policy=AutotunePolicy(allow_autotune=True))
    x, w = random_inputs()
    with pytest.warns(RuntimeWarning, match="autotuning 'toy_matmul' failed .*no table"):
        out = Executor(chain)(kernel, x, w)
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-5)
    assert chain.select(Invocation(kernel, (x, w))).source == "heuristic"  # not retried on every call


def test_default_executor_autotunes_and_persists_when_the_env_says_so(monkeypatch, tmp_path):
    import json

    from ejkernel.ops import get_default_executor

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(wrong=True)))
    x, w = random_inputs()
    np.testing.assert_allclose(kernel(x, w), np.asarray(x) @ np.asarray(w), rtol=1e-5)
    stored = json.loads((tmp_path / "ejkernel-cache" / "configs.json").read_text())["entries"]
    (entry,) = stored.values()
    assert entry["kernel"] == "toy_matmul@1" and entry["config"]["wrong"] is False
    assert get_default_executor().chooser.select(Invocation(kernel, (x, w))).source == "cache"


def test_memoized_keys_equal_freshly_built_keys():
    kernel, executor = ToyMatmul(), Executor(make_chain())
    x, w = random_inputs()
    variants = [
        ((x, w), {"scale": 0.0}),
        ((x, w), {"scale": -0.0}),
        ((x, w), {"scale": 1}),
        ((x, w), {"scale": True}),
        ((x, w), {"scale": 1.0}),
        ((x.astype(jnp.float16), w), {"scale": 1.0}),
        ((x[:8], w), {"scale": 1.0}),
        ((x, w), {"scale": float("nan")}),
        ((x, w), {"scale": "a", "extra": None}),
        ((x, w), {"extra": None, "scale": "a"}),
    ]
    for _ in range(2):  # the second pass is served from the memo
        keys = [executor.invocation(kernel, *args, **kwargs).cache_key for args, kwargs in variants]
        assert keys == [Invocation(kernel, args, kwargs).cache_key for args, kwargs in variants]
    assert len(set(keys)) == len(variants) - 1  # keyword order does not matter


def test_settled_heuristics_yield_to_new_persistent_entries_and_to_autotuning(tmp_path):
    kernel = ToyMatmul(space=(ToyConfig(block=4),))
    chain = make_chain(tmp_path, policy=AutotunePolicy(allow_autotune=False))
    executor = Executor(chain)
    x, w = random_inputs()
    key = executor.invocation(kernel, x, w).cache_key
    for _ in range(2):
        assert executor.choose(kernel, x, w) == ToyConfig(block=8)  # heuristic, then the settled fast path
    chain.persistent.put(key, ToyConfig(block=2))
    chain.cache.clear()
    assert executor.choose(kernel, x, w) == ToyConfig(block=2)  # the disk entry wins again
    chain.cache.clear()
    chain.persistent.clear()
    assert executor.choose(kernel, x, w) == ToyConfig(block=8)
    with policy_override(autotune=True):
        assert chain.select(executor.invocation(kernel, x, w)).source == "autotune"
