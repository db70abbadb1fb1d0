"""Pallas TPU block-sparse attention on CPU in interpret mode: the shared conformance suite, and the
kernels' visited-block counts against the mask's non-empty blocks (brute force over token masks).

Interpreted forward+backward programs compile in 5-10 s each on the 2-core CI machine, so CI runs the
tests of ``CI_TESTS`` (every feature at least once: GQA, per-head masks, window + soft cap + sinks +
segments, odd lengths with rows that see nothing, block-mask rows all off, dispatch and bad input);
``EJKERNEL_PALLAS_CONFORMANCE=1`` runs them all (20 tests, ~3 minutes; among them the TPU-faithful
interpreter with race detection, ~30 s alone)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_helpers import InterpretedConformance, full_conformance

from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttention
from ejkernel.testing.blocksparse_attention import BlockSparseAttentionConformance, mask_form, random_block_mask
from ejkernel.testing.flash_attention import reference_visibility
from ejkernel_pallas import blocksparse_attention as tpu_blocksparse


CI_TESTS = {
    "test_window_soft_cap_sinks_and_segments",
    "test_mask_forms_odd_lengths[causal]",
    "test_fully_masked_rows_are_zero",
    "test_bad_inputs",
    "test_kernels_visit_exactly_the_non_empty_blocks[random]",
    "test_tiling_rules_on_a_tpu",
    "test_lowers_for_tpu[True]",
}


@pytest.fixture(autouse=True)
def _ci_sized(request):
    if not full_conformance() and request.node.name not in CI_TESTS:
        pytest.skip("CI-sized run: EJKERNEL_PALLAS_CONFORMANCE=1 runs the whole suite")


class TestPallasTpuBlockSparseAttention(InterpretedConformance, BlockSparseAttentionConformance):
    verify_reference = False  # backend-independent, run by the XLA suite


def non_empty_blocks(block_mask, q_len, kv_len, q_block, kv_block, *, causal, window):
    """bool ``[B', H', q_blocks, kv_blocks]``: blocks whose token mask (block mask expanded, AND causal /
    window, end-aligned) has a visible pair, brute force."""
    rules = reference_visibility(1, 1, q_len, kv_len, causal=causal, sliding_window=window)[0, 0]
    tokens = np.asarray(block_mask).repeat(q_block, 2).repeat(kv_block, 3)[:, :, :q_len, :kv_len] & rules
    nq, nk = math.ceil(q_len / q_block), math.ceil(kv_len / kv_block)
    padded = np.zeros((*tokens.shape[:2], nq * q_block, nk * kv_block), bool)
    padded[:, :, :q_len, :kv_len] = tokens
    return padded.reshape(*tokens.shape[:2], nq, q_block, nk, kv_block).any(axis=(3, 5))


@pytest.mark.parametrize("form", ["random", "causal", "local"])
def test_kernels_visit_exactly_the_non_empty_blocks(form):
    """Every kernel (forward, dQ, dK/dV) does work on exactly the blocks with a visible pair: the grid steps
    that run a block's body are counted by a debug output in interpret mode."""
    batch, q_len, kv_len, heads, kv_heads, block = 2, 45, 37, 4, 2, (8, 8)
    if form == "random":
        block_mask, rules = random_block_mask(3, batch, heads, q_len, kv_len, *block, density=0.4), dict(causal=True)
    else:
        block_mask, rules = mask_form(form, q_len, kv_len, block)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, 16)), jnp.float32)
    call = BlockSparseAttention().validate(q, k, k, block_mask=block_mask, block_size=block, **rules)
    expected = non_empty_blocks(block_mask, q_len, kv_len, *block, causal=call.causal, window=call.sliding_window)
    expected = np.broadcast_to(expected, (batch, heads, *expected.shape[2:]))
    visits = tpu_blocksparse.visited_blocks(call)
    np.testing.assert_array_equal(visits["forward"], expected.sum(-1))
    np.testing.assert_array_equal(visits["dq"], expected.sum(-1))
    per_kv_head = expected.reshape(batch, kv_heads, heads // kv_heads, *expected.shape[2:]).sum(axis=(2, 3))
    np.testing.assert_array_equal(visits["dkv"], per_kv_head)
    assert visits["forward"].sum() < expected[..., :, :].size  # the mask leaves blocks out: skipping is tested


def test_tiling_rules_on_a_tpu():
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    call = BlockSparseAttention().validate(q, q, q, block_size=(128, 128))
    assert tpu_blocksparse.tiling_problem(call) is None
    assert "q_block_size=8" in tpu_blocksparse.tiling_problem(BlockSparseAttention().validate(q, q, q, block_size=(8, 128)))
    seg = jnp.zeros((1, 256), jnp.int32)
    call = BlockSparseAttention().validate(q, q, q, seg, seg, block_size=(128, 64))
    assert "lanes" in tpu_blocksparse.tiling_problem(call)


@pytest.mark.parametrize("segments", [False, True])
def test_lowers_for_tpu(segments):
    """Mosaic lowering (jax side, abstract TPU device) of the forward, dK/dV and dQ kernels at TPU-tileable
    blocks: scalar-prefetched schedules, schedule-driven index maps, the partial/full branches."""
    from pallas_test_helpers import abstract_device

    b, s, h, hk, d = 1, 512, 4, 2, 128
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    mask = random_block_mask(1, b, h, s, s, 128, 128)
    seg = jnp.zeros((b, s), jnp.int32) if segments else None

    def loss(q, k, v):
        call = BlockSparseAttention().validate(
            q, k, v, seg, seg, jnp.ones((h,)), block_mask=mask, block_size=(128, 128), causal=True,
            sliding_window=(200, 0), logits_soft_cap=3.0,
        )
        assert tpu_blocksparse.tiling_problem(call) is None
        return tpu_blocksparse.blocksparse_attention(call, interpret=False).astype(jnp.float32).sum()

    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 3, text[:2000]


def test_tpu_faithful_interpreter_without_races():
    """Forward and backward in the TPU-faithful interpreter (scalar prefetch in SMEM, the pipeline's DMAs)
    with race detection: the reference's numbers and no data races between grid steps."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    from jax.experimental.pallas import tpu as pltpu

    from ejkernel.testing.blocksparse_attention import reference_blocksparse_attention
    from ejkernel.testing.numerics import assert_close

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 40, 1, 16)), jnp.float32)
    static = dict(block_mask=random_block_mask(1, 1, 2, 40, 40, 8, 8), block_size=(8, 8), causal=True)
    params = pltpu.InterpretParams(detect_races=True)

    def kernel(q, k, v):
        return tpu_blocksparse.blocksparse_attention(BlockSparseAttention().validate(q, k, v, **static), interpret=params)

    out, pullback = jax.vjp(kernel, q, k, k)
    want, want_pullback = jax.vjp(lambda q, k, v: reference_blocksparse_attention(q, k, v, **static), q, k, k)
    assert_close(out, want, dtype="float32")
    for got, expected in zip(pullback(jnp.ones_like(out)), want_pullback(jnp.ones_like(want))):
        assert_close(got, expected, dtype="float32", gradient=True)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
