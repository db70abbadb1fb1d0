"""Layout rules Mosaic TPU imposes on Pallas blocks, checked before anything is lowered.

A TPU vector register is an (8 sublanes x 128 lanes) tile of 32-bit words; narrower dtypes pack along
sublanes (16 rows of bf16, 32 rows of int8 per tile). Mosaic therefore requires every block's last two
dimensions to be tiles: the last dim a multiple of 128 and the second-to-last a multiple of the dtype's
sublane count, unless the block spans that whole array dimension (Mosaic pads a whole dimension itself).
Violations surface as Mosaic compile errors deep in lowering; :func:`check_block` names the block instead.
"""

from __future__ import annotations

import numpy as np

LANES = 128
SUBLANES_32BIT = 8


class TpuTilingError(ValueError):
    """A block shape a TPU cannot tile (raised before lowering, naming the block and the rule)."""


def sublane_multiple(dtype) -> int:
    """Rows per (8, 128) register tile for ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    itemsize = np.dtype(dtype).itemsize
    return SUBLANES_32BIT * max(1, 4 // itemsize)


def check_block(name: str, block_shape, array_shape, dtype) -> None:
    """Raise :class:`TpuTilingError` unless ``block_shape`` tiles ``array_shape`` on a TPU.

    ``None`` entries in ``block_shape`` are squeezed dimensions (block size 1, free of tiling rules).
    """
    block = tuple(1 if b is None else b for b in block_shape)
    if len(block) != len(array_shape):
        raise TpuTilingError(f"{name}: block {block_shape} has a different rank than array {array_shape}")
    for size, full in zip(block, array_shape):
        if full % size:
            raise TpuTilingError(f"{name}: block {block_shape} does not divide array {tuple(array_shape)}")
    if len(block) >= 1 and block_shape[-1] is not None:
        last, full = block[-1], array_shape[-1]
        if last != full and last % LANES:
            raise TpuTilingError(
                f"{name}: last block dim {last} must be a multiple of {LANES} (TPU lanes) or the whole "
                f"dimension {full}; block {block_shape}, array {tuple(array_shape)}"
            )
    if len(block) >= 2 and block_shape[-2] is not None:
        rows, full, need = block[-2], array_shape[-2], sublane_multiple(dtype)
        if rows != full and rows % need:
            raise TpuTilingError(
                f"{name}: second-to-last block dim {rows} must be a multiple of {need} (sublanes for "
                f"{np.dtype(dtype).name}) or the whole dimension {full}; block {block_shape}, "
                f"array {tuple(array_shape)}"
            )
