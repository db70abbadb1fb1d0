"""The gradient of an inference kernel (the serving ops' Pallas kernels): refused with a pointer to the XLA
implementation, which differentiates."""

from __future__ import annotations

import functools

import jax

from ejkernel.errors import UnsupportedFeature


def forward_only(forward, operation: str):
    """``forward(static, *arrays)`` (``static`` hashable, not differentiated) whose gradient raises
    :class:`UnsupportedFeature` naming ``operation``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attend(static, *arrays):
        return forward(static, *arrays)

    def attend_fwd(static, *arrays):
        return forward(static, *arrays), None

    def attend_bwd(static, residuals, d_out):
        raise UnsupportedFeature(
            f"pallas {operation} is forward-only (an inference kernel); for gradients use platform='xla'"
        )

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
