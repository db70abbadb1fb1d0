"""XLA ``page_attention`` against the shared conformance suite, plus XLA-specific checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import page_attention
from ejkernel.testing.numerics import assert_close, run_jitted
from ejkernel.testing.page_attention import SHAPES, PageAttentionConformance, reference_page_attention
from ejkernel_xla.page_attention import XlaPageAttentionConfig


class TestXlaPageAttention(PageAttentionConformance):
    platform = "xla"


def test_every_block_pages_agrees():
    """Pages per scan step (one step, several, a partial last one) do not change the result."""
    inputs = PageAttentionConformance().make_inputs(11, SHAPES["long"], "float32")
    expected = run_jitted(reference_page_attention, **inputs)
    for pages in (1, 5, 64):
        out = jax.jit(lambda **kw: page_attention(**kw, cfg=XlaPageAttentionConfig(block_pages=pages)))(**inputs)  # noqa: B023
        assert_close(out, expected, dtype=jnp.float32, name=f"block_pages={pages}")


def test_heuristic_config_is_the_config_that_runs():
    """The heuristic spells out the step a config left at None takes (the executor stores what runs)."""
    from ejkernel_xla.page_attention import IMPLEMENTATION

    suite = TestXlaPageAttention()
    inputs = suite.make_inputs(11, SHAPES["long"], "float32")
    cfg = suite.heuristic_config_that_runs(IMPLEMENTATION, inputs, XlaPageAttentionConfig())
    assert isinstance(cfg.block_pages, int)


@pytest.mark.parametrize("precision", [None, "default", "highest"])
def test_matmuls_run_at_the_call_precision(precision):
    """float32 inputs: HIGHEST unless asked otherwise, in the forward and in the gradient's matmuls."""
    suite = TestXlaPageAttention()
    inputs = suite.make_inputs(12, SHAPES["mha"], "float32")
    expected = jax.lax.Precision.HIGHEST if precision in (None, "highest") else jax.lax.Precision.DEFAULT
    suite.assert_matmul_precision(inputs, "query", precision, expected)
