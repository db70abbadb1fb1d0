"""Tuning of the Triton flash attention: its config type, the per-device tables shipped with the package,
the heuristic and the autotuning space, and which forward kernel (pointer loads or TMA) a call takes.

Tables: ``ejkernel_triton/tuned/flash_attention.json`` holds ``{device kind: {"d<head dim>-<full|causal>":
config fields}}`` measured by ``benchmarks/tune_triton_flash_attention.py`` on that device, plus
``"d<D>-full-tma"`` entries (forward fields only) where the TMA kernel's forward was faster. A device kind
with a table gets its tuned blocks from the heuristic and has nothing left to autotune.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import jax.numpy as jnp

from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel_triton import launch

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class TritonFlashConfig:
    """Block shapes and launch parameters of the three kernels (hashable: it keys compilation).

    ``fwd_*``: the forward kernel; a program owns ``fwd_block_q`` queries and walks the keys
    ``fwd_block_kv`` at a time. With 4 warps, at most 2 stages and blocks that tile both lengths, a call
    the TMA kernel admits runs it (:meth:`fits_tma_forward`). ``dkv_*``: the dK/dV kernel, a program owns
    ``dkv_block_kv`` keys and walks the queries ``dkv_block_q`` at a time. ``dq_*``: the dQ kernel, a
    program owns ``dq_block_q`` queries and walks the keys ``dq_block_kv`` at a time. ``bwd_num_warps`` and
    ``bwd_num_stages`` launch both backward kernels.
    """

    fwd_block_q: int = 128
    fwd_block_kv: int = 64
    fwd_num_warps: int = 8
    fwd_num_stages: int = 3
    dkv_block_q: int = 64
    dkv_block_kv: int = 128
    dq_block_q: int = 128
    dq_block_kv: int = 64
    bwd_num_warps: int = 8
    bwd_num_stages: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TritonFlashConfig.{field.name} must be a positive int, got {value!r}")
            if "block" in field.name and (value < 16 or value & (value - 1)):
                raise ValueError(f"TritonFlashConfig.{field.name} must be a power of two >= 16, got {value}")
        for name in ("fwd_num_warps", "bwd_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"TritonFlashConfig.{name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)}")

    def fits_tma_forward(self, q_len: int, kv_len: int) -> bool:
        """Whether these forward blocks select the TMA kernel: warp specialization happens at 4 warps only,
        3 stages miscompiled (NaNs, Triton 3.6), and the kernel has no masking (whole blocks only)."""
        return (self.fwd_num_warps == 4 and self.fwd_num_stages <= 2 and q_len % self.fwd_block_q == 0
                and kv_len % self.fwd_block_kv == 0)


FWD_FIELDS = ("fwd_block_q", "fwd_block_kv", "fwd_num_warps", "fwd_num_stages")
BWD_FIELDS = ("dkv_block_q", "dkv_block_kv", "dq_block_q", "dq_block_kv", "bwd_num_warps", "bwd_num_stages")
TMA_FWD_DEFAULT = (128, 128, 4, 2)
"""Forward blocks of the TMA kernel: 128x128 tiles, 4 warps per consumer warpgroup (the loop's warp
specialization adds a producer and splits the rows over two consumers), 2 stages. Measured on an H100,
S=8k, D=128: 2.01 ms, against 2.22-2.27 ms for 256x64 and 128x64 and 2.40 ms for the pointer kernel's
best; 3 stages gave NaNs (Triton 3.6)."""

# ---- shipped tables ----------------------------------------------------------------------------------

TUNED_FILE = Path(__file__).resolve().parents[1] / "tuned" / "flash_attention.json"
TUNED_FILE_ENV = "EJKERNEL_TRITON_TUNED_FILE"
"""Path of a tuned table (the format of TUNED_FILE) whose entries override the shipped ones (its first
device's entries apply to any GPU kind it does not name)."""
SAME_SM = {"NVIDIA H100": "NVIDIA H200", "NVIDIA H200": "NVIDIA H100"}
"""H100 and H200 share the SM (132 SMs, 228 KB shared memory per SM, same clocks): a kind without its own
table uses the other's."""


@functools.lru_cache(maxsize=None)
def _read_table(path: str) -> dict[str, dict[str, dict]]:
    return json.loads(Path(path).read_text())


def shipped_entries(device_kind: str) -> dict | None:
    """The shipped table of `device_kind` (exact name, else same family, else a same-SM kind)."""
    if not device_kind or not TUNED_FILE.exists():
        return None
    table = _read_table(str(TUNED_FILE))
    if device_kind in table:
        return table[device_kind]
    family = " ".join(device_kind.split()[:2])
    for candidates in ((family,), (SAME_SM.get(family),)):
        for kind, entries in table.items():
            if " ".join(kind.split()[:2]) in candidates:
                return entries
    return None


def tuned_entries(device_kind: str) -> dict:
    """The shipped entries of `device_kind` updated with those of EJKERNEL_TRITON_TUNED_FILE."""
    if not device_kind:
        return {}
    entries = dict(shipped_entries(device_kind) or {})
    override = os.environ.get(TUNED_FILE_ENV)
    if override and os.path.exists(override):
        table = _read_table(override)
        entries.update(table.get(device_kind) or next(iter(table.values()), {}))
    return entries


def tuned_config(device_kind: str, head_dim: int, causal: bool, tma: bool = False) -> TritonFlashConfig | None:
    """The tuned config for this device kind, head dim bucket (64, 128, 256) and causal flag, if any."""
    entries = tuned_entries(device_kind)
    bucket = next((b for b in (64, 128, 256) if head_dim <= b), None)
    mode = "causal" if causal else "full"
    entry = entries.get(f"d{bucket}-{mode}") or entries.get(f"d{bucket}-full")
    if entry is None:
        return None
    tuned = TritonFlashConfig(**{f.name: int(entry[f.name]) for f in dataclasses.fields(TritonFlashConfig)})
    # A "-tma" entry holds the TMA kernel's forward blocks where tuning found it faster than the pointer
    # kernel's; without one the device keeps the pointer kernel's forward.
    tma_entry = entries.get(f"d{bucket}-{mode}-tma")
    if tma and tma_entry:
        tuned = dataclasses.replace(tuned, **{name: int(tma_entry[name]) for name in FWD_FIELDS})
    return tuned


# ---- heuristic and autotuning space ------------------------------------------------------------------


def heuristic_config(head_dim: int, head_dim_v: int, dtype, device_kind: str, causal: bool = False,
                     tma: bool = False) -> TritonFlashConfig:
    """Tuned blocks for this device kind when a table has them (H100/H200), else defaults sized for
    Hopper's 228 KB of shared memory per SM. `tma`: the forward blocks are for the TMA kernel."""
    d = max(head_dim, head_dim_v)
    if jnp.dtype(dtype) == jnp.float32:
        # IEEE fp32 dots run on CUDA cores: small tiles keep registers and shared memory in bounds.
        return TritonFlashConfig(32, 32, 4, 2, 32, 32, 32, 32, 4, 1)
    tuned = tuned_config(device_kind, d, causal, tma)
    if tuned is not None:
        return tuned
    if d <= 64:
        base = TritonFlashConfig(128, 64, 4, 3, 64, 64, 64, 64, 4, 2)
    elif d <= 128:
        base = TritonFlashConfig(128, 64, 8, 3, 64, 64, 64, 64, 4, 2)
    else:
        base = TritonFlashConfig(64, 64, 4, 2, 32, 64, 64, 32, 4, 1)
    return dataclasses.replace(base, **dict(zip(FWD_FIELDS, TMA_FWD_DEFAULT))) if tma else base


def config_space(head_dim: int, head_dim_v: int, dtype, tma: bool = False) -> list[TritonFlashConfig]:
    """A pruned autotuning space (the untabled heuristic first): block pairs that fit shared memory at this
    head dim. `tma`: forward candidates of the TMA kernel (4 warps, <= 2 stages)."""
    base = heuristic_config(head_dim, head_dim_v, dtype, device_kind="", tma=tma)
    if jnp.dtype(dtype) == jnp.float32:
        return [base]
    d = max(head_dim, head_dim_v)
    if tma:
        fwd = [TMA_FWD_DEFAULT, (128, 64, 4, 2), (256, 64, 4, 2)]
        bwd = [(64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2)]
    elif d <= 128:
        fwd = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3)]
        bwd = [(64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2)]
    else:
        fwd = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]
        bwd = [(32, 64, 64, 32, 4, 1), (32, 32, 32, 32, 4, 1)]
    out = [base]
    for f in fwd:
        for b in bwd:
            config = TritonFlashConfig(*f, *b)
            if config not in out:
                out.append(config)
    return out


# ---- which forward kernel ----------------------------------------------------------------------------


def tma_forward_applies(call: FlashAttentionCall) -> bool:
    """Whether a call's features admit the TMA + warp-specialized forward (`forward._fwd_tma_kernel`): a
    Hopper (or newer) target, bf16/fp16, q/v head dim 128 (at 64 it lost to the pointer kernel on an H100:
    2.97 ms against 2.62 ms at S=8k), dense batches, no mask (causal, window, segment ids) and no dropout.
    It runs when the config's forward blocks fit the call too (:meth:`TritonFlashConfig.fits_tma_forward`).
    Triton's interpreter runs it when EJKERNEL_TRITON_COMPUTE_CAPABILITY names a Hopper (the CPU tests)."""
    return not call.dropout_prob and tma_forward_takes(call.query.dtype, call.query.shape[-1], call.value.shape[-1],
                                                        masked=call.masked)


def tma_forward_takes(dtype, head_dim: int, v_head_dim: int, *, masked: bool) -> bool:
    """:func:`tma_forward_applies` from the facts it reads (also for ring attention's local blocks)."""
    return (not masked and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim == v_head_dim == 128 and launch.target_compute_capability() >= 90 and launch.available())


def tma_blocks_fit(call: FlashAttentionCall) -> bool:
    """Whether the heuristic forward blocks are the TMA kernel's: it applies and its blocks tile the lengths."""
    return (tma_forward_applies(call) and call.query.shape[1] % TMA_FWD_DEFAULT[0] == 0
            and call.key.shape[1] % TMA_FWD_DEFAULT[1] == 0)
