"""Reference and conformance suite of ``native_sparse_attention`` (semantics: the module docstring of
``ejkernel.modules.operations.native_sparse_attention``). Subclass :class:`NativeSparseAttentionConformance`,
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

from ejkernel.modules.operations.native_sparse_attention import NativeSparseAttention
from ejkernel.testing._attention_reference import masked_softmax_attention
from ejkernel.testing.numerics import (
    exact_matmuls,
    DTYPES,
    ConformanceSuite,
    assert_close,
    normal_array,
    run_jitted,
)


def _dense_branch(query, keys, values, visible, scale):
    """Per-head dense attention: query [B, S, H, D], keys/values [B, T, H, D], visible [B, H, S, T]."""
    logits = scale * jnp.einsum("bihd,bjhd->bhij", query, keys)
    return masked_softmax_attention(logits, visible, values.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _reference_batch(
    query, key, value, g_cmp, g_slc, g_swa, block_indices, block_counts, scale, block_size, num_selected, window_size
):
    batch, seq_len, num_heads, _ = query.shape
    group = num_heads // key.shape[2]
    bs = block_size
    num_blocks = math.ceil(seq_len / bs)
    keys, values = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    out = 0.0
    if g_cmp is not None:
        k_cmp = jnp.stack([keys[:, c * bs : (c + 1) * bs].mean(axis=1) for c in range(num_blocks)], axis=1)
        v_cmp = jnp.stack([values[:, c * bs : (c + 1) * bs].mean(axis=1) for c in range(num_blocks)], axis=1)
        c = jnp.arange(num_blocks)[None, :]
        complete = (c + 1) * bs - 1 <= i  # [S, nb]
        out = out + g_cmp[..., None] * _dense_branch(query, k_cmp, v_cmp, complete[None, None], scale)
        if block_indices is None:
            logits = scale * jnp.einsum("bihd,bchd->bhic", query, k_cmp)
            probs = masked_softmax_attention(
                logits, complete[None, None], jnp.eye(num_blocks, dtype=logits.dtype)[None, None]
            )
            scores = probs.reshape(batch, num_heads // group, group, seq_len, num_blocks).sum(axis=2)  # [B, Hkv, S, nb]
            scores = jnp.where(c == i // bs, jnp.inf, jnp.where(complete, scores, -jnp.inf))
            top, block_indices = jax.lax.top_k(scores, min(num_selected, num_blocks))
            block_indices = jnp.where(top == -jnp.inf, -1, block_indices).transpose(0, 2, 1, 3)
    # selected: the set of usable blocks per (b, i, kv head), then token visibility
    idx = jnp.asarray(block_indices)
    slot = jnp.arange(idx.shape[-1])
    usable = (
        (slot < jnp.asarray(block_counts)[..., None])
        & (idx >= 0)
        & (idx <= (jnp.arange(seq_len) // bs)[None, :, None, None])
    )
    chosen = jax.nn.one_hot(jnp.where(usable, idx, -1), num_blocks, dtype=jnp.int32).sum(axis=-2) > 0  # [B, S, Hkv, nb]
    chosen = jnp.repeat(chosen, group, axis=2).transpose(0, 2, 1, 3)  # [B, H, S, nb]
    selected = chosen[..., jnp.arange(seq_len) // bs] & (j <= i)[None, None]
    o_slc = _dense_branch(query, keys, values, selected, scale)
    out = out + (o_slc if g_slc is None else g_slc[..., None] * o_slc)
    if window_size > 0:
        window = ((j <= i) & (j > i - window_size))[None, None]
        out = out + g_swa[..., None] * _dense_branch(query, keys, values, window, scale)
    return out


@exact_matmuls
def reference_native_sparse_attention(
    query,
    key,
    value,
    g_cmp=None,
    g_slc=None,
    g_swa=None,
    block_indices=None,
    block_counts=16,
    *,
    softmax_scale=None,
    block_size=64,
    window_size=0,
    cu_seqlens=None,
):
    """Each branch densely with its mask written out; varlen by slicing the (concrete) sequences."""
    batch, seq_len, _, head_dim = query.shape
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    num_selected = block_counts if block_indices is None else block_indices.shape[-1]
    if not hasattr(block_counts, "shape"):
        block_counts = jnp.full((batch, seq_len, key.shape[2]), min(int(block_counts), num_selected))
    args = [query, key, value, g_cmp, g_slc, g_swa, block_indices, block_counts]
    static = (scale, block_size, num_selected, window_size)
    if cu_seqlens is None:
        return _reference_batch(*args, *static).astype(query.dtype)
    cu = np.asarray(cu_seqlens)
    pieces = []
    for n in range(len(cu) - 1):
        if cu[n + 1] > cu[n]:
            part = [None if x is None else x[:, cu[n] : cu[n + 1]] for x in args]
            pieces.append(_reference_batch(*part, *static))
    tail = seq_len - int(cu[-1])
    pieces.append(jnp.zeros((1, tail, query.shape[2], value.shape[-1]), query.dtype if not pieces else pieces[0].dtype))
    return jnp.concatenate(pieces, axis=1).astype(query.dtype)


def random_block_indices(seed, batch, seq_len, kv_heads, num_selected, block_size):
    """Random past-or-current blocks per (query, kv head), with duplicates and out-of-range entries."""
    rng = np.random.default_rng(seed)
    own = (np.arange(seq_len) // block_size)[None, :, None, None]
    idx = np.floor(rng.random((batch, seq_len, kv_heads, num_selected)) * (own + 1)).astype(np.int32)
    idx[..., 0] = own[..., 0]
    idx[:, ::5, :, -1] = -1  # unused slot
    idx[:, 1::7, :, -1] = own[0, 1::7, :, 0] + 1  # a future block: ignored
    return jnp.asarray(idx)


# (batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim, block_size, num_selected)
CASES = {
    "gqa": (2, 37, 4, 2, 32, 32, 8, 3),
    "mha_odd": (1, 50, 2, 2, 16, 24, 16, 2),
}


class NativeSparseAttentionConformance(ConformanceSuite):
    """Test base: subclass and set ``platform``."""

    operation_type: ClassVar[type] = NativeSparseAttention
    public_name = "native_sparse_attention"

    def make_inputs(self, seed, case, dtype, *, gates=("g_cmp", "g_slc"), indices=True, scale=1.0):
        batch, seq_len, heads, kv_heads, head_dim, v_dim, block, selected = case
        inputs = dict(
            query=normal_array(seed * 9, (batch, seq_len, heads, head_dim), dtype, scale),
            key=normal_array(seed * 9 + 1, (batch, seq_len, kv_heads, head_dim), dtype),
            value=normal_array(seed * 9 + 2, (batch, seq_len, kv_heads, v_dim), dtype),
        )
        for n, name in enumerate(gates):
            inputs[name] = jax.nn.sigmoid(normal_array(seed * 9 + 3 + n, (batch, seq_len, heads), jnp.float32)).astype(
                dtype
            )
        if indices:
            inputs["block_indices"] = random_block_indices(seed, batch, seq_len, kv_heads, selected, block)
            counts = np.random.default_rng(seed).integers(1, selected + 1, (batch, seq_len, kv_heads)).astype(np.int32)
            inputs["block_counts"] = jnp.asarray(counts)
        else:
            inputs["block_counts"] = selected
        return inputs, dict(block_size=block)

    def check(self, inputs, static, dtype):
        wrt = tuple(n for n in ("query", "key", "value", "g_cmp", "g_slc", "g_swa") if inputs.get(n) is not None)
        return self.check_call(reference_native_sparse_attention, inputs, wrt, dtype, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        self.check(*self.make_inputs(1, CASES["gqa"], dtype), dtype)

    def test_selection_from_compressed_branch_and_window(self):
        inputs, static = self.make_inputs(2, CASES["gqa"], "float32", gates=("g_cmp", "g_slc", "g_swa"), indices=False)
        self.check(inputs, {**static, "window_size": 5}, "float32")

    def test_selected_only_odd_shapes(self):
        inputs, static = self.make_inputs(3, CASES["mha_odd"], "float32", gates=())
        self.check(inputs, {**static, "softmax_scale": 0.3}, "float32")

    def test_varlen(self):
        inputs, static = self.make_inputs(4, CASES["mha_odd"], "float32", gates=("g_cmp", "g_swa"), indices=False)
        cu = jnp.asarray([0, 17, 18, 45], jnp.int32)  # tokens 45..49 are padding
        out = self.check(inputs, {**static, "window_size": 9, "cu_seqlens": cu}, "float32")
        np.testing.assert_array_equal(np.asarray(out[:, 45:]), 0.0)

    def test_large_logits(self):
        self.check(*self.make_inputs(5, CASES["mha_odd"], "float32", scale=30.0), "float32")

    def test_jit_and_vmap(self):
        inputs, static = self.make_inputs(6, CASES["gqa"], "float32")
        stacked = jnp.stack([inputs["query"], -inputs["query"]])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "query": q}, **static)))(stacked)
        for n in range(2):
            expected = run_jitted(reference_native_sparse_attention, **{**inputs, "query": stacked[n]}, **static)
            assert_close(batched[n], expected, dtype="float32")

    def test_bad_inputs(self):
        inputs, static = self.make_inputs(7, CASES["gqa"], "float32")

        def call(match, **changes):
            self.assert_rejected(match, **{**inputs, **static, **changes})

        call("key", key=inputs["key"][:, :5])
        call("g_cmp", g_cmp=inputs["g_cmp"][:, :, :1])
        # nothing to select from
        call("g_cmp", g_cmp=None, block_indices=None, block_counts=2)
        call("window_size", window_size=4)  # no g_swa
        call("block_size", block_size=0)
        call("block_indices", block_indices=inputs["block_indices"][:, :, :1])
