"""XLA ``recurrent_attention`` against the shared conformance suite, plus the XLA linear-attention engine's
own checks (it serves ``recurrent``, ``gla`` and ``lightning_attention``): matmul precision forward and
backward, and its config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import gla_attention, lightning_attention, recurrent_attention
from ejkernel.testing.numerics import matmul_precisions, normal_array
from ejkernel.testing.recurrent import RecurrentConformance, log_sigmoid_gate
from ejkernel_xla.recurrent import XlaLinearAttentionConfig

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


class TestXlaRecurrent(RecurrentConformance):
    platform = "xla"
    chunk_config = XlaLinearAttentionConfig


OPERATIONS = {
    "recurrent": lambda q, k, v, g, **kw: recurrent_attention(q, k, v, g, gv=g[..., :1] * jnp.ones(v.shape[-1]), **kw),
    "gla": lambda q, k, v, g, **kw: gla_attention(q, k, v, g, **kw),
    "lightning": lambda q, k, v, g, **kw: lightning_attention(q, k, v, 1, 4, **kw),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize(
    "dtype,precision,expected",
    [("float32", None, HIGHEST), ("float32", "default", DEFAULT), ("bfloat16", None, DEFAULT),
     ("bfloat16", "highest", HIGHEST)],
)
def test_every_matmul_forward_and_backward_runs_at_the_precision(operation, dtype, precision, expected):
    """None means HIGHEST for float32 (TF32 on a GPU otherwise); the gradient's matmuls too."""
    q, k, v = (normal_array(i, (1, 20, 2, 8), dtype) for i in range(3))
    g = log_sigmoid_gate(3, (1, 20, 2, 8))
    op = OPERATIONS[operation]

    def loss(q, k, v, g):
        out, final = op(q, k, v, g, precision=precision, platform="xla", cfg=XlaLinearAttentionConfig(chunk_size=16))
        return out.astype(jnp.float32).sum() + final.sum()

    found = matmul_precisions(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, g)
    assert found and set(found) == {expected}, found


def test_config_selects_the_implementation_and_checks_its_chunk_size():
    q, k, v = (normal_array(i, (1, 9, 2, 8)) for i in range(3))
    out, _ = recurrent_attention(q, k, v, cfg=XlaLinearAttentionConfig(chunk_size=4))  # platform auto -> xla
    want, _ = recurrent_attention(q, k, v, platform="xla")
    assert jnp.allclose(out, want, rtol=1e-5, atol=1e-6)
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="XlaLinearAttentionConfig.chunk_size"):
            XlaLinearAttentionConfig(chunk_size=bad)
    with pytest.raises(TypeError, match="XlaLinearAttentionConfig"):
        recurrent_attention(q, k, v, platform="xla", cfg=object())


def test_heuristic_config_is_the_chunk_that_runs():
    """The heuristic spells out the chunk a config left at None takes: 64, or 16 with a value-dimension gate."""
    from ejkernel.modules.operations.recurrent import RecurrentAttention
    from ejkernel_xla.recurrent import IMPLEMENTATION, MATMUL_CHUNK, PAIRWISE_CHUNK

    q, k, v = (normal_array(i, (1, 9, 2, 8)) for i in range(3))
    gv = log_sigmoid_gate(3, (1, 9, 2, 8))
    assert IMPLEMENTATION.heuristic_config(RecurrentAttention().validate(q, k, v)).chunk_size == MATMUL_CHUNK
    with_gv = RecurrentAttention().validate(q, k, v, gv=gv)
    assert IMPLEMENTATION.heuristic_config(with_gv).chunk_size == PAIRWISE_CHUNK
