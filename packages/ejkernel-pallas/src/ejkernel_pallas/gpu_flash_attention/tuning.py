"""The GPU flash kernels' config :class:`GpuFlashTuning`, its H200 defaults and the autotuning candidates."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class GpuFlashTuning:
    """The GPU kernels' config: blocks (powers of two, >= 16) and Triton launch parameters of the forward
    (``fwd_*``), the dK/dV pass (``dkv_*``) and the dQ pass (``dq_*``; both backward kernels share warps and
    stages). Used as given (lengths are padded to whole blocks); :func:`heuristic_tuning` fits the
    defaults to a call. ``mosaic_forward`` / ``mosaic_backward``: run the forward / the backward as the Mosaic
    GPU kernels of :mod:`ejkernel_pallas.mosaic_attention` wherever they can take the call (a
    Hopper GPU; their own tiles: 128 query rows per program, key blocks of 128 (block-sparse: the mask's),
    ``mosaic_stages`` K/V slots), the Triton-lowered kernels elsewhere; either takes the other's output (same
    LSE)."""

    # Measured on an H200 (bf16, D=128, S=8k; benchmarks/gpu_flash_h200_run2.json): forward 128x64 with
    # 4 warps and 2 stages was the fastest of five tilings; in the backward 64x64 blocks with 4 warps beat
    # 128-wide ones by 1.3-2x (the f32 dK/dV accumulators of wider blocks spill) and 2 stages beat 3.
    fwd_q: int = 128
    fwd_kv: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 2
    dkv_q: int = 64
    dkv_kv: int = 64
    dq_q: int = 64
    dq_kv: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 2
    mosaic_forward: bool = False
    mosaic_stages: int = 2
    mosaic_backward: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("mosaic_forward", "mosaic_backward"):
                if not isinstance(value, bool):
                    raise ValueError(f"GpuFlashTuning.{field.name} must be a bool, got {value!r}")
                continue
            if field.name == "mosaic_stages" and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ValueError(f"GpuFlashTuning.mosaic_stages must be an int >= 2, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GpuFlashTuning.{field.name} must be a positive int, got {value!r}")
            if field.name.endswith(("_q", "_kv")) and (value & (value - 1) or value < 16):
                raise ValueError(f"GpuFlashTuning.{field.name}={value}: Triton blocks are powers of two >= 16")
            if field.name.endswith("_warps") and value & (value - 1):
                raise ValueError(f"GpuFlashTuning.{field.name}={value}: num_warps must be a power of two")


def _fit(block: int, length: int) -> int:
    """Shrink a block to the smallest power of two >= 16 covering ``length`` (short sequences)."""
    return max(16, min(block, pl.next_power_of_2(length)))


def fitted(tuning: GpuFlashTuning, sq: int, skv: int) -> GpuFlashTuning:
    """``tuning`` with its blocks shrunk to short sequences (a block never exceeds its padded length)."""
    return dataclasses.replace(
        tuning, fwd_q=_fit(tuning.fwd_q, sq), fwd_kv=_fit(tuning.fwd_kv, skv), dkv_q=_fit(tuning.dkv_q, sq),
        dkv_kv=_fit(tuning.dkv_kv, skv), dq_q=_fit(tuning.dq_q, sq), dq_kv=_fit(tuning.dq_kv, skv),
    )


def heuristic_tuning(sq: int, skv: int) -> GpuFlashTuning:
    """The H200 defaults (:class:`GpuFlashTuning`), fitted to the lengths."""
    return fitted(GpuFlashTuning(), sq, skv)


# Autotuning candidates: the tilings of the H200 sweep (NOTES.md, runs 1-2) that came within ~30% of the
# best, fastest first; fitted to the call's lengths (duplicates dropped).
_SWEEP = (
    GpuFlashTuning(),  # fwd 128x64 w4 s2, bwd 64x64 w4 s2 (the defaults)
    GpuFlashTuning(fwd_q=128, fwd_kv=128, fwd_warps=8, fwd_stages=3),
    GpuFlashTuning(bwd_stages=3),
    GpuFlashTuning(fwd_q=64, fwd_kv=64, fwd_stages=3, bwd_stages=3),
    GpuFlashTuning(dkv_q=64, dkv_kv=128, dq_q=128, dq_kv=64, bwd_warps=8),
)


def candidate_tunings(sq: int, skv: int) -> list[GpuFlashTuning]:
    """Pruned autotuning candidates for this call's lengths (see ``_SWEEP``), the heuristic first."""
    return list(dict.fromkeys(fitted(t, sq, skv) for t in _SWEEP))

