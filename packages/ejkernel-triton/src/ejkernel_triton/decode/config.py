"""The decode kernels' config (:class:`TritonDecodeConfig`), its heuristic and autotuning space, and how a
config splits a sequence's keys over programs (:func:`split_plan`).

Decode reads every cached key and value once and does little arithmetic on it, so it is bound by memory
bandwidth. The heuristic's model (measured on the H200, packages/ejkernel-triton/NOTES.md "decode heuristic"):
equal-length programs start and end together, so the grid should be ONE wave: every program resident at once,
as many of the SM's slots busy as the work allows. A program's slots per SM follow from its shared memory
(:func:`resident_programs`) and registers: 64-key steps with two in flight take 72 KB (3 per SM), 32-key steps
with three in flight 55 KB (4 per SM); over float8 caches the 64-key program's registers allow 3. With few
(sequence, kv head) pairs, ``num_splits`` cuts each sequence's keys into chunks (flash-decoding) until the wave
is full; with more pairs than one wave of the 64-key program holds, paged
caches take the 32-key program when its wave is fuller (batch 64 x 8 kv heads: 512 programs = one wave of 528
slots instead of 1.3 waves of 396, where the last 0.3 wave streamed alone: 70 % of the copy bandwidth measured).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

MAX_HEAD_DIM = 256
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


SHARED_MEMORY_PER_SM = 228 * 1024
"""sm_90: shared memory of one SM, 1 KB of it reserved per resident program."""
SHARED_MEMORY_EXTRA = 8 * 1024
"""A program's shared memory besides its K/V buffers (the query tile, the probabilities, the page ids): 72192 B
in all at 64-key steps with two in flight, bf16, D=128 (sm_90 compile, ptxas)."""
MAX_RESIDENT = 4
"""Programs per SM at most (4 warps each): what 128 registers per thread allow."""
REGISTERS_PER_SM = 65536
PROGRAM_REGISTERS = {
    ("16-bit", 64, 2): 96, ("16-bit", 128, 1): 168, ("16-bit", 32, 3): 70,
    ("float8", 64, 2): 149, ("float8", 128, 1): 206, ("float8", 32, 3): 102,
    ("int8", 64, 2): 128, ("int8", 128, 1): 205, ("int8", 32, 3): 94,
}
"""Registers per thread of the paged decode program by (cache kind, block_n, prefetch): ptxas -v for sm_90, 4
warps, D=128, pages of 64, one scale per kv head (``benchmarks/decode_resources.py [--kv-dtype ...]``,
2026-11-27). One-byte caches need more than bf16 ones (the conversions' registers): float8's 64-key program
takes 149, so 3 fit on an SM where its 39 KB of shared memory would allow 5. Configs not listed are assumed to
fit :data:`MAX_RESIDENT`."""
MIN_CHUNK = 256
"""Fewest keys the heuristic gives one split."""
NARROW_PREFETCH = 3
"""K/V steps in flight of the half-width (32-key) program the heuristic uses to fit 4 programs on an SM."""


def cache_kind(dtype) -> str:
    """The key of :data:`PROGRAM_REGISTERS` for a cache dtype ("float8", "int8", "16-bit" or the dtype's name)."""
    dtype = np.dtype(dtype)
    if dtype.name.startswith("float8"):
        return "float8"
    return "16-bit" if dtype.itemsize == 2 else dtype.name


def resident_programs(block_n: int, prefetch: int, head_dim: int, dtype) -> int:
    """Decode programs one SM holds at once (4 warps): by shared memory, the K/V buffers (``prefetch`` steps of
    ``block_n`` keys, K and V) and :data:`SHARED_MEMORY_EXTRA` per program; by registers,
    :data:`PROGRAM_REGISTERS` (allocated in units of 8 per thread); at most :data:`MAX_RESIDENT`."""
    row_bytes = max(16, 1 << (head_dim - 1).bit_length()) * np.dtype(dtype).itemsize
    per_program = 2 * prefetch * block_n * row_bytes + SHARED_MEMORY_EXTRA + 1024
    registers = PROGRAM_REGISTERS.get((cache_kind(dtype), block_n, prefetch), 128)
    by_registers = REGISTERS_PER_SM // (-(-registers // 8) * 8 * 128)
    return max(1, min(MAX_RESIDENT, SHARED_MEMORY_PER_SM // per_program, by_registers))


def wave_fill(programs: int, slots: int) -> float:
    """Share of the slots of all waves that ``programs`` equal programs keep busy."""
    return programs / (math.ceil(programs / slots) * slots)


def heuristic_splits(work: int, max_tokens: int, sms: int | None = None, resident: int = 3) -> int:
    """Splits per (sequence, kv head) that make one full wave: the most whose ``work x splits`` programs are all
    resident at once (``sms x resident`` slots), chunks >= ``MIN_CHUNK``; one split when the work alone fills
    the wave (or more).

    ``work``: programs per split (sequences x kv heads x head blocks); ``max_tokens``: the longest context the
    call can have (static).
    """
    slots = resident * (sms or sm_count())
    return max(1, min(slots // max(work, 1), max_tokens // MIN_CHUNK))


def heuristic_config(work: int, max_tokens: int, head_dim: int, dtype, sms: int | None = None,
                     paged: bool = True) -> TritonDecodeConfig:
    """One wave of programs (the model in the module docstring; predictions per shape in NOTES.md):

    - the work fits one wave of the wide program (``block_n`` keys per step, two in flight): split each
      sequence until the wave is full (B=8 x 8 kv heads, 4k: 6 splits = 384 of 396 slots), the last split of
      each sequence merging the partials (``inline_combine``: no second launch); when one split fills the wave
      (B=32 x 8, 4k: 256 of 396 slots), the long-step program: twice the keys per step, one in flight (the same
      shared memory, half the loop iterations);
    - more work than that, paged caches: the half-width program (4 per SM) when its last wave is fuller
      (B=64 x 8: one wave of 512 in 528 slots, instead of 1.29 waves: 70 % of copy measured), one split;
      otherwise (dense, ragged decode) the long-step program.

    Measured on an H100 (2026-11-27, 8 layers per executable; NOTES.md "decode heuristic, layered"): the inline
    combine won at batch 1 (+10-40 %), the long-step program at 32 x 512 (+10-80 %) and on dense caches at
    64 x 4096 (+6 %), both within the noise elsewhere.
    """
    sms = sms or sm_count()
    block_n = default_block_n(head_dim, dtype)
    wide = TritonDecodeConfig(block_n=block_n, num_splits=1, num_warps=4, prefetch=2)
    # One-byte caches keep the wide program: their long-step one needs 206 registers (2 per SM) and measured
    # 0.85 x the wide one at 32 x 4096 (H100, NOTES.md "float8 decode configs").
    long_steps = TritonDecodeConfig(block_n=2 * block_n, num_splits=1, num_warps=4, prefetch=1) \
        if 2 * block_n <= 128 and np.dtype(dtype).itemsize > 1 else wide
    wide_slots = sms * resident_programs(block_n, wide.prefetch, head_dim, dtype)
    if work <= wide_slots:
        splits = heuristic_splits(work, max_tokens, sms, wide_slots // sms)
        if splits == 1:
            return long_steps
        return dataclasses.replace(wide, num_splits=splits, inline_combine=True)
    if paged and block_n >= 32:
        narrow = TritonDecodeConfig(block_n=block_n // 2, num_splits=1, num_warps=4, prefetch=NARROW_PREFETCH)
        narrow_slots = sms * resident_programs(narrow.block_n, narrow.prefetch, head_dim, dtype)
        if wave_fill(work, narrow_slots) > wave_fill(work, wide_slots) + 0.05:
            return narrow
    return long_steps


def candidate_configs(work: int, max_tokens: int, head_dim: int, dtype, paged: bool = True) -> list[TritonDecodeConfig]:
    """The heuristic first, then other blocks, pipeline depths and split counts (autotuning only)."""
    base = heuristic_config(work, max_tokens, head_dim, dtype, paged=paged)
    out = [base]
    splits = sorted({max(1, base.num_splits // 2), base.num_splits, base.num_splits * 2})
    for block_n in sorted({16 if base.block_n <= 32 else 32, base.block_n, min(128, base.block_n * 2)}):
        for prefetch in (1, 2, 3):
            for num_splits in splits:
                config = TritonDecodeConfig(block_n=block_n, num_splits=num_splits, num_warps=4, prefetch=prefetch)
                if config not in out:
                    out.append(config)
    return out
