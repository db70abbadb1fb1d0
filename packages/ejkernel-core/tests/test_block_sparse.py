"""ejkernel.ops.utils.block_sparse (the schedule every block-sparse kernel follows) and the public block-mask
builders, against brute-force token masks."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations.blocksparse_attention import (
    BlockSparseAttention,
    causal_block_mask,
    chunked_block_mask,
    local_block_mask,
)
from ejkernel.ops.utils.block_sparse import block_schedule, effective_block_mask
from ejkernel.testing.flash_attention import reference_visibility


def token_rules(q_len, kv_len, causal, window):
    """bool [q_len, kv_len]: causal / window visibility, brute force (the flash-attention reference's)."""
    return reference_visibility(1, 1, q_len, kv_len, causal=causal, sliding_window=window)[0, 0]


def blocks_of(token_mask, q_block, kv_block, reduce):
    """[..., q_len, kv_len] -> [..., q_blocks, kv_blocks] by ``reduce`` (np.any / np.all) over each block."""
    q_len, kv_len = token_mask.shape[-2:]
    nq, nk = math.ceil(q_len / q_block), math.ceil(kv_len / kv_block)
    out = np.zeros((*token_mask.shape[:-2], nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            out[..., i, j] = reduce(
                token_mask[..., i * q_block : (i + 1) * q_block, j * kv_block : (j + 1) * kv_block], axis=(-2, -1)
            )
    return out


def make_call(q_len, kv_len, block, block_mask, *, causal, window, segments=False, heads=2):
    q = jnp.zeros((2, q_len, heads, 8), jnp.float32)
    k = jnp.zeros((2, kv_len, 1, 8), jnp.float32)
    seg = (jnp.zeros((2, q_len), jnp.int32), jnp.zeros((2, kv_len), jnp.int32)) if segments else (None, None)
    return BlockSparseAttention().validate(
        q, k, k, *seg, block_mask=block_mask, block_size=block, causal=causal, sliding_window=window
    )


CASES = [  # q_len, kv_len, (q_block, kv_block), causal, window
    (33, 33, (8, 8), True, None),
    (17, 45, (4, 16), True, (9, 0)),
    (45, 17, (16, 4), True, None),  # more queries than keys: the first queries see nothing
    (40, 40, (8, 16), False, (5, 3)),
    (29, 61, (8, 8), False, None),
    (64, 64, (16, 16), True, (20, 4)),
]


def expected_schedule(call, by):
    """Brute force: the token mask (block mask expanded, AND the rules), its visited and partial blocks."""
    q_len, kv_len = call.query.shape[1], call.key.shape[1]
    qb, kb = call.q_block_size, call.kv_block_size
    nq, nk = math.ceil(q_len / qb), math.ceil(kv_len / kb)
    pad_q, pad_k = nq * qb, nk * kb
    rules = np.zeros((pad_q, pad_k), bool)  # padded tokens are never visible
    rules[:q_len, :kv_len] = token_rules(q_len, kv_len, call.causal, call.sliding_window)
    blocks = np.asarray(call.block_mask)
    tokens = blocks.repeat(qb, axis=2).repeat(kb, axis=3) & rules
    visited = blocks_of(tokens, qb, kb, np.any)
    partial = ~blocks_of(rules, qb, kb, np.all) | (call.q_segment_ids is not None)
    partial = np.broadcast_to(partial, visited.shape)
    if by == "kv":
        visited, partial = visited.swapaxes(2, 3), partial.swapaxes(2, 3)
    return visited, partial


def check_schedule(schedule, visited, partial, max_visits, order="ascending"):
    indices, counts, part = (np.asarray(x) for x in schedule)
    assert indices.dtype == np.int32 and counts.dtype == np.int32 and part.dtype == bool
    assert indices.shape == (*visited.shape[:3], max_visits) == part.shape
    np.testing.assert_array_equal(counts, visited.sum(-1))
    for index in np.ndindex(*visited.shape[:3]):
        columns = np.flatnonzero(visited[index])
        if order != "ascending":  # full blocks ascending, then partial ones ascending (or the reverse)
            full, part_ = columns[~partial[index][columns]], columns[partial[index][columns]]
            columns = np.concatenate([full, part_] if order == "full_first" else [part_, full])
        n = len(columns)
        np.testing.assert_array_equal(indices[index][:n], columns)
        np.testing.assert_array_equal(indices[index][n:], columns[-1] if n else 0)
        np.testing.assert_array_equal(part[index][:n], partial[index][columns])


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("by", ["q", "kv"])
def test_schedule_matches_brute_force(case, by):
    q_len, kv_len, block, causal, window = case
    nq, nk = math.ceil(q_len / block[0]), math.ceil(kv_len / block[1])
    mask = np.random.default_rng(q_len * kv_len).random((2, 2, nq, nk)) < 0.6
    mask[:, :, nq // 2] = False  # one empty row
    call = make_call(q_len, kv_len, block, jnp.asarray(mask), causal=causal, window=window)
    visited, partial = expected_schedule(call, by)
    np.testing.assert_array_equal(np.asarray(effective_block_mask(call)), expected_schedule(call, "q")[0])
    schedule = block_schedule(call, by=by)
    check_schedule(schedule, visited, partial, max(1, int(visited.sum(-1).max())))


@pytest.mark.parametrize("case", CASES[:4] + CASES[-2:], ids=str)
@pytest.mark.parametrize("by", ["q", "kv"])
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("order", ["full_first", "partial_first"])
def test_full_or_partial_first_order(case, by, traced, order):
    q_len, kv_len, block, causal, window = case
    nq, nk = math.ceil(q_len / block[0]), math.ceil(kv_len / block[1])
    mask = np.random.default_rng(q_len + kv_len).random((1, 2, nq, nk)) < 0.7
    call = make_call(q_len, kv_len, block, jnp.asarray(mask), causal=causal, window=window)
    visited, partial = expected_schedule(call, by)
    if traced:
        schedule = jax.jit(lambda m: block_schedule(dataclasses.replace(call, block_mask=m), by=by,
                                                    order=order))(jnp.asarray(mask))
        max_visits = visited.shape[-1]
    else:
        schedule = block_schedule(call, by=by, order=order)
        max_visits = max(1, int(visited.sum(-1).max()))
    check_schedule(schedule, visited, partial, max_visits, order=order)


def test_segments_make_every_block_partial_and_shared_mask_dims_stay_one():
    call = make_call(33, 33, (8, 8), jnp.ones((1, 1, 5, 5), bool), causal=True, window=None, segments=True)
    visited, partial = expected_schedule(call, "q")
    schedule = block_schedule(call)
    assert schedule.indices.shape == (1, 1, 5, 5)
    check_schedule(schedule, visited, partial, 5)
    assert bool(np.all(np.asarray(schedule.partial)))


def test_traced_block_mask_under_jit():
    mask = np.random.default_rng(0).random((1, 2, 5, 3)) < 0.5
    call = make_call(33, 45, (8, 16), jnp.asarray(mask), causal=True, window=(20, 0))

    @jax.jit
    def schedule_of(block_mask):
        return block_schedule(dataclasses.replace(call, block_mask=block_mask), by="kv")

    visited, partial = expected_schedule(call, "kv")
    check_schedule(schedule_of(jnp.asarray(mask)), visited, partial, 5)  # max_visits: every column block


def test_all_masked_gives_one_step_of_block_zero():
    call = make_call(16, 16, (8, 8), jnp.zeros((1, 1, 2, 2), bool), causal=False, window=None)
    schedule = block_schedule(call)
    assert schedule.indices.shape == (1, 1, 2, 1)
    assert not np.asarray(schedule.indices).any() and not np.asarray(schedule.counts).any()


@pytest.mark.parametrize("q_len,kv_len,block", [(33, 33, 8), (17, 45, (4, 16)), (45, 17, (16, 4)), (1, 100, 32)])
def test_causal_and_local_builders(q_len, kv_len, block):
    qb, kb = (block, block) if isinstance(block, int) else block
    got = np.asarray(causal_block_mask(q_len, kv_len, block))
    assert got.dtype == bool and got.shape[:2] == (1, 1)
    np.testing.assert_array_equal(got[0, 0], blocks_of(token_rules(q_len, kv_len, True, None), qb, kb, np.any))
    for window in (3, (10, 0), (0, 7)):
        pair = (window, window) if isinstance(window, int) else window
        got = np.asarray(local_block_mask(q_len, kv_len, block, window))
        np.testing.assert_array_equal(got[0, 0], blocks_of(token_rules(q_len, kv_len, False, pair), qb, kb, np.any))


@pytest.mark.parametrize("q_len,kv_len,block,chunk", [(64, 64, 8, 16), (24, 56, (8, 16), 32), (1, 50, 16, 32)])
def test_chunked_builder_is_token_exact(q_len, kv_len, block, chunk):
    qb, kb = (block, block) if isinstance(block, int) else block
    got = np.asarray(chunked_block_mask(q_len, kv_len, block, chunk))[0, 0]
    p = np.arange(q_len)[:, None] + kv_len - q_len
    same_chunk = p // chunk == np.arange(kv_len)[None, :] // chunk
    expanded = got.repeat(qb, axis=0).repeat(kb, axis=1)[:q_len, :kv_len]
    np.testing.assert_array_equal(expanded, same_chunk)


def test_builders_reject_bad_arguments():
    with pytest.raises(ValueError, match="straddles"):
        chunked_block_mask(64, 64, 16, 24)
    with pytest.raises(ValueError, match="block_size"):
        causal_block_mask(64, 64, 0)
    with pytest.raises(ValueError, match="q_len"):
        local_block_mask(0, 64, 16, 4)
    with pytest.raises(ValueError, match="by"):
        block_schedule(make_call(8, 8, 8, None, causal=True, window=None), by="k")
    with pytest.raises(ValueError, match="order must be"):
        block_schedule(make_call(8, 8, 8, None, causal=True, window=None), order="full")


def test_builders_and_the_default_mask_stay_concrete_under_jit():
    """So a kernel's schedule is sized at trace time by the busiest row, not by every column block."""
    seen = {}

    @jax.jit
    def f(q):
        seen["causal"] = causal_block_mask(64, 64, 16)
        seen["default"] = make_call(64, 64, 16, None, causal=True, window=None).block_mask
        seen["schedule"] = block_schedule(
            make_call(64, 64, 16, local_block_mask(64, 64, 16, 8), causal=False, window=(8, 8)))
        return q

    f(1.0)
    assert not isinstance(seen["causal"], jax.core.Tracer) and not isinstance(seen["default"], jax.core.Tracer)
    assert seen["schedule"].indices.shape[3] == 3  # a 16-token block with an 8-token window: 3 blocks, not 4
