# ruff: noqa: E402, F811, B018, F841  -- the spec examples are kept verbatim
"""The examples of the ops-framework and datacarrier spec pages, run unchanged.

Each test holds one example verbatim (between the ``# ---- example`` markers), preceded by the minimal
definitions it assumes (``a``, ``b``, ``my_kernel`` ...) and followed by checks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops import Invocation, Kernel

# ---- example: Basic Kernel Implementation -----------------------------------------------------------
from dataclasses import dataclass
from ejkernel.ops import Kernel
import jax.numpy as jnp
# 1. Define your configuration
@dataclass(frozen=True)
class MyConfig:
    block_size: int = 128
    num_warps: int = 4
    algorithm: str = "default"
# 2. Implement the kernel
class MyKernel(Kernel[MyConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__(name="my_kernel")
    def run(self, a, b, *, cfg: MyConfig, **kwargs) -> jnp.ndarray:
        """Default implementation."""
        # Your operation logic here
        return jnp.dot(a, b)
    def heuristic_cfg(self, inv: "Invocation") -> MyConfig:
        """Generate config based on input shapes."""
        # inv.args contains the input arrays
        a = inv.args[0]
        block = 128 if a.shape[0] >= 128 else 64
        return MyConfig(block_size=block)
# ---- end of example ---------------------------------------------------------------------------------


class TunableKernel(MyKernel):
    # ---- example: Defining Config Space (method body) --------------------------------------------------
    def config_space(self, inv: Invocation) -> list[MyConfig]:
        """Return configs to try during autotuning."""
        return [
            MyConfig(block_size=64, num_warps=2),
            MyConfig(block_size=128, num_warps=4),
            MyConfig(block_size=256, num_warps=8),
        ]
    # ---- end of example ---------------------------------------------------------------------------------


def custom_forward(a, b, cfg):
    return a * b


def custom_grad_a(a, b, ct, cfg):
    return ct * b


def custom_grad_b(a, b, ct, cfg):
    return ct * a


class VjpKernel(Kernel[MyConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__(name="vjp_kernel")

    def heuristic_cfg(self, inv):
        return MyConfig()

    # ---- example: Custom Gradients (VJP) ---------------------------------------------------------------
    def run(self, a, b, *, cfg, **kwargs):
        return custom_forward(a, b, cfg)
    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        """Custom backward pass."""
        a, b = primals
        ct = cotangents[0]
        grad_a = custom_grad_a(a, b, ct, cfg)
        grad_b = custom_grad_b(a, b, ct, cfg)
        return (grad_a, grad_b)
    # ---- end of example ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    triton_params: dict = dataclasses.field(default_factory=dict)
    pallas_params: dict = dataclasses.field(default_factory=dict)


def triton_flash_attention(q, k, v):
    raise AssertionError("not on a CPU")


pallas_attention = triton_flash_attention


def xla_attention(q, k, v):
    return jax.nn.softmax(q @ k.T) @ v


class AttentionKernel(Kernel[AttentionConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__("attention_example")

    def heuristic_cfg(self, inv):
        return AttentionConfig()

    # ---- example: Platform-Specific Implementations ----------------------------------------------------
    def run_triton(self, q, k, v, *, cfg, **kwargs):
        """Triton GPU implementation."""
        return triton_flash_attention(q, k, v, **cfg.triton_params)
    def run_pallas(self, q, k, v, *, cfg, **kwargs):
        """Pallas TPU implementation."""
        return pallas_attention(q, k, v, **cfg.pallas_params)
    def run_xla(self, q, k, v, *, cfg, **kwargs):
        """XLA fallback implementation."""
        return xla_attention(q, k, v)
    def run(self, q, k, v, *, cfg, **kwargs):
        """Default fallback."""
        return self.run_xla(q, k, v, cfg=cfg, **kwargs)
    # ---- end of example ---------------------------------------------------------------------------------


@pytest.fixture
def operands():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)


def test_executor_and_invocation_examples(operands):
    a, b = operands
    my_kernel = MyKernel()
    my_config = MyConfig(block_size=32)
    # ---- example: Invocation ------------------------------------------------------------------------------
    from ejkernel.ops import Invocation
    # Created automatically by the executor
    inv = Invocation(
        kernel=my_kernel,
        args=(a, b), # Positional arguments
        kwargs={'scale': 1.0}, # Keyword arguments
        metadata={} # Shapes, dtypes, device info
    )
    # Access abstracted shapes (for config lookup)
    inv.abstract_args # JAX ShapeDtypeStruct versions
    inv.device_fingerprint # Unique device identifier
    # ---- example: Executor ---------------------------------------------------------------------------------
    from ejkernel.ops import Executor, ConfigSelectorChain, ConfigCache
    # Create the execution stack
    cache = ConfigCache()
    selector = ConfigSelectorChain(cache=cache)
    executor = Executor(selector)
    # Run a kernel
    result = executor(my_kernel, a, b)
    # Run with explicit config
    result = executor(my_kernel, a, b, cfg=my_config)
    # ---- end of example ---------------------------------------------------------------------------------
    np.testing.assert_allclose(result, np.asarray(a) @ np.asarray(b), rtol=1e-5)
    assert inv.abstract_args[0] == jax.ShapeDtypeStruct((8, 4), jnp.float32)
    assert executor.choose(my_kernel, a, b) == MyConfig(block_size=64)


def test_cache_examples(tmp_path, operands):
    key, config = "some-key", MyConfig()
    # ---- example: ConfigCache ---------------------------------------------------------------------------
    from ejkernel.ops import ConfigCache
    cache = ConfigCache()
    # Store a config
    cache.put(key, config)
    # Retrieve
    config = cache.get(key) # Returns None if not found
    # Check existence
    if key in cache:
        ...
    # ---- end of example ---------------------------------------------------------------------------------
    assert config == MyConfig()
    home = str(tmp_path)
    # ---- example: PersistentCache (path under a temporary home) -----------------------------------------
    from ejkernel.ops import PersistentCache
    # Stored in ~/.cache/ejkernel/ by default
    persistent = PersistentCache(path=f"{home}/.cache/ejkernel/configs")
    # Same interface as ConfigCache
    persistent.put(key, config)
    config = persistent.get(key)
    # ---- example: ConfigSelectorChain ----------------------------------------------------------------------
    from ejkernel.ops import ConfigSelectorChain, ConfigCache, PersistentCache
    selector = ConfigSelectorChain(
        cache=ConfigCache(), # Level 1: In-memory
        persistent=PersistentCache(), # Level 2: Disk
        autotune=True # Level 3: Benchmark if not found
    )
    # ---- end of example ---------------------------------------------------------------------------------
    assert PersistentCache(path=f"{home}/.cache/ejkernel/configs").get(key) == MyConfig()
    assert selector.policy.allow_autotune


def test_override_examples(operands):
    a, b = operands
    kernel = TunableKernel()
    from ejkernel.ops import ConfigSelectorChain, Executor

    executor = Executor(ConfigSelectorChain(autotune=True))
    my_custom_cache = {executor.invocation(kernel, a, b).cache_key: MyConfig(block_size=1)}
    args = (a, b)
    # ---- example: Temporary Overrides (one argument list spelled *args) ----------------------------------
    from ejkernel.ops import overlay_cache, policy_override
    # Temporarily use different cache
    with overlay_cache(my_custom_cache):
        result = executor(kernel, *args)
    # Temporarily change autotuning policy
    with policy_override(autotune=False):
        result = executor(kernel, *args) # No autotuning
    # ---- end of example ---------------------------------------------------------------------------------
    assert len(executor.chooser.cache) == 0  # neither the overlay nor the heuristic was cached


def test_autotuning_examples(operands):
    a, b = operands
    kernel = TunableKernel()
    inv = Invocation(kernel, (a, b))
    # ---- example: Manual Autotuning -----------------------------------------------------------------------
    from ejkernel.ops import autotune, benchmark
    # Autotune a specific kernel call
    best_config = autotune(
        kernel, a, b,
        configs=kernel.config_space(inv),
        num_warmup=3,
        num_iters=10
    )
    # Simple function benchmarking
    time_ms = benchmark(lambda: kernel(a, b), num_iters=100)
    # ---- example: Batch Autotuning ---------------------------------------------------------------------
    from ejkernel.ops import autotune_recorded, record_invocation, get_invocations
    # Enable recording
    record_invocation(kernel, inv)
    # ... run your model with various inputs ...
    # Get all recorded invocations
    invocations = get_invocations()
    # Autotune all at once
    results = autotune_recorded(invocations)
    # ---- end of example ---------------------------------------------------------------------------------
    assert best_config in kernel.config_space(inv) + [MyConfig(block_size=64)]
    assert time_ms > 0 and list(results) == [inv.cache_key]


def test_batch_examples(operands):
    a, b = operands
    kernel = MyKernel()
    batched_a, batched_b = jnp.stack([a, a + 1]), jnp.stack([b, b - 1])
    sharded_a, sharded_b = a[None], b[None]
    # ---- example: vmap_with_config ------------------------------------------------------------------------
    from ejkernel.ops import vmap_with_config
    # Standard vmap would select config per element
    # vmap_with_config selects once and broadcasts
    batched_result = vmap_with_config(
        kernel,
        in_axes=(0, 0), # Batch over first axis
    )(batched_a, batched_b)
    # ---- example: pmap_with_config ------------------------------------------------------------------------
    from ejkernel.ops import pmap_with_config
    # Run kernel across multiple devices
    parallel_result = pmap_with_config(
        kernel,
        axis_name='devices'
    )(sharded_a, sharded_b)
    # ---- end of example ---------------------------------------------------------------------------------
    np.testing.assert_allclose(batched_result[1], np.asarray(a + 1) @ np.asarray(b - 1), rtol=1e-5)
    np.testing.assert_allclose(parallel_result[0], np.asarray(a) @ np.asarray(b), rtol=1e-5)


def test_params_device_sharding_serialization_examples(operands):
    array, (a, b) = operands[0], operands
    kernel, args, kwargs = MyKernel(), (a, b), {}
    config = MyConfig(block_size=16)
    # ---- example: FwdParams and BwdParams ----------------------------------------------------------------
    from ejkernel.ops import FwdParams, BwdParams
    fwd = FwdParams(
        q_blocksize=128, # Query block size
        kv_blocksize=256, # Key-value block size
        num_warps=4, # GPU warps
        num_stages=2, # Pipeline stages
    )
    bwd = BwdParams(
        q_blocksize=64,
        kv_blocksize=128,
    )
    # ---- example: Device Detection -----------------------------------------------------------------------
    from ejkernel.ops import device_kind, get_device_platform, device_fingerprint
    # Get device type
    device_kind() # Returns "gpu", "tpu", or "cpu"
    # Get platform for dispatch
    get_device_platform() # Returns "triton", "pallas", or "xla"
    # Unique device identifier (for caching)
    fingerprint = device_fingerprint()
    # ---- example: Sharding Utilities ---------------------------------------------------------------------
    from ejkernel.ops import sharding_fingerprint, default_key_builder_with_sharding
    # Get fingerprint of array sharding
    fingerprint = sharding_fingerprint(array)
    # Build cache key including sharding info
    key = default_key_builder_with_sharding(kernel, args, kwargs)
    # ---- example: Serialization --------------------------------------------------------------------------
    from ejkernel.ops import to_json, from_json, stable_json
    # Serialize config to JSON
    json_str = to_json(config)
    # Deserialize
    config = from_json(json_str, MyConfig)
    # Stable JSON (deterministic ordering for cache keys)
    stable_str = stable_json(config)
    # ---- end of example ---------------------------------------------------------------------------------
    assert hash(fwd) == hash(FwdParams(q_blocksize=128, kv_blocksize=256, num_warps=4, num_stages=2)) and bwd.num_warps is None
    assert (device_kind(), get_device_platform()) == ("cpu", "xla") and fingerprint is None
    assert key.startswith("my_kernel@1|") and config == MyConfig(block_size=16)
    assert stable_str == stable_json(MyConfig(block_size=16))


def test_hlo_analysis_and_label_examples(monkeypatch, operands):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    a, b = operands
    kernel = MyKernel()
    def attention_impl(q, k, v):
        return xla_attention(q, k, v)
    def fn(x):
        return my_attention(x, x, x) + kernel(x, x.T + 1.0)[:, :4]  # not CSE-able with the attention
    args = a
    # ---- example: Labeling Operations ---------------------------------------------------------------------
    from ejkernel.ops import label
    # Add label for HLO analysis
    @label("my_attention")
    def my_attention(q, k, v):
        return attention_impl(q, k, v)
    # ---- example: HLO Analysis -----------------------------------------------------------------------------
    from ejkernel.ops import (
        find_labels_in_lowered,
        extract_labels_from_hlo_text,
        labels_to_configs
    )
    # Find labeled operations in lowered JAX code
    lowered = jax.jit(fn).lower(args)
    labels = find_labels_in_lowered(lowered)
    # Extract from HLO text
    hlo_text = lowered.compile().as_text()
    labels = extract_labels_from_hlo_text(hlo_text)
    # Convert labels to configs
    configs = labels_to_configs(labels)
    # ---- end of example ---------------------------------------------------------------------------------
    assert {label.name for label in labels} == {"my_attention", "my_kernel"}
    assert list(configs.values()) == [MyConfig(block_size=64)]


def test_custom_vjp_and_platform_examples(operands):
    a, b = operands
    vjp_kernel = VjpKernel()
    grads = jax.grad(lambda a, b: jnp.sum(vjp_kernel(a, b)), argnums=(0, 1))(a, b.T)
    np.testing.assert_allclose(grads[0], b.T)
    np.testing.assert_allclose(grads[1], a)
    q = jnp.ones((4, 8))
    np.testing.assert_allclose(AttentionKernel()(q, q, q), xla_attention(q, q, q), rtol=1e-6)
