"""The static fields every Pallas attention kernel family (GPU and TPU flash, block-sparse) takes from a
validated call, in one place."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def attention_fields(call: Any, *, sq: int, skv: int, groups: int) -> dict[str, Any]:
    """Scale, masks, sizes and the GQA group of ``call`` (a flash or block-sparse attention call) as the
    kernels' ``_Static`` fields: ``q_offset`` aligns the last query with the last key (``skv - sq``);
    ``exact_delta``: float32 inputs compute the backward's row sums exactly."""
    return dict(
        scale=call.softmax_scale,
        causal=call.causal,
        window=call.sliding_window,
        soft_cap=call.logits_soft_cap,
        sq=sq,
        skv=skv,
        q_offset=skv - sq,
        groups=groups,
        exact_delta=call.query.dtype == jnp.float32,
    )
