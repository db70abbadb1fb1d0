"""Ring attention with the TPU block kernels, interpret mode: the shared suite (8-device CPU mesh in a
subprocess, one device in process)."""

from __future__ import annotations

import pytest
from pallas_test_helpers import interpret_conformance

from ejkernel.testing.ring_attention import RingAttentionConformance


@interpret_conformance
class TestPallasRingAttentionConformance(RingAttentionConformance):
    platform = "pallas"

    @pytest.fixture(autouse=True)
    def _interpret_mode(self, pallas_interpret):
        yield


def test_one_device_ring_matches_flash_attention_with_gradients():
    """CI-sized check (the 8-device suite is gated): P = 1, window + segments + sinks, output and grads."""
    import jax
    import jax.numpy as jnp
    from pallas_reference import flash_attention_reference
    from pallas_test_helpers import normal, out_and_grads, rel_err

    from ejkernel_pallas.ring_attention import ring_attention

    ks = jax.random.split(jax.random.key(51), 4)
    q, k, v = normal(ks[0], (1, 24, 4, 16)), normal(ks[1], (1, 24, 2, 16)), normal(ks[2], (1, 24, 2, 16))
    aux = normal(ks[3], (4, 2))
    seg = (jnp.arange(24)[None] >= 9).astype(jnp.int32)
    kw = dict(softmax_scale=0.3, causal=True, sliding_window=(7, 0), logits_soft_cap=5.0)

    def ring(q, k, v, aux):
        return ring_attention(q, k, v, seg, seg, aux, **kw, axis_name=None, interpret=True)

    def flash(q, k, v, aux):
        return flash_attention_reference(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, softmax_aux=aux, **kw)

    out, grads = out_and_grads(ring, (0, 1, 2, 3))(q, k, v, aux)
    want, want_grads = out_and_grads(flash, (0, 1, 2, 3))(q, k, v, aux)
    assert rel_err(out, want) < 2e-6
    for name, g, w in zip("qkva", grads, want_grads):
        assert rel_err(g, w) < 1e-5, name
