"""Reference and conformance suite of ``multi_head_latent_attention`` (semantics: the module docstring
of ``ejkernel.modules.operations.multi_head_latent_attention``). Subclass
:class:`MultiHeadLatentAttentionConformance`, set ``platform`` (and optionally ``cfg``, a config of the
implementation under test); every gradient is required.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules.operations.multi_head_latent_attention import MultiHeadLatentAttention
from ejkernel.testing._attention_reference import masked_softmax_attention
from ejkernel.testing.numerics import (
    exact_matmuls,
    DTYPES,
    ConformanceSuite,
    assert_close,
    normal_array,
    run_jitted,
)


@exact_matmuls
def reference_multi_head_latent_attention(
    query, key_value, w_kc, w_vc, b_q=None, b_k=None, *, softmax_scale=None, causal=False, cu_seqlens=None
):
    """Dense: expand keys/values per head, add the RoPE logits, mask, softmax. Float64-ready."""
    batch, seq_len, num_heads, head_dim = query.shape
    group = num_heads // w_kc.shape[1]
    rope_dim = 0 if b_k is None else b_k.shape[-1]
    scale = (head_dim + rope_dim) ** -0.5 if softmax_scale is None else softmax_scale
    keys = jnp.repeat(jnp.einsum("bsr,rkd->bskd", key_value, w_kc), group, axis=2)
    values = jnp.repeat(jnp.einsum("bsr,rkd->bskd", key_value, w_vc), group, axis=2)
    logits = jnp.einsum("bihd,bjhd->bhij", query, keys)
    if b_q is not None:
        rope_q = b_q if b_q.ndim == 4 else jnp.broadcast_to(b_q[:, :, None], (*query.shape[:3], rope_dim))
        logits = logits + jnp.einsum("bihd,bjd->bhij", rope_q, b_k)
    logits = scale * logits
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    visible = jnp.ones((seq_len, seq_len), bool)
    if causal:
        visible &= j <= i
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens)
        sequence = jnp.searchsorted(cu, jnp.arange(seq_len), side="right") - 1
        exists = jnp.arange(seq_len) < cu[-1]
        visible &= (sequence[:, None] == sequence[None, :]) & exists[:, None] & exists[None, :]
    out = masked_softmax_attention(logits, visible[None, None], values.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3).astype(query.dtype)


# (batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim, kv_lora_rank, rope_dim, b_q per head)
CASES = {
    "expanded_rope": (2, 17, 4, 2, 32, 24, 48, 8, False),  # 2 * rank > head_dim + v_head_dim
    "latent_space": (1, 33, 4, 1, 64, 64, 16, 8, True),  # 2 * rank < head_dim + v_head_dim
    "no_rope_mha": (2, 9, 3, 3, 16, 16, 12, 0, False),
}
WRT = ("query", "key_value", "w_kc", "w_vc")


class MultiHeadLatentAttentionConformance(ConformanceSuite):
    """Test base: subclass and set ``platform``."""

    operation_type: ClassVar[type] = MultiHeadLatentAttention
    public_name = "multi_head_latent_attention"

    def make_inputs(self, seed, case, dtype, *, scale=1.0):
        batch, seq_len, heads, kv_heads, head_dim, v_head_dim, rank, rope_dim, per_head = case
        # up-projections scaled so keys/values have unit variance
        w_scale = rank**-0.5
        inputs = dict(
            query=normal_array(seed * 7, (batch, seq_len, heads, head_dim), dtype, scale),
            key_value=normal_array(seed * 7 + 1, (batch, seq_len, rank), dtype),
            w_kc=normal_array(seed * 7 + 2, (rank, kv_heads, head_dim), dtype, w_scale),
            w_vc=normal_array(seed * 7 + 3, (rank, kv_heads, v_head_dim), dtype, w_scale),
            b_q=None,
            b_k=None,
        )
        if rope_dim:
            q_shape = (batch, seq_len, heads, rope_dim) if per_head else (batch, seq_len, rope_dim)
            inputs["b_q"] = normal_array(seed * 7 + 4, q_shape, dtype, scale)
            inputs["b_k"] = normal_array(seed * 7 + 5, (batch, seq_len, rope_dim), dtype)
        return inputs

    def check(self, inputs, dtype, **static):
        wrt = WRT + (("b_q", "b_k") if inputs["b_q"] is not None else ())
        return self.check_call(reference_multi_head_latent_attention, inputs, wrt, dtype, **static)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_forward_and_gradients(self, dtype):
        self.check(self.make_inputs(1, CASES["expanded_rope"], dtype), dtype, causal=True)

    @pytest.mark.parametrize("case", ["latent_space", "no_rope_mha"])
    def test_forms_and_layouts(self, case):
        self.check(
            self.make_inputs(2, CASES[case], "float32"), "float32", causal=case == "latent_space", softmax_scale=0.2
        )

    def test_varlen_causal(self):
        inputs = self.make_inputs(3, CASES["latent_space"], "float32")
        cu = jnp.asarray([0, 5, 6, 20, 30], jnp.int32)  # tokens 30..32 are padding
        out = self.check(inputs, "float32", causal=True, cu_seqlens=cu)
        np.testing.assert_array_equal(np.asarray(out[:, 30:]), 0.0)

    def test_large_logits(self):
        self.check(self.make_inputs(4, CASES["no_rope_mha"], "float32", scale=30.0), "float32", causal=True)

    def test_jit_vmap_and_aliases(self):
        from ejkernel.modules import flash_mla

        inputs = self.make_inputs(5, CASES["no_rope_mha"], "float32")
        expected = run_jitted(reference_multi_head_latent_attention, **inputs, causal=True)
        stacked = jnp.stack([inputs["query"], -inputs["query"]])
        batched = jax.jit(jax.vmap(lambda q: self.call(**{**inputs, "query": q}, causal=True)))(stacked)
        assert_close(batched[0], expected, dtype="float32")
        alias = run_jitted(
            flash_mla,
            inputs["query"],
            inputs["key_value"],
            inputs["w_kc"],
            inputs["w_vc"],
            causal=True,
            platform=self.platform,
        )
        assert_close(alias, expected, dtype="float32")

    def test_bad_inputs(self):
        inputs = self.make_inputs(6, CASES["expanded_rope"], "float32")

        def call(match, **changes):
            self.assert_rejected(match, **{**inputs, **changes})

        call("query", query=inputs["query"][0])
        call("w_kc", w_kc=inputs["w_kc"][:-1])
        # 3 kv heads do not divide 4
        call("w_kc", w_kc=inputs["w_kc"][:, :1].repeat(3, 1), w_vc=inputs["w_vc"][:, :1].repeat(3, 1))
        call("w_vc", w_vc=inputs["w_vc"].astype(jnp.bfloat16))
        call("b_q", b_k=None)
        self.assert_rejected("cu_seqlens", **inputs, cu_seqlens=jnp.asarray([0, 5, 3], jnp.int32))
