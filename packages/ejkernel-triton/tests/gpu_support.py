"""What the Triton package's GPU test files share: the marks that run a file only on a GPU (`pytest -m gpu`),
and the float32 reference their bf16 serving checks compare with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]
"""A GPU test file's ``pytestmark``."""


def float32_reference(fn, **inputs):
    """``fn(**inputs)`` jitted, its bf16/fp16 inputs upcast to float32 and its matmuls at HIGHEST precision."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda **kw: fn(**{k: v.astype(jnp.float32) if v is not None and v.dtype in (jnp.bfloat16, jnp.float16)
                                          else v for k, v in kw.items()}))(**inputs)
