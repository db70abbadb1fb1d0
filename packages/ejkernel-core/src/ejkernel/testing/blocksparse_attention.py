"""Reference and conformance suite of ``blocksparse_attention`` (semantics: the module docstring of
``ejkernel.modules.operations.blocksparse_attention``). Subclass :class:`BlockSparseAttentionConformance`,
set ``platform`` (and optionally ``cfg``, a config of the implementation under test); every gradient is
required.
"""

from __future__ import annotations

import math
from typing import ClassVar

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
from ejkernel.testing._attention_reference import reference_flash_attention
from ejkernel.testing.numerics import (
    exact_matmuls,
    DTYPES,
    ConformanceSuite,
    assert_close,
    assert_finite,
    forward_and_vjp,
    normal_array,
    run_jitted,
)


@exact_matmuls
def reference_blocksparse_attention(
    query,
    key,
    value,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_aux=None,
    *,
    block_mask=None,
    block_size=128,
    causal=True,
    sliding_window=None,
    logits_soft_cap=None,
    softmax_scale=None,
):
    """The block mask expanded to a token mask, then dense flash-attention reference (concrete masks)."""
    batch, q_len, num_heads, _ = query.shape
    kv_len = key.shape[1]
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    mask = None
    if block_mask is not None:
        blocks = np.asarray(block_mask, bool)
        mask = blocks.repeat(q_block, axis=2).repeat(kv_block, axis=3)[:, :, :q_len, :kv_len]
        mask = np.broadcast_to(mask, (batch, mask.shape[1], q_len, kv_len))
    return reference_flash_attention(
        query,
        key,
        value,
        attention_mask=mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux,
    )


def random_block_mask(seed, batch, heads, q_len, kv_len, q_block, kv_block, density=0.5):
    """Random blocks on (about ``density``), the diagonal blocks always on; one mask row all off."""
    rng = np.random.default_rng(seed)
    nq, nk = math.ceil(q_len / q_block), math.ceil(kv_len / kv_block)
    mask = rng.random((batch, heads, nq, nk)) < density
    for i in range(nq):
        mask[:, :, i, min(nk - 1, (i * q_block + kv_len - q_len) // kv_block if kv_len >= q_len else i)] = True
    mask[:, :, nq // 2, :] = False  # whole rows masked: zeros out, finite gradients
    return jnp.asarray(mask)


# (batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, v_head_dim, block_size, mask heads)
CASES = {
    "gqa_per_head": (2, 33, 33, 4, 2, 32, 32, (8, 8), 4),
    "rect_shared": (1, 17, 45, 2, 1, 16, 24, (4, 16), 1),
    "mha_odd": (1, 127, 127, 2, 2, 64, 64, (32, 16), 2),
}


def mask_form(form, q_len, kv_len, block):
    """``(block_mask, call keywords)`` of a mask form built by the public builders: token-exact causal,
    local (sliding window) and chunked-causal attention."""
    if form == "causal":
        return causal_block_mask(q_len, kv_len, block), dict(causal=True)
    if form == "local":
        return local_block_mask(q_len, kv_len, block, (9, 3)), dict(causal=False, sliding_window=(9, 3))
    if form == "chunked":
        return chunked_block_mask(q_len, kv_len, block, 16), dict(causal=True)
    raise ValueError(form)


class BlockSparseAttentionConformance(ConformanceSuite):
    """Test base: subclass and set ``platform``."""

    operation_type: ClassVar[type] = BlockSparseAttention
    mask_form_block: ClassVar[tuple[int, int]] = (8, 8)
    """Mask blocks of ``test_mask_forms_odd_lengths`` (before ``block_multiple``)."""
    head_dims: ClassVar[tuple[int, ...] | None] = None
    """Head dims the kernels under test take (ascending), or None (any): each case's query/key and value
    head dims are raised to the smallest of them that holds the case's (the largest of them otherwise)."""
    block_multiple: ClassVar[int] = 1
    """Mask blocks of every case are rounded up to a multiple of this (e.g. 16 for kernels whose smallest
    tile is 16). Lengths, head counts, masks' shapes in blocks and features stay the suite's."""

    @classmethod
    def kernel_case(cls, case):
        """``case`` mapped onto what the kernels take (``head_dims``, ``block_multiple``)."""
        batch, q_len, kv_len, heads, kv_heads, head_dim, v_dim, block, mask_heads = case
        if cls.head_dims:
            head_dim, v_dim = (next((h for h in cls.head_dims if h >= d), cls.head_dims[-1])
                               for d in (head_dim, v_dim))
        block = tuple(-(-b // cls.block_multiple) * cls.block_multiple for b in block)
        return batch, q_len, kv_len, heads, kv_heads, head_dim, v_dim, block, mask_heads
    operation_arguments: ClassVar[tuple[str, ...]] = (
        "query",
        "key",
        "value",
        "q_segment_ids",
        "kv_segment_ids",
        "softmax_aux",
        "block_mask",
    )

    def call(self, query, key, value, q_segment_ids=None, kv_segment_ids=None, softmax_aux=None, **kw):
        from ejkernel.modules import blocksparse_attention

        return blocksparse_attention(
            query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, platform=self.platform,
            **{"cfg": self.cfg, **kw},
        )

    def make_inputs(self, seed, case, dtype, *, scale=1.0):
        batch, q_len, kv_len, heads, kv_heads, head_dim, v_dim, block, mask_heads = self.kernel_case(case)
        inputs = dict(
            query=normal_array(seed * 5, (batch, q_len, heads, head_dim), dtype, scale),
            key=normal_array(seed * 5 + 1, (batch, kv_len, kv_heads, head_dim), dtype),
            value=normal_array(seed * 5 + 2, (batch, kv_len, kv_heads, v_dim), dtype),
        )
        static = dict(block_size=block, block_mask=random_block_mask(seed, batch, mask_heads, q_len, kv_len, *block))
        return inputs, static

    def check(self, inputs, static, dtype):
        wrt = tuple(n for n in ("query", "key", "value", "softmax_aux") if inputs.get(n) is not None)
        self.check_call(reference_blocksparse_attention, inputs, wrt, dtype, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        inputs, static = self.make_inputs(1, CASES["gqa_per_head"], dtype)
        self.check(inputs, static, dtype)

    @pytest.mark.parametrize("case", ["rect_shared", "mha_odd"])
    def test_shapes_non_causal(self, case):
        inputs, static = self.make_inputs(2, CASES[case], "float32")
        self.check(inputs, {**static, "causal": False}, "float32")

    def test_window_soft_cap_sinks_and_segments(self):
        inputs, static = self.make_inputs(3, CASES["gqa_per_head"], "float32", scale=3.0)
        segments = jnp.asarray(np.repeat(np.array([[0] * 10 + [1] * 23, [0] * 33]), 1, axis=0), jnp.int32)
        inputs.update(softmax_aux=normal_array(33, (4, 2)), q_segment_ids=segments, kv_segment_ids=segments)
        static.update(sliding_window=(7, 2), logits_soft_cap=5.0, softmax_scale=0.3)
        self.check(inputs, static, "float32")

    @pytest.mark.parametrize("form", ["causal", "local", "chunked"])
    def test_mask_forms_odd_lengths(self, form):
        """The builders' masks at odd lengths (ragged last blocks on both sides, Sq != Skv) against the
        reference under the same mask. Causal runs 45 queries over 29 keys: its first 16 queries see no key
        (rows masked at token level inside visited blocks: zeros, finite gradients)."""
        q_len, kv_len = (45, 29) if form == "causal" else (29, 45)
        block = self.kernel_case((1, q_len, kv_len, 2, 1, 16, 16, self.mask_form_block, 1))[7]
        inputs, _ = self.make_inputs(9, (1, q_len, kv_len, 2, 1, 16, 16, block, 1), "float32")
        block_mask, rules = mask_form(form, q_len, kv_len, block)
        self.check(inputs, dict(block_size=block, block_mask=block_mask, **rules), "float32")

    def test_large_logits(self):
        inputs, static = self.make_inputs(4, CASES["rect_shared"], "float32", scale=40.0)
        self.check(inputs, static, "float32")

    def test_fully_masked_rows_are_zero(self):
        inputs, static = self.make_inputs(5, CASES["gqa_per_head"], "float32")
        out, grads, _ = forward_and_vjp(lambda **kw: self.call(**kw, **static), inputs, ("query", "key", "value"), 5)
        q_block = static["block_size"][0]
        row = (static["block_mask"].shape[2] // 2) * q_block
        np.testing.assert_array_equal(np.asarray(out[:, row : row + q_block]), 0.0)
        for name, grad in grads.items():
            assert_finite(grad, f"d {name}")
        np.testing.assert_array_equal(np.asarray(grads["query"][:, row : row + q_block]), 0.0)

    def test_dense_default_and_vmap(self):
        inputs, static = self.make_inputs(6, CASES["rect_shared"], "float32")
        dense = run_jitted(self.call, **inputs, block_size=static["block_size"])
        assert_close(dense, run_jitted(reference_flash_attention, **inputs, causal=True), dtype="float32")
        stacked = jnp.stack([inputs["query"], -inputs["query"]])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "query": q}, **static)))(stacked)
        expected = run_jitted(reference_blocksparse_attention, **{**inputs, "query": stacked[1]}, **static)
        assert_close(batched[1], expected, dtype="float32")

    def test_bad_inputs(self):
        from ejkernel.ops import get_default_executor

        inputs, static = self.make_inputs(7, CASES["gqa_per_head"], "float32")

        def call(match, **changes):
            self.assert_rejected(match, **{**inputs, **static, **changes})

        call("key", key=inputs["key"][:, :, :, :8])
        call("block_mask", block_mask=static["block_mask"][:, :, :2])
        call("block_mask", block_mask=static["block_mask"].astype(jnp.int32))
        call("block_size", block_size=0)
        call("sliding_window", sliding_window=(-2, 1))
        call("value", value=inputs["value"].astype(jnp.bfloat16))
        # flash_attention's features it lacks (through the executor: the public signature has no such keyword)
        with pytest.raises((ValueError, TypeError), match="dropout_prob"):  # (a keyword the signature lacks)
            get_default_executor()(BlockSparseAttention(), *inputs.values(), dropout_prob=0.1, platform=self.platform)
