"""XLA ``multi_head_latent_attention`` against the shared conformance suite, plus both XLA forms, blocks
smaller than the sequence, and the matmul precision of forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.testing.multi_head_latent_attention import (
    CASES,
    WRT,
    MultiHeadLatentAttentionConformance,
    reference_multi_head_latent_attention,
)
from ejkernel.testing.numerics import assert_close, call_precision_cases, matmul_precisions, run_jitted
from ejkernel_xla.multi_head_latent_attention import XlaMlaConfig


class TestXlaMultiHeadLatentAttention(MultiHeadLatentAttentionConformance):
    platform = "xla"

    @pytest.mark.parametrize("absorb", [True, False], ids=["latent-space", "expanded"])
    def test_both_forms_agree_across_block_borders(self, absorb):
        inputs = self.make_inputs(11, CASES["expanded_rope"], "float32")  # seq_len 17
        expected = run_jitted(reference_multi_head_latent_attention, **inputs, causal=True)
        cfg = XlaMlaConfig(absorb=absorb, block_q=8, block_kv=5, bwd_block_q=6, bwd_block_kv=8)
        out = run_jitted(self.call, **inputs, causal=True, cfg=cfg)
        assert_close(out, expected, dtype="float32", name=f"absorb={absorb}")

    @pytest.mark.parametrize("absorb", [True, False], ids=["latent-space", "expanded"])
    def test_dense_path_matches_the_reference_with_gradients(self, absorb):
        inputs = self.make_inputs(13, CASES["expanded_rope"], "float32")
        wrt = WRT + ("b_q", "b_k")

        def loss(fn, **kw):
            return lambda *diff: (fn(**{**inputs, **dict(zip(wrt, diff))}, causal=True, **kw) ** 2).sum()

        diff = [inputs[n] for n in wrt]
        expected = run_jitted(jax.grad(loss(reference_multi_head_latent_attention), argnums=range(len(wrt))), *diff)
        cfg = XlaMlaConfig(absorb=absorb, dense=True)
        got = run_jitted(jax.grad(loss(self.call, cfg=cfg), argnums=range(len(wrt))), *diff)
        for name, g, e in zip(wrt, got, expected):
            assert_close(g, e, dtype="float32", name=f"d{name} absorb={absorb}")

    @pytest.mark.parametrize("absorb", [True, False], ids=["latent-space", "expanded"])
    @call_precision_cases()
    def test_matmuls_run_at_the_call_precision(self, absorb, dtype, precision, expected):
        inputs = self.make_inputs(12, CASES["expanded_rope"], dtype)
        cfg = XlaMlaConfig(absorb=absorb)
        wrt = WRT + ("b_q", "b_k")

        def loss(*diff):
            out = self.call(**{**inputs, **dict(zip(wrt, diff))}, causal=True, precision=precision, cfg=cfg)
            return out.astype(jnp.float32).sum()

        precisions = matmul_precisions(jax.grad(loss, argnums=range(len(wrt))), *(inputs[n] for n in wrt))
        assert precisions and set(precisions) == {expected}, precisions


def test_heuristic_config_spells_out_the_form(monkeypatch):
    """The form a config left at None takes (whichever costs fewer FLOPs) and, on the blockwise path (no
    room for the dense one: a CPU, here on any device), the block sizes of the loop that runs (the defaults,
    capped at the sequence) are what the heuristic returns: no field left at None; a partial user config
    resolves to the same values, the given ones kept."""
    import dataclasses

    from ejkernel.modules.operations.multi_head_latent_attention import MultiHeadLatentAttention
    from ejkernel_xla import multi_head_latent_attention as mla
    from ejkernel_xla.multi_head_latent_attention import IMPLEMENTATION, absorb_is_cheaper

    monkeypatch.setattr(mla, "dense_budget_bytes", lambda: None)

    suite = TestXlaMultiHeadLatentAttention()
    for case in CASES.values():
        inputs = suite.make_inputs(3, case, "float32")
        call = MultiHeadLatentAttention().validate(**inputs)
        rank, _, v_head_dim = call.w_vc.shape
        seq = call.query.shape[1]
        config = IMPLEMENTATION.heuristic_config(call)
        absorb = absorb_is_cheaper(rank, call.query.shape[-1], v_head_dim)
        assert config == XlaMlaConfig(seq, seq, seq, seq, absorb=absorb, dense=False)
        assert all(getattr(config, f.name) is not None for f in dataclasses.fields(config))
        assert XlaMlaConfig().resolved(call) == config and config.resolved(call) == config
        assert XlaMlaConfig(block_kv=2).resolved(call) == dataclasses.replace(config, block_kv=2, bwd_block_kv=2)


def test_heuristic_takes_the_dense_path_where_flash_attentions_rule_does(monkeypatch):
    """On a device with room for the S² buffers of forward+backward (flash_attention's rule) the heuristic
    runs the dense attention, with no blocks; without room (or on a CPU), the blockwise loop. A block size
    given selects the blockwise loop; ``dense=True`` with blocks is refused."""
    from ejkernel.modules.operations.multi_head_latent_attention import MultiHeadLatentAttention
    from ejkernel_xla import multi_head_latent_attention as mla

    inputs = TestXlaMultiHeadLatentAttention().make_inputs(3, CASES["expanded_rope"], "float32")
    call = MultiHeadLatentAttention().validate(**inputs)
    batch, seq, heads, _ = call.query.shape
    need = batch * heads * seq * seq * (8 + 2 * 4)  # one chunk: B*H*S^2 * (8 + 2 * itemsize)
    monkeypatch.setattr(mla, "dense_budget_bytes", lambda: need)
    config = mla.IMPLEMENTATION.heuristic_config(call)
    assert config.dense and not config.has_blocks
    assert XlaMlaConfig(block_q=4).resolved(call).dense is False
    monkeypatch.setattr(mla, "dense_budget_bytes", lambda: need - 1)
    assert mla.IMPLEMENTATION.heuristic_config(call).dense is False
    with pytest.raises(ValueError, match="dense=True runs no blocks"):
        XlaMlaConfig(dense=True, block_q=4)
