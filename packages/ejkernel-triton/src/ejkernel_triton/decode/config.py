"""The decode kernels' config (:class:`TritonDecodeConfig`), its heuristic and autotuning space, and how a
config splits a sequence's keys over programs (:func:`split_plan`).

Decode reads every cached key and value once and does little arithmetic on it, so it is bound by memory
bandwidth: the config's job is to keep enough bytes in flight on every SM. ``num_splits`` cuts each
sequence's keys into that many chunks, one program each (flash-decoding), so that a small batch or a few kv
heads still put work on all SMs; the heuristic aims at about ``PROGRAMS_PER_SM`` programs per SM without
cutting chunks below ``MIN_CHUNK`` keys (each split writes a float32 partial result that a second pass
merges, which is cheap next to the keys it saves only while chunks stay long).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

MAX_HEAD_DIM = 256
PROGRAMS_PER_SM = 2
"""Programs the heuristic aims at per SM, rounded down (never fewer than one split): few long-lived programs.
Measured on the H200 (2026-11-23, 32 x 4096, pages of 16): one split (256 programs, ~2 per SM) streamed 3222 GB/s,
3 splits 3043, 5 (the former target of 8 per SM) 2697, 10 splits 2740."""
MIN_CHUNK = 256
"""Fewest keys the heuristic gives one split."""
DEFAULT_SM_COUNT = 132  # H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class TritonDecodeConfig:
    """Launch parameters of the split (flash-decoding) kernel; the result does not depend on them.

    ``block_n``: keys per loop step (a power of two >= 16). ``num_splits``: programs per sequence and kv head
    (``1``: one pass writes the output; more: a second kernel merges the splits' partial results).
    ``num_warps``: Triton's warps per program. ``prefetch``: key/value steps in flight ahead of the one being
    computed (shared-memory buffers of the software pipeline; see :meth:`num_stages`). ``inline_combine``
    (several splits): the last split of each (sequence, head block) to finish merges the partials, through an
    arrival counter, instead of a second launch.
    """

    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    prefetch: int = 2
    inline_combine: bool = False

    def num_stages(self, paged: bool) -> int:
        """Triton's ``num_stages`` that gives ``prefetch`` buffers. Triton 3.6's pipeliner divides the stages
        between an indirect load and the loads it feeds: the paged loop's block-table lookup takes as many
        stages as the keys (checked in the sm_90 TTGIR: 3 or 4 stages left the paged loop one buffer and a
        full wait each step, 5 gave two buffers)."""
        return (2 if paged else 1) * self.prefetch + 1

    def __post_init__(self):
        if not isinstance(self.inline_combine, bool):
            raise ValueError(f"TritonDecodeConfig.inline_combine must be a bool, got {self.inline_combine!r}")
        for field in dataclasses.fields(self):
            if field.name == "inline_combine":
                continue
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TritonDecodeConfig.{field.name} must be a positive int, got {value!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"TritonDecodeConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"TritonDecodeConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")


def split_plan(max_tokens: int, block_n: int, num_splits: int) -> tuple[int, int]:
    """``(chunk, splits)``: keys per split (a multiple of ``block_n``) and the number of splits that cover
    ``max_tokens`` keys (at most ``num_splits``; fewer when the chunks would be shorter than one block)."""
    max_tokens = max(int(max_tokens), 1)
    splits = max(1, min(num_splits, math.ceil(max_tokens / block_n)))
    chunk = math.ceil(math.ceil(max_tokens / splits) / block_n) * block_n
    return chunk, math.ceil(max_tokens / chunk)


def block_heads(group: int) -> int:
    """Query heads of one kv group per program: the rows of the tile (``tl.dot`` needs >= 16); groups
    larger than 64 take several programs (each reading the keys again)."""
    return min(64, max(16, 1 << (group - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    try:
        import jax

        device = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_SM_COUNT
    return int(getattr(device, "core_count", 0) or DEFAULT_SM_COUNT) if device.platform == "gpu" else DEFAULT_SM_COUNT


def default_block_n(head_dim: int, dtype) -> int:
    """64 keys of 256-byte rows (bf16/fp16, D <= 128): 32 KB of K and V per step; fewer for wider rows."""
    row_bytes = max(16, 1 << (head_dim - 1).bit_length()) * np.dtype(dtype).itemsize
    return max(16, min(64, 64 * 256 // row_bytes))


def heuristic_splits(work: int, max_tokens: int, sms: int | None = None) -> int:
    """Splits per (sequence, kv head): at most ``PROGRAMS_PER_SM`` programs per SM (at least one split), chunks
    >= ``MIN_CHUNK``.

    ``work``: programs per split (sequences x kv heads x head blocks); ``max_tokens``: the longest context the
    call can have (static).
    """
    target = PROGRAMS_PER_SM * (sms or sm_count())
    by_work = max(1, target // max(work, 1))
    by_length = max(1, max_tokens // MIN_CHUNK)
    return max(1, min(by_work, by_length))


RESIDENT_PROGRAMS = 3
"""Split programs one SM holds at once (bf16, D=128, 64-key steps, two in flight: 72 KB of shared memory
each, sm_90 TTGIR; NOTES.md)."""
WAVE_FILL = 0.9
"""Share of the last wave's slots that :func:`wave_splits` asks to be busy."""


def wave_splits(work: int, max_tokens: int, sms: int | None = None, resident: int = RESIDENT_PROGRAMS) -> int:
    """Splits that make whole waves (a schedule candidate, NOTES.md "decode schedule"; not the default until
    measured): the fewest splits whose programs fill at least ``WAVE_FILL`` of every wave's
    ``sms x resident`` slots, chunks >= ``MIN_CHUNK``; without one, the best-filled count."""
    slots = (sms or sm_count()) * resident
    most = max(1, max_tokens // MIN_CHUNK)
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        programs = max(work, 1) * splits
        fill = programs / (math.ceil(programs / slots) * slots)
        if fill >= WAVE_FILL:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def heuristic_config(work: int, max_tokens: int, head_dim: int, dtype) -> TritonDecodeConfig:
    block_n = default_block_n(head_dim, dtype)
    return TritonDecodeConfig(block_n=block_n, num_splits=heuristic_splits(work, max_tokens), num_warps=4,
                              prefetch=2)


def candidate_configs(work: int, max_tokens: int, head_dim: int, dtype) -> list[TritonDecodeConfig]:
    """The heuristic first, then other blocks, pipeline depths and split counts (autotuning only)."""
    base = heuristic_config(work, max_tokens, head_dim, dtype)
    out = [base]
    splits = sorted({max(1, base.num_splits // 2), base.num_splits, base.num_splits * 2})
    for block_n in sorted({16 if base.block_n <= 32 else 32, base.block_n, min(128, base.block_n * 2)}):
        for prefetch in (1, 2, 3):
            for num_splits in splits:
                config = TritonDecodeConfig(block_n=block_n, num_splits=num_splits, num_warps=4, prefetch=prefetch)
                if config not in out:
                    out.append(config)
    return out
