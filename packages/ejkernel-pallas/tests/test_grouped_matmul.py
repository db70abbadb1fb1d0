"""TPU grouped matmul in interpret mode: own multi-tile cases, Mosaic lowering, and the shared suite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import InterpretedConformance, abstract_device, normal, out_and_grads, rel_err

from ejkernel.modules.operations.grouped_matmul import GroupedMatmul
from ejkernel.testing.grouped_matmul import GroupedMatmulConformance, reference_grouped_matmul
from ejkernel.testing.numerics import matmul_precisions
from ejkernel_pallas.grouped_matmul import PallasGroupedMatmulConfig, run_grouped_matmul


def grouped_matmul(lhs, rhs, group_sizes, group_offset=None, existing_out=None, *, cfg=PallasGroupedMatmulConfig(),
                   interpret=True, **keywords):
    """The kernel on core's canonical call, with the test's own ``interpret``."""
    call = GroupedMatmul().validate(lhs, rhs, group_sizes, group_offset, existing_out, **keywords)
    return run_grouped_matmul(call, cfg, interpret=interpret)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_row_tiles_straddle_groups(transpose_rhs):
    """8-row tiles, groups of 5/0/19/0/13 rows, group_offset 1 of 3 held groups, existing_out."""
    m, k, n, sizes = 45, 24, 20, (5, 0, 19, 0, 13)
    ks = jax.random.split(jax.random.key(41), 3)
    lhs = normal(ks[0], (m, k))
    rhs = normal(ks[1], (3, n, k) if transpose_rhs else (3, k, n))
    existing = normal(ks[2], (m, n))
    sizes = jnp.asarray(sizes, jnp.int32)
    offset = jnp.asarray([1], jnp.int32)
    cfg = PallasGroupedMatmulConfig(block_m=8)

    def kernel(lhs, rhs, existing):
        return grouped_matmul(lhs, rhs, sizes, offset, existing, transpose_rhs=transpose_rhs, cfg=cfg)

    def reference(lhs, rhs, existing):
        return reference_grouped_matmul(lhs, rhs, sizes, offset, existing, transpose_rhs=transpose_rhs)

    out, grads = out_and_grads(kernel, (0, 1, 2))(lhs, rhs, existing)
    want_out, want = out_and_grads(reference, (0, 1, 2))(lhs, rhs, existing)
    assert rel_err(out, want_out) < 1e-6
    for name, g, w in zip(("lhs", "rhs", "existing_out"), grads, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-6, name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # float32: dots at Precision.HIGHEST
def test_lowers_for_tpu(dtype):
    lhs = jax.ShapeDtypeStruct((1024, 256), dtype)
    rhs = jax.ShapeDtypeStruct((4, 256, 512), dtype)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(lhs, rhs, sizes):
        out = grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32, interpret=False)
        return out.sum()

    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(lhs, rhs, sizes).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # gmm, d_lhs gmm, tgmm


@pytest.mark.parametrize(
    "dtype,precision,expected",
    [("float32", None, jax.lax.Precision.HIGHEST), ("float32", "high", jax.lax.Precision.HIGH),
     ("float32", "default", jax.lax.Precision.DEFAULT), ("bfloat16", None, jax.lax.Precision.DEFAULT)],
)
def test_every_dot_forward_and_backward_runs_at_the_precision(dtype, precision, expected):
    """float32 means float32 on the TPU (Mosaic's default dot is bf16 passes): the precision reaches the
    kernels' dots -- gmm, d_lhs gmm and tgmm."""
    ks = jax.random.split(jax.random.key(43), 2)
    lhs, rhs = normal(ks[0], (24, 16), dtype), normal(ks[1], (2, 16, 8), dtype)
    sizes = jnp.asarray([11, 13], jnp.int32)

    def loss(lhs, rhs):
        return grouped_matmul(lhs, rhs, sizes, precision=precision).sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1)), lhs, rhs)
    assert len(found) == 3 and set(found) == {expected}, found


class TestPallasGroupedMatmulConformance(InterpretedConformance, GroupedMatmulConformance):
    """The shared suite through ``ejkernel.modules.grouped_matmul(platform="pallas")`` in interpret mode."""


def test_tpu_faithful_interpreter_finds_no_races():
    """Revisited output tiles (a row tile shared by two groups) under the race-detecting TPU interpreter."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    ks = jax.random.split(jax.random.key(42), 2)
    lhs, rhs = normal(ks[0], (24, 16)), normal(ks[1], (2, 16, 8))
    sizes = jnp.asarray([11, 13], jnp.int32)
    cfg = PallasGroupedMatmulConfig(block_m=8)
    out = grouped_matmul(lhs, rhs, sizes, cfg=cfg, interpret=pltpu.InterpretParams(detect_races=True))
    assert rel_err(out, reference_grouped_matmul(lhs, rhs, sizes)) < 1e-6
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


def test_heuristic_config_is_every_tile_that_runs():
    """The heuristic and candidate configs leave no tile to the call (rows: up to 512 in the dtype's sublane
    multiple; k and n: the whole padded dim up to 512, else 512); a partial user config resolves to the same
    tiles, the given ones kept."""
    import dataclasses

    from ejkernel_pallas.grouped_matmul import IMPLEMENTATION

    def call(m, k, n, dtype=jnp.float32, groups=3, **keywords):
        lhs = jax.ShapeDtypeStruct((m, k), dtype)
        rhs = jax.ShapeDtypeStruct((groups, k, n), dtype)
        return GroupedMatmul().validate(lhs, rhs, jnp.zeros((groups,), jnp.int32), **keywords)

    cases = {(45, 24, 20, jnp.float32): (48, 24, 24), (45, 24, 20, jnp.bfloat16): (48, 24, 24),
             (2048, 1024, 700, jnp.bfloat16): (512, 512, 512), (300, 512, 130, jnp.float32): (304, 512, 136)}
    for (m, k, n, dtype), tiles in cases.items():
        c = call(m, k, n, dtype)
        config = IMPLEMENTATION.heuristic_config(c)
        assert config == PallasGroupedMatmulConfig(*tiles), (m, k, n, dtype)
        assert all(getattr(config, f.name) is not None for f in dataclasses.fields(config))
        assert config.resolved(c) == config == PallasGroupedMatmulConfig().resolved(c)
        for candidate in IMPLEMENTATION.candidate_configs(c):
            assert candidate.resolved(c) == candidate
        assert PallasGroupedMatmulConfig(block_m=16).resolved(c) == dataclasses.replace(config, block_m=16)
