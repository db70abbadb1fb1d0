"""Hashable parameter carriers for kernel configs (block sizes, warps, pipeline stages).

Every field is optional: ``None`` means "let the implementation choose". Both classes are frozen
dataclasses, so they hash and compare by value and serialize stably (:func:`ejkernel.ops.stable_json`),
which is what config caches and autotuning need.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BwdParams", "FwdParams"]


@dataclasses.dataclass(frozen=True)
class _BlockSizes:
    """The block sizes both passes have (the first fields of each, in this order)."""

    blocksize_m: int | None = None
    """Block size of the M dimension (rows of the output)."""
    blocksize_k: int | None = None
    """Block size of the K (reduction) dimension."""
    blocksize_n: int | None = None
    """Block size of the N dimension (columns of the output)."""
    q_blocksize: int | None = None
    """Block size over queries (attention)."""
    kv_blocksize: int | None = None
    """Block size over keys/values (attention)."""


@dataclasses.dataclass(frozen=True)
class FwdParams(_BlockSizes):
    """Forward-pass parameters (attention and matmul-like kernels)."""

    blocksize_heads: int | None = None
    """Heads processed per block (multi-head attention)."""
    blocksize_keys: int | None = None
    """Block size over the key sequence."""
    num_key_splits: int | None = None
    """Number of splits of the key sequence (split-K / flash decoding)."""
    num_warps: int | None = None
    """GPU warps per program."""
    num_stages: int | None = None
    """Software pipeline stages."""


@dataclasses.dataclass(frozen=True)
class BwdParams(_BlockSizes):
    """Backward-pass parameters (usually smaller blocks than the forward: more live tensors)."""

    num_warps: int | None = None
    """GPU warps per program."""
    num_stages: int | None = None
    """Software pipeline stages."""
