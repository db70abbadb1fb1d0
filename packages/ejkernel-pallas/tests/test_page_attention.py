"""TPU paged decode attention in interpret mode: the shared conformance suite, and Mosaic lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from pallas_test_helpers import FLOAT32_DOTS_TAKE_THE_CALLS_PRECISION, InterpretedConformance, abstract_device

from ejkernel.modules import PageAttentionCall
from ejkernel.modules import page_attention as public_page_attention
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.page_attention import SHAPES, PageAttentionConformance
from ejkernel_pallas.page_attention import page_attention


class TestPallasPageAttentionConformance(InterpretedConformance, PageAttentionConformance):
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature
    supports_quantized_cache = False  # refused: platform='xla' takes quantized and scaled caches
    quantized_cache_dtypes = ("int8",)  # one dtype shows the refusal


def test_lowers_for_tpu():
    query = jax.ShapeDtypeStruct((8, 16, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((64, 4, 16, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((8,), jnp.int32)
    tables = jax.ShapeDtypeStruct((8, 8), jnp.int32)

    def fn(q, k, v, lens, tables):
        call = PageAttentionCall(
            query=q, key_cache=k, value_cache=v, context_lens=lens, block_tables=tables, attn_scale=0.1,
            max_context_len=128, attn_logits_soft_cap=30.0,
        )
        return page_attention(call, interpret=False)

    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(fn).trace(query, cache, cache, lens, tables).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


@FLOAT32_DOTS_TAKE_THE_CALLS_PRECISION
def test_float32_dots_take_the_calls_precision(pallas_interpret, dtype, precision, expected):
    """Mosaic's default dot is bf16 passes: a float32 call's precision reaches both dots of the kernel."""
    inputs = PageAttentionConformance().make_inputs(1, SHAPES["mha"], dtype)

    def fn(query):
        return public_page_attention(**{**inputs, "query": query}, precision=precision, platform="pallas")

    found = matmul_precisions(fn, inputs["query"])
    assert len(found) == 2 and set(found) == {expected}, found
