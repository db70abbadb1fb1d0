"""The kernel registry behaves exactly as the spec (shared/spec/kernel-registry.txt) states."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from ejkernel import Implementation
from ejkernel.errors import KernelNotFoundError
from ejkernel.kernels import LazyImplementation
from ejkernel.kernels._registry import Backend, KernelRegistry, KernelSpec, Platform, kernel_registry


def test_spec_module_example_runs_unchanged():
    from ejkernel.kernels._registry import Backend, Platform, kernel_registry  # noqa: F401 (the spec's import)

    algorithms = kernel_registry.list_algorithms()
    impls = kernel_registry.list_implementations("flash_attention")
    impl = kernel_registry.get("flash_attention", platform=Platform.XLA)
    assert "flash_attention" in algorithms
    assert impls and all(isinstance(s, KernelSpec) for s in impls)
    assert callable(impl)


def test_spec_class_examples_run_unchanged():
    registry = KernelRegistry()

    @registry.register("flash_attention", Platform.TRITON, Backend.GPU)
    def flash_attention_triton(q, k, v): ...

    impl = registry.get("flash_attention", platform="triton", backend="gpu")
    assert impl is flash_attention_triton

    @registry.register("flash_attention", Platform.TRITON, Backend.GPU, priority=10)
    def flash_attention_impl(q, k, v):
        return q

    assert registry.get("flash_attention", platform="triton", backend="gpu") is flash_attention_impl


def test_enums_are_str_enums_with_spec_values():
    assert [p.value for p in Platform] == ["triton", "pallas", "cuda", "cute", "xla"]
    assert [b.value for b in Backend] == ["gpu", "tpu", "cpu", "any"]
    assert Platform.TRITON == "triton" and Backend.ANY == "any"


def test_kernel_spec_fields_and_immutability():
    spec = KernelSpec(Platform.XLA, Backend.ANY, "x", print)
    assert spec.priority == 0
    with pytest.raises(Exception):
        spec.priority = 3  # type: ignore[misc]


def test_lookup_is_case_insensitive_and_priority_ordered():
    registry = KernelRegistry()
    low = registry.register("My_Algo", "xla", "cpu", priority=1)(lambda: "low")
    high = registry.register("my_algo", "xla", "cpu", priority=5)(lambda: "high")
    assert registry.list_algorithms() == ["my_algo"]
    assert registry.get("MY_ALGO") is high
    assert [s.implementation for s in registry.list_implementations("my_algo")] == [high, low]


def test_list_implementations_returns_a_copy_and_empty_for_unknown():
    registry = KernelRegistry()
    registry.register("a", "xla", "any")(lambda: None)
    registry.list_implementations("a").clear()
    assert len(registry.list_implementations("a")) == 1
    assert registry.list_implementations("nope") == []


def test_backend_any_implementation_matches_every_backend_query():
    registry = KernelRegistry()
    anywhere = registry.register("a", "xla", "any")(lambda: None)
    for backend in ("gpu", "tpu", "cpu"):
        assert registry.get("a", platform="xla", backend=backend) is anywhere


def test_xla_retries_with_backend_any():
    registry = KernelRegistry()
    tpu_only = registry.register("a", "xla", "tpu")(lambda: None)
    assert registry.get("a", platform="xla", backend="tpu") is tpu_only
    # A GPU query finds no XLA/GPU kernel; the retry with Backend.ANY finds none either, and the TPU-only
    # kernel is never handed to a GPU caller.
    with pytest.raises(KernelNotFoundError):
        registry.get("a", platform="xla", backend="gpu")
    anywhere = registry.register("a", "xla", "any")(lambda: None)
    assert registry.get("a", platform="xla", backend="gpu") is anywhere


def test_backend_any_query_retries_with_default_backend():
    registry = KernelRegistry()
    cpu_impl = registry.register("a", "triton", "cpu")(lambda: None)
    # backend=ANY matches only ANY-registered specs directly; the retry uses jax.default_backend() (cpu here).
    assert registry.get("a", platform="triton", backend=Backend.ANY) is cpu_impl


def test_not_found_error_lists_what_is_registered_and_the_provider():
    registry = KernelRegistry()
    registry.register("flash_attention", "xla", "any")(lambda: None)
    with pytest.raises(KernelNotFoundError) as info:
        registry.get("flash_attention", platform="cuda", backend="gpu")
    message = str(info.value)
    assert "platform='cuda'" in message
    assert "xla/any" in message
    assert "ejkernel-cuda" in message  # which plugin would provide the platform
    with pytest.raises(ValueError, match="known algorithms"):
        registry.get("no_such_algorithm")


def test_bad_registration_arguments_are_named():
    registry = KernelRegistry()
    with pytest.raises(ValueError, match="platform='tritonn'"):
        registry.register("a", "tritonn", "gpu")
    with pytest.raises(ValueError, match="backend='gpuu'"):
        registry.register("a", "triton", "gpuu")
    with pytest.raises(TypeError, match="priority"):
        registry.register("a", "triton", "gpu", priority="high")
    with pytest.raises(ValueError, match="algorithm"):
        registry.register("", "triton", "gpu")
    with pytest.raises(ValueError, match="package.module:attribute"):
        registry.register_lazy("a", "xla", "any", "no_colon_here")
    for method, extra in ((registry.register, ()), (registry.register_lazy, ("pkg.mod:impl",))):
        with pytest.raises(ValueError, match=rf"{method.__name__}\(\) needs a concrete platform"):
            method("a", "auto", "gpu", *extra)
        with pytest.raises(TypeError, match="priority"):
            method("a", "xla", "any", *extra, priority=1.5)


def test_validate_signatures_warns_about_each_difference():
    registry = KernelRegistry()

    @registry.register("a", "xla", "any", priority=1)
    def reference(q, k, v, *, causal: bool = False): ...

    @registry.register("a", "triton", "gpu")
    def same(q, k, v, *, causal: bool = False): ...

    assert registry.validate_signatures("a") is True

    @registry.register("a", "pallas", "tpu")
    def different(q, key, v, *, causal: int = True): ...

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert registry.validate_signatures("a") is False
        assert registry.validate_signatures(None) is None
    messages = " ".join(str(w.message) for w in caught)
    assert "'key'" in messages and "defaults to True" in messages and "annotated" in messages
    with pytest.raises(ValueError, match="not registered"):
        registry.validate_signatures("unknown")


def test_lazy_registration_imports_on_first_call_only():
    registry = KernelRegistry()
    spec = registry.register_lazy("a", "xla", "any", "json:dumps", plugin="p")
    assert isinstance(spec.implementation, LazyImplementation) and not spec.implementation.resolved
    assert registry.get("a")([1]) == "[1]"
    assert spec.implementation.resolved


def test_unregister_plugin_removes_only_its_kernels():
    registry = KernelRegistry()
    registry.register_lazy("a", "xla", "any", "json:dumps", plugin="p")
    registry.register_lazy("a", "xla", "any", "json:loads", plugin="q")
    registry.register_lazy("b", "xla", "any", "json:loads", plugin="p")
    assert registry.unregister_plugin("p") == 2
    assert registry.list_algorithms() == ["a"]


def test_global_registry_holds_the_xla_backend():
    specs = kernel_registry.list_implementations("flash_attention")
    assert any(s.platform == Platform.XLA and s.plugin == "xla" for s in specs)


# ---- the operation contract, for every registration ----------------------------------------------


@pytest.mark.parametrize("algorithm", kernel_registry.list_algorithms())
def test_every_registered_implementation_follows_the_operation_contract(algorithm):
    """Every implementation of every algorithm, from every installed plugin (resolved: its module imported),
    is an ``ejkernel.Implementation`` with a frozen-dataclass config, and the registry's signature check
    finds nothing to warn about."""
    for spec in kernel_registry.list_implementations(algorithm):
        implementation = spec.implementation
        if isinstance(implementation, LazyImplementation):
            implementation = implementation.resolve()
        where = f"{algorithm}: {spec.platform.value}/{spec.backend.value} from plugin {spec.plugin!r}"
        assert isinstance(implementation, Implementation), f"{where} is {implementation!r}, not an ejkernel.Implementation"
        config_type = implementation.config_type
        assert dataclasses.is_dataclass(config_type) and config_type.__dataclass_params__.frozen, (
            f"{where}: config_type {config_type!r} is not a frozen dataclass"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_registry.validate_signatures(algorithm) is True


@dataclasses.dataclass(frozen=True)
class _FrozenConfig:
    block: int = 64


@dataclasses.dataclass
class _MutableConfig:
    block: int = 64


class _CallA:
    pass


class _CallB:
    pass


class _Good(Implementation):
    config_type = _FrozenConfig

    def __call__(self, call: _CallA, config: _FrozenConfig):
        return call


def test_validate_signatures_checks_the_implementation_contract():
    registry = KernelRegistry()
    registry.register("op", "xla", "any", priority=1)(_Good())

    class AlsoGood(Implementation):  # unannotated, default config: fine
        def __call__(self, call, config):
            return call

    registry.register("op", "triton", "gpu")(AlsoGood())
    assert registry.validate_signatures("op") is True

    class Mutable(_Good):
        config_type = _MutableConfig

        def __call__(self, call: _CallA, config: _MutableConfig):
            return call

    class OtherCall(_Good):
        def __call__(self, call: _CallB, config: _FrozenConfig):
            return call

    class WrongConfigAnnotation(_Good):
        def __call__(self, call: _CallA, config: _MutableConfig):
            return call

    class RenamedAndExtra(_Good):
        def __call__(self, query, config, causal):
            return query

        def supports(self, call, strict):
            pass

    def plain_function(call, config):
        return call

    for platform, implementation in [("pallas", Mutable()), ("cuda", OtherCall()), ("cute", WrongConfigAnnotation()),
                                     ("pallas", RenamedAndExtra()), ("cuda", plain_function)]:
        registry.register("op", platform, "gpu")(implementation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert registry.validate_signatures("op") is False
    messages = [str(w.message) for w in caught]
    expected = [
        "_MutableConfig'>, not a frozen dataclass",
        "takes call: _CallB, but xla/any (priority 1) takes call: _CallA",
        "annotates config '_MutableConfig', but its config_type is '_FrozenConfig'",
        "parameter 'query' where 'call' was expected",
        "3 parameters instead of 2",
        "supports(self, call, strict): 3 parameters instead of 2",
        "not an ejkernel.Implementation",
    ]
    for text in expected:
        assert any(text in message for message in messages), (text, messages)
    assert all(message.startswith("op: ") for message in messages)
