"""Bad input reads clearly: annotation violations become one ValueError sentence naming the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import flash_attention
from ejkernel.modules.operations._validation import ArgumentTypeError


def test_shape_mismatch_names_argument_shape_and_bound_sizes():
    query, key = jnp.ones((2, 16, 4, 8)), jnp.ones((3, 16, 2, 8))
    with pytest.raises(ValueError) as info:
        flash_attention(query, key, key)
    message = str(info.value)
    assert isinstance(info.value, (ArgumentTypeError, TypeError))
    assert message.startswith("flash_attention: argument 'key' is float32[3, 16, 2, 8]; expected Float[Array, ")
    assert "batch=2" in message and "\n" not in message


def test_wrong_rank_is_one_sentence():
    with pytest.raises(ValueError, match=r"argument 'query' is float32\[16, 4, 8\]; expected Float\[Array, 'batch q_len"):
        flash_attention(jnp.ones((16, 4, 8)), jnp.ones((1, 16, 2, 8)), jnp.ones((1, 16, 2, 8)))


def test_a_numpy_array_is_named_as_such():
    """A numpy array of a fitting shape where a JAX array is annotated: the sentence says what is wrong."""
    query = jnp.ones((1, 8, 4, 16))
    with pytest.raises(ValueError, match=r"argument 'softmax_aux' is a numpy array float32\[4\] \(pass a JAX array"):
        flash_attention(query, query, query, softmax_aux=np.zeros(4, np.float32))


def test_dtype_mix_is_a_value_error_from_validation():
    query = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"value must have the same dtype as query \(float32\), got bfloat16"):
        flash_attention(query, query, query.astype(jnp.bfloat16))
