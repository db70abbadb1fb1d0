"""TPU ragged paged attention in interpret mode: the shared conformance suite, and Mosaic lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import abstract_device

from ejkernel.modules import RaggedPageAttentionCall
from ejkernel.testing.numerics import INTERPRET_COMPILER_OPTIONS, matmul_precisions
from ejkernel.testing.ragged_page_attention import CASES, RaggedPageAttentionConformance
from ejkernel_pallas.ragged_page_attention import TpuRaggedPageBlocks, ragged_page_attention


class TestPallasRaggedPageAttentionConformance(RaggedPageAttentionConformance):
    platform = "pallas"
    compiler_options = INTERPRET_COMPILER_OPTIONS  # the interpreted kernels are compile-bound on CPU
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield


def test_lowers_for_tpu():
    queries = jax.ShapeDtypeStruct((256, 8, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((64, 16, 4, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    tables = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    starts = jax.ShapeDtypeStruct((5,), jnp.int32)
    count = jax.ShapeDtypeStruct((1,), jnp.int32)

    def fn(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs):
        call = RaggedPageAttentionCall(
            queries=queries, kv_pages=kv_pages, context_lens=context_lens, block_tables=block_tables,
            query_start_loc=query_start_loc, num_seqs=num_seqs, softmax_aux=jnp.zeros((8,)), softmax_scale=0.1,
            logits_soft_cap=30.0, sliding_window=64,
        )
        return ragged_page_attention(call, TpuRaggedPageBlocks(block_q=128), interpret=False)

    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(fn).trace(queries, pages, lens, tables, starts, count).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize(
    "dtype,precision,expected",
    [("float32", None, jax.lax.Precision.HIGHEST), ("float32", "high", jax.lax.Precision.HIGH),
     ("bfloat16", None, jax.lax.Precision.DEFAULT)],
)
def test_float32_dots_take_the_calls_precision(pallas_interpret, dtype, precision, expected):
    """Mosaic's default dot is bf16 passes: a float32 call's precision reaches both dots of the kernel."""
    suite = TestPallasRaggedPageAttentionConformance()
    inputs = suite.make_inputs(1, CASES["decode_mha"], dtype)

    def fn(queries):
        return suite.call(**{**inputs, "queries": queries}, precision=precision)

    found = matmul_precisions(fn, inputs["queries"])
    assert len(found) == 2 and set(found) == {expected}, found
