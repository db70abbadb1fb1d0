"""TPU paged decode attention in interpret mode: the shared conformance suite, and Mosaic lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from pallas_test_helpers import abstract_device, interpret_conformance

from ejkernel.testing.page_attention import PageAttentionConformance
from ejkernel_pallas.page_attention import page_attention


@interpret_conformance
class TestPallasPageAttentionConformance(PageAttentionConformance):
    platform = "pallas"
    supports_gradients = False  # an inference kernel: a gradient raises UnsupportedFeature

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield


def test_lowers_for_tpu():
    query = jax.ShapeDtypeStruct((8, 16, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((64, 4, 16, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((8,), jnp.int32)
    tables = jax.ShapeDtypeStruct((8, 8), jnp.int32)
    fn = lambda q, k, v, lens, tables: page_attention(  # noqa: E731
        q, k, v, lens, tables, attn_scale=0.1, max_context_len=128, attn_logits_soft_cap=30.0, interpret=False
    )
    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(fn).trace(query, cache, cache, lens, tables).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


def test_interpret_numerics_gqa_soft_cap_and_empty_sequence():
    """CI-sized numerics (the full suite is gated): GQA, soft cap, a length-0 sequence, partial last page."""
    from ejkernel.testing.page_attention import random_array, random_block_tables, reference_page_attention

    lengths = jnp.asarray([13, 0, 24], jnp.int32)
    tables = jnp.asarray(random_block_tables(3, 3, 4, 12, lengths, 8))
    query = random_array(1, (3, 4, 16))
    keys, values = random_array(2, (12, 2, 8, 16)), random_array(3, (12, 2, 8, 16))
    kw = dict(attn_scale=0.3, max_context_len=32, attn_logits_soft_cap=4.0)
    out = jax.jit(lambda *a: page_attention(*a, **kw, interpret=True))(query, keys, values, lengths, tables)
    want = reference_page_attention(query, keys, values, lengths, tables, **kw)
    assert float(jnp.max(jnp.abs(out - want))) < 1e-5
    assert float(jnp.max(jnp.abs(out[1]))) == 0.0
    with pytest.raises(Exception, match="forward-only"):
        jax.grad(lambda q: page_attention(q, keys, values, lengths, tables, **kw, interpret=True).sum())(query)
