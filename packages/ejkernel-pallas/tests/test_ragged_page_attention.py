"""TPU ragged paged attention in interpret mode: the shared conformance suite, and Mosaic lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from pallas_test_helpers import FLOAT32_DOTS_TAKE_THE_CALLS_PRECISION, InterpretedConformance, abstract_device

from ejkernel.modules import RaggedPageAttentionCall
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.ragged_page_attention import CASES, RaggedPageAttentionConformance
from ejkernel_pallas.ragged_page_attention import TpuRaggedPageBlocks, ragged_page_attention


class TestPallasRaggedPageAttentionConformance(InterpretedConformance, RaggedPageAttentionConformance):
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature
    supports_quantized_cache = False  # refused: platform='xla' takes quantized and scaled caches
    quantized_cache_dtypes = ("int8",)  # one dtype shows the refusal


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


@FLOAT32_DOTS_TAKE_THE_CALLS_PRECISION
def test_float32_dots_take_the_calls_precision(pallas_interpret, dtype, precision, expected):
    """Mosaic's default dot is bf16 passes: a float32 call's precision reaches both dots of the kernel."""
    suite = TestPallasRaggedPageAttentionConformance()
    inputs = suite.make_inputs(1, CASES["decode_mha"], dtype)

    def fn(queries):
        return suite.call(**{**inputs, "queries": queries}, precision=precision)

    found = matmul_precisions(fn, inputs["queries"])
    assert len(found) == 2 and set(found) == {expected}, found
