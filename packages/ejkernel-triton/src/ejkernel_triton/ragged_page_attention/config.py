"""The config of Triton ``ragged_page_attention`` (:class:`TritonRaggedPageConfig`), its heuristic and
autotuning space.

A mixed batch runs two launches: the decode rows (``q_len == 1``) through the split-K decode kernels of
``ejkernel_triton.decode`` (fields ``decode_*``, a :class:`~ejkernel_triton.decode.TritonDecodeConfig`), the
prefill chunks through a flash-style kernel over pages (fields ``block_m``, ``block_n``, ``num_warps``,
``prefetch``): ``block_m`` rows of (query token, query head of the kv group) pairs per program, so every head
of a kv group is served from one read of each page.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ejkernel_triton.decode import config as decode_tuning
from ejkernel_triton.decode.config import TritonDecodeConfig

MAX_GROUP = 128
"""Largest query-heads-per-kv-head group the prefill tile holds (its rows are tokens x group)."""


@dataclasses.dataclass(frozen=True)
class TritonRaggedPageConfig:
    """``block_m``: rows of the prefill tile (query tokens x the kv group's heads, padded to a power of two;
    a power of two >= 16). ``block_n``: keys per prefill step (a power of two >= 16). ``num_warps``,
    ``prefetch``: the prefill kernel's warps and K/V steps in flight. ``decode_*``: the decode rows' split-K
    config (see :class:`~ejkernel_triton.decode.TritonDecodeConfig`). ``fused``: one launch runs the decode
    split programs and the prefill tiles side by side (SMs stream decode keys while others multiply prefill
    tiles) instead of one launch after the other; it takes the prefill's ``num_warps`` for both. ``interleave``
    (with ``fused``): decode and prefill programs alternate in the launch's order instead of decode first, so
    that every SM holds both kinds from the start."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    prefetch: int = 2
    decode_block_n: int = 64
    decode_num_splits: int = 1
    decode_num_warps: int = 4
    decode_prefetch: int = 2
    decode_inline_combine: bool = False
    fused: bool = False
    interleave: bool = False

    def __post_init__(self):
        for name in ("decode_inline_combine", "fused", "interleave"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TritonRaggedPageConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for field in dataclasses.fields(self):
            if field.name in ("decode_inline_combine", "fused", "interleave"):
                continue
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TritonRaggedPageConfig.{field.name} must be a positive int, got {value!r}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TritonRaggedPageConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"TritonRaggedPageConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        try:
            self.decode_config()
        except ValueError as error:  # name this config's field, not the decode config's
            raise ValueError(str(error).replace("TritonDecodeConfig.", "TritonRaggedPageConfig.decode_")) from None

    def decode_config(self) -> TritonDecodeConfig:
        return TritonDecodeConfig(block_n=self.decode_block_n, num_splits=self.decode_num_splits,
                                  num_warps=self.decode_num_warps, prefetch=self.decode_prefetch,
                                  inline_combine=self.decode_inline_combine)

    def num_stages(self) -> int:
        """Triton's stages for ``prefetch`` buffers of the paged loop (see ``TritonDecodeConfig.num_stages``)."""
        return 2 * self.prefetch + 1


def padded_group(group: int) -> int:
    return 1 << (group - 1).bit_length()


def heuristic_config(max_num_seqs: int, kv_heads: int, group: int, max_tokens: int, head_dim: int,
                     dtype, page_size: int = 0) -> TritonRaggedPageConfig:
    """Pages that hold whole 64-key steps (``page_size % 64 == 0``, bf16/fp16, D <= 128): ONE launch
    (``fused``) of the decode split programs (64-key steps, two in flight, one split) and 64-row, 4-warp
    prefill tiles, the fastest schedule measured on the H200 (2026-11-23, batch 2: 625 us against 718 us for
    two launches, pages of 64; NOTES.md). Otherwise two launches (fused was slower with per-row page lookups:
    876 against 831 us, pages of 16): 128-row prefill tiles (64 for rows wider than 256 bytes), 8 warps, two
    steps in flight, and the decode package's heuristic for ``max_num_seqs`` sequences (every slot may be a
    decode row)."""
    work = max_num_seqs * kv_heads * -(-group // decode_tuning.block_heads(group))
    decode = decode_tuning.heuristic_config(work, max_tokens, head_dim, dtype)
    wide_rows = head_dim * np.dtype(dtype).itemsize > 256  # float32 or D > 128: half the tile (registers)
    block_n = decode_tuning.default_block_n(head_dim, dtype)
    if page_size and page_size % 64 == 0 and block_n == 64 and padded_group(group) <= 64:
        # the fused kernel takes the larger program's registers and shared memory: the decode programs keep
        # the wide (64-key, two in flight) steps, whose shared memory the 64-row prefill tile's covers
        return TritonRaggedPageConfig(block_m=64, block_n=block_n, num_warps=4, prefetch=2, decode_block_n=block_n,
                                      decode_num_splits=decode_tuning.heuristic_splits(work, max_tokens),
                                      decode_num_warps=4, decode_prefetch=2, fused=True)
    block_m = max(64 if wide_rows else 128, padded_group(group))
    return TritonRaggedPageConfig(block_m=block_m, block_n=block_n, num_warps=8 if block_m >= 128 else 4,
                                  prefetch=2, decode_block_n=decode.block_n, decode_num_splits=decode.num_splits,
                                  decode_num_warps=decode.num_warps, decode_prefetch=decode.prefetch,
                                  decode_inline_combine=decode.inline_combine)


def candidate_configs(max_num_seqs: int, kv_heads: int, group: int, max_tokens: int, head_dim: int,
                      dtype, page_size: int = 0) -> list[TritonRaggedPageConfig]:
    """The heuristic first, then other prefill tiles and decode splits (autotuning only)."""
    base = heuristic_config(max_num_seqs, kv_heads, group, max_tokens, head_dim, dtype, page_size)
    out = [base]
    for block_m, num_warps in ((64, 4), (128, 8), (128, 4)):
        for block_n in (32, 64):
            for splits in sorted({max(1, base.decode_num_splits // 2), base.decode_num_splits,
                                  base.decode_num_splits * 2}):
                if block_m < padded_group(group):
                    continue
                config = dataclasses.replace(base, block_m=block_m, num_warps=num_warps, block_n=block_n,
                                             decode_num_splits=splits)
                if config not in out:
                    out.append(config)
    for config in list(out[:1]):  # the heuristic's, as one launch
        out.append(dataclasses.replace(config, fused=not config.fused))
    return out
