"""``jax.export`` round trip of every public operation: a jitted function calling it exports, serializes,
deserializes and runs with the same result (docs/export.md).

On the CPU (CI) every operation runs on the XLA backend, and some of the serialized programs are also run
by a fresh process that imports jax only (no ejkernel): an XLA artifact needs nothing of ours. With
``-m gpu`` (on the device) every operation runs again through XLA on the GPU, and flash_attention (forward
and gradients) through the Triton and Pallas backends, whose kernels travel inside the serialized module.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel.modules as modules

Case = tuple[Callable[..., object], tuple[np.ndarray, ...]]


def _normal(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _qkv(batch=2, seq=32, heads=4, kv_heads=2, dim=16) -> tuple[np.ndarray, ...]:
    return _normal(0, batch, seq, heads, dim), _normal(1, batch, seq, kv_heads, dim), _normal(2, batch, seq, kv_heads, dim)


# ---- one small call per operation: (function of arrays only, its inputs) ---------------------------------


def _flash_attention(platform: str) -> Case:
    def fn(q, k, v):
        return modules.flash_attention(q, k, v, causal=True, sliding_window=(12, 0), logits_soft_cap=20.0,
                                       platform=platform)

    return fn, _qkv()


def _flash_attention_grad(platform: str) -> Case:
    """Training: the gradient through the custom VJP exports as well."""

    def loss(q, k, v):
        return modules.flash_attention(q, k, v, causal=True, platform=platform).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2)), _qkv()


def _scaled_dot_product_attention(platform: str) -> Case:
    def fn(q, k, v):
        return modules.scaled_dot_product_attention(q, k, v, causal=True, platform=platform)

    return fn, _qkv()


def _attention(platform: str) -> Case:
    def fn(q, k, v, bias):
        return modules.attention(q, k, v, bias, causal=True, deterministic=True, platform=platform)

    return fn, (*_qkv(), _normal(3, 2, 1, 32, 32))


def _blocksparse_attention(platform: str) -> Case:
    def fn(q, k, v):
        return modules.blocksparse_attention(q, k, v, block_size=16, causal=True, platform=platform)

    return fn, _qkv()


def _ring_attention(platform: str) -> Case:
    """Inside shard_map over a one-device ring (the collective path is traced and exported)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    spec = jax.sharding.PartitionSpec(None, "sp")

    def fn(q, k, v):
        return jax.shard_map(
            lambda q, k, v: modules.ring_attention(q, k, v, causal=True, axis_name="sp", platform=platform),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)

    return fn, _qkv()


def _multi_head_latent_attention(platform: str) -> Case:
    def fn(q, kv, w_kc, w_vc, b_q, b_k):
        return modules.multi_head_latent_attention(q, kv, w_kc, w_vc, b_q, b_k, causal=True, platform=platform)

    return fn, (_normal(0, 2, 16, 4, 8), _normal(1, 2, 16, 12), _normal(2, 12, 2, 8), _normal(3, 12, 2, 8),
                _normal(4, 2, 16, 4), _normal(5, 2, 16, 4))


def _native_sparse_attention(platform: str) -> Case:
    def fn(q, k, v, g_cmp, g_slc):
        return modules.native_sparse_attention(q, k, v, g_cmp, g_slc, block_counts=2, block_size=8,
                                               platform=platform)

    q, k, v = _qkv(batch=1, heads=4, kv_heads=1)
    return fn, (q, k, v, _normal(5, 1, 32, 4), _normal(6, 1, 32, 4))


def _page_attention(platform: str) -> Case:
    def fn(q, key_cache, value_cache, context_lens, block_tables):
        return modules.page_attention(q, key_cache, value_cache, context_lens, block_tables, platform=platform)

    # 3 sequences, 4 kv heads shared by 8 query heads, pages of 8 tokens, 10 pages in the cache
    tables = np.array([[3, 1, 7], [0, 5, 0], [9, 2, 4]], np.int32)
    return fn, (_normal(0, 3, 8, 16), _normal(1, 10, 4, 8, 16), _normal(2, 10, 4, 8, 16),
                np.array([20, 9, 24], np.int32), tables)


def _ragged_page_attention(platform: str) -> Case:
    def fn(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs):
        return modules.ragged_page_attention(queries, kv_pages, context_lens, block_tables, query_start_loc,
                                             num_seqs, platform=platform)

    # sequence 0 prefills 5 tokens, sequence 1 decodes 1 token after 12 cached ones (K/V interleaved heads)
    return fn, (_normal(0, 6, 4, 16), _normal(1, 8, 4, 2 * 2, 16), np.array([5, 13], np.int32),
                np.array([[6, 0, 0, 0], [1, 4, 2, 7]], np.int32), np.array([0, 5, 6], np.int32),
                np.array([2], np.int32))


def _ragged_decode_attention(platform: str) -> Case:
    def fn(q, k, v, start, end):
        return modules.ragged_decode_attention(q, k, v, start, end, platform=platform)

    _, k, v = _qkv(batch=3)
    return fn, (_normal(0, 3, 4, 16), k, v, np.array([0, 4, 10], np.int32), np.array([32, 17, 11], np.int32))


def _grouped_matmul(platform: str) -> Case:
    def fn(lhs, rhs, group_sizes):
        return modules.grouped_matmul(lhs, rhs, group_sizes, platform=platform)

    return fn, (_normal(0, 24, 16), _normal(1, 3, 16, 8), np.array([10, 0, 14], np.int32))


def _mean_pooling(platform: str) -> Case:
    def fn(x, cu_seqlens):
        return modules.mean_pooling(x, chunk_size=8, cu_seqlens=cu_seqlens, platform=platform)

    return fn, (_normal(0, 40, 16), np.array([0, 7, 7, 30], np.int32))


def _recurrent(platform: str) -> Case:
    def fn(q, k, v, g, initial_state):
        return modules.recurrent(q, k, v, g, initial_state=initial_state, platform=platform)

    q, k, v = _qkv(heads=2)
    return fn, (q, k, v, -np.abs(_normal(4, 2, 32, 2)), _normal(5, 2, 2, 16, 16))


def _gla_attention(platform: str) -> Case:
    def fn(q, k, v, g):
        return modules.gla_attention(q, k, v, g, platform=platform)

    q, k, v = _qkv(heads=2)
    return fn, (q, k, v, -np.abs(_normal(4, 2, 32, 2, 16)))


def _lightning_attention(platform: str) -> Case:
    def fn(q, k, v):
        return modules.lightning_attention(q, k, v, layer_idx=1, num_layers=4, platform=platform)

    return fn, _qkv(heads=2)


CASES: dict[str, Callable[[str], Case]] = {
    "flash_attention": _flash_attention,
    "flash_attention_grad": _flash_attention_grad,
    "scaled_dot_product_attention": _scaled_dot_product_attention,
    "attention": _attention,
    "blocksparse_attention": _blocksparse_attention,
    "ring_attention": _ring_attention,
    "multi_head_latent_attention": _multi_head_latent_attention,
    "native_sparse_attention": _native_sparse_attention,
    "page_attention": _page_attention,
    "ragged_page_attention": _ragged_page_attention,
    "ragged_decode_attention": _ragged_decode_attention,
    "grouped_matmul": _grouped_matmul,
    "mean_pooling": _mean_pooling,
    "recurrent": _recurrent,
    "gla_attention": _gla_attention,
    "lightning_attention": _lightning_attention,
}

# Backends whose kernels are custom calls that jax.export does not list as stable: exporting them is an
# explicit opt-in (the kernel binary or Triton IR is embedded in the module; see docs/export.md).
UNSTABLE_CUSTOM_CALLS = {
    "triton": ("triton_kernel_call",),  # compiled cubin/PTX of our Triton kernels (jaxlib's Triton call)
    "pallas": ("__gpu$xla.gpu.triton",),  # Pallas GPU: Triton IR, compiled by XLA when the module is
}


def _public_operations() -> list[set[str]]:
    """The names of each public operation (aliases such as ``flash_mla`` name the same function)."""
    helpers = set(modules.HELPERS)
    names: dict[int, set[str]] = {}
    for name in modules.__all__:
        value = getattr(modules, name)
        if name[0].islower() and name not in helpers and inspect.isfunction(value):
            names.setdefault(id(value), set()).add(name)
    return list(names.values())


def _compile_and_run(fn, args, device_platform: str):
    # On the CPU, XLA's backend optimizations are most of each compile here and change nothing compared.
    options = {"xla_backend_optimization_level": 0} if device_platform == "cpu" else None
    return jax.jit(fn).lower(*args).compile(compiler_options=options)(*args)


def _assert_same_result(got: np.ndarray, want: np.ndarray, dtype) -> None:
    """The same program on the same inputs, compiled twice: equal up to float rounding (for a low-precision
    output, one rounding step of its dtype), as a relative L2 error."""
    bound = 1e-6 if jnp.dtype(dtype).itemsize >= 4 else float(jnp.finfo(dtype).eps)
    error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert error <= bound, f"relative error {error:.2e} > {bound:.0e}"


def _round_trip(name: str, platform: str, device_platform: str) -> tuple[bytes, tuple, list]:
    fn, args = CASES[name](platform)
    # The GPU kernels' training dtype; float32 elsewhere (ejkernel's float32 default precision is "highest").
    dtype = jnp.bfloat16 if platform in ("triton", "pallas") else None
    args = tuple(jnp.asarray(a, dtype if a.dtype == np.float32 else None) for a in args)
    jitted = jax.jit(fn)
    expected = _compile_and_run(fn, args, device_platform)
    exported = jax.export.export(
        jitted, platforms=(device_platform,),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in UNSTABLE_CUSTOM_CALLS.get(platform, ())],
    )(*args)
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    assert restored.platforms == (device_platform,)
    actual = _compile_and_run(restored.call, args, device_platform)
    expected_leaves, actual_leaves = jax.tree.leaves(expected), jax.tree.leaves(actual)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(actual_leaves, expected_leaves, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        _assert_same_result(np.asarray(got, np.float64), np.asarray(want, np.float64), want.dtype)
    return blob, args, expected_leaves


def test_every_public_operation_has_an_export_case():
    operations = _public_operations()
    missing = [sorted(names) for names in operations if not names & set(CASES)]
    assert not missing, f"add a case to CASES for each public operation; none for {missing}"
    public = set().union(*operations)
    assert set(CASES) - {"flash_attention_grad"} <= public


# The CPU round trips; on a GPU machine (scripts/device/gpu_tests.sh runs unmarked tests too) -m gpu's do.
cpu_only = pytest.mark.skipif("jax.default_backend() != 'cpu'", reason="CPU round trips (the GPU has -m gpu's)")


@pytest.fixture(scope="module")
def xla_round_trips():
    """Every CPU round trip, run once; the fresh-process test replays their serialized modules."""
    return {}


@cpu_only
@pytest.mark.parametrize("name", sorted(CASES))
def test_export_round_trip_xla_cpu(name, xla_round_trips):
    xla_round_trips[name] = _round_trip(name, "xla", "cpu")


@cpu_only
def test_exported_forward_differentiates_after_loading():
    """``serialize(vjp_order=1)`` carries the custom VJP: the loaded forward has ejkernel's gradients."""
    fn, args = CASES["flash_attention"]("xla")
    args = tuple(map(jnp.asarray, args))
    restored = jax.export.deserialize(jax.export.export(jax.jit(fn))(*args).serialize(vjp_order=1))

    def loss(call):
        return lambda *a: call(*a).astype(jnp.float32).sum()

    expected = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(*args)
    actual = jax.jit(jax.grad(loss(restored.call), argnums=(0, 1, 2)))(*args)
    for got, want in zip(actual, expected, strict=True):
        _assert_same_result(np.asarray(got, np.float64), np.asarray(want, np.float64), want.dtype)


# Replayed by a fresh process (each costs a compile there): the custom-VJP gradient, a collective (shard_map)
# and an integer-indexed gather. export() itself already refused any custom call that is not stable.
REPLAYED = ("flash_attention_grad", "ring_attention", "page_attention")


@cpu_only
def test_xla_exports_run_in_a_process_without_ejkernel(tmp_path, xla_round_trips):
    """A serialized XLA-backend program needs jax only: no custom-call targets, nothing of ours imported."""
    for name in REPLAYED:
        if name not in xla_round_trips:  # when run alone (pytest -k)
            xla_round_trips[name] = _round_trip(name, "xla", "cpu")
        blob, args, expected = xla_round_trips[name]
        (tmp_path / f"{name}.bin").write_bytes(blob)
        np.savez(tmp_path / f"{name}.npz", *map(np.asarray, args))
        np.savez(tmp_path / f"{name}.expected.npz", *map(np.asarray, expected))
    script = textwrap.dedent(
        """
        import pathlib, sys
        import jax, numpy as np
        root = pathlib.Path(sys.argv[1])
        names = sorted(p.stem for p in root.glob("*.bin"))
        for name in names:
            exported = jax.export.deserialize((root / f"{name}.bin").read_bytes())
            args = list(np.load(root / f"{name}.npz").values())
            expected = list(np.load(root / f"{name}.expected.npz").values())
            actual = jax.tree.leaves(exported.call(*args))
            for got, want in zip(actual, expected, strict=True):
                got, want = np.asarray(got, np.float64), want.astype(np.float64)
                assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want), name
        assert not [m for m in sys.modules if m.startswith("ejkernel")], "ejkernel was imported"
        print("ran", len(names))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["ran", str(len(REPLAYED))]


# ---- on the device: pytest -m gpu tests/test_export.py ----------------------------------------------------

GPU_CASES = [(name, "xla") for name in sorted(CASES)] + [
    (name, backend) for backend in ("triton", "pallas") for name in ("flash_attention", "flash_attention_grad")
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,platform", GPU_CASES, ids=[f"{n}-{p}" for n, p in GPU_CASES])
def test_export_round_trip_gpu(name, platform):
    blob, _, _ = _round_trip(name, platform, "cuda")
    for target in UNSTABLE_CUSTOM_CALLS.get(platform, ()):
        assert target in jax.export.deserialize(blob).mlir_module(), (
            f"{platform} did not run its own kernel ({target} missing from the module)")
