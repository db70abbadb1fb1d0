"""XLA ``ragged_page_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax
import pytest

from ejkernel.testing.numerics import assert_close, run_jitted
from ejkernel.testing.ragged_page_attention import (
    CASES,
    RaggedPageAttentionConformance,
    reference_ragged_page_attention,
)
from ejkernel_xla.ragged_page_attention import XlaRaggedPageAttentionConfig


class TestXlaRaggedPageAttention(RaggedPageAttentionConformance):
    platform = "xla"


def test_block_sizes_agree():
    suite = TestXlaRaggedPageAttention()
    inputs = suite.make_inputs(11, CASES["mixed_gqa"], "float32", num_sinks=0)
    expected = run_jitted(reference_ragged_page_attention, **inputs, sliding_window=9)
    cfg = XlaRaggedPageAttentionConfig(block_pages=2, block_rows=5)
    out = jax.jit(lambda **kw: suite.call(**kw, sliding_window=9, cfg=cfg))(**inputs)
    assert_close(out, expected, dtype="float32")


def test_heuristic_config_is_the_config_that_runs():
    """The heuristic spells out the loop sizes a config left at None takes (the executor stores what runs)."""
    from ejkernel_xla.ragged_page_attention import IMPLEMENTATION

    suite = TestXlaRaggedPageAttention()
    inputs = suite.make_inputs(11, CASES["mixed_gqa"], "float32", num_sinks=0)
    cfg = suite.heuristic_config_that_runs(IMPLEMENTATION, inputs, XlaRaggedPageAttentionConfig())
    assert isinstance(cfg.block_pages, int) and isinstance(cfg.block_rows, int)


@pytest.mark.parametrize("precision", [None, "default"])
def test_matmuls_run_at_the_call_precision(precision):
    """float32 inputs: HIGHEST unless asked otherwise, in the forward and in the gradient's matmuls."""
    suite = TestXlaRaggedPageAttention()
    inputs = suite.make_inputs(12, CASES["decode_mha"], "float32")
    expected = jax.lax.Precision.HIGHEST if precision is None else jax.lax.Precision.DEFAULT
    suite.assert_matmul_precision(inputs, "queries", precision, expected)
