"""``flash_attention`` on NVIDIA GPUs: cuDNN's fused flash attention (:mod:`ejkernel_cuda.cudnn_attention`) or
our own Hopper kernels through the XLA FFI (:mod:`ejkernel_cuda.native_flash`), chosen by
:class:`CudaFlashConfig`.

cuDNN is NVIDIA's kernel, faster than our Triton one on Hopper (README's benchmark tables), for the calls it
computes exactly as ejkernel defines them: bfloat16/float16, equal head dims, no mask or a causal one (or a
causal window) over equal lengths, GQA. The native kernels (sm_90a only) take more of ejkernel's features
(causal masks and windows over unequal lengths, windows reaching right, soft cap, attention sinks, segment
ids, packed varlen self-attention) at head dims 64 and 128.
The heuristic takes the native kernels for head_dim-128 calls (measured faster than cuDNN there:
:func:`native_preferred`) and for the calls only they take, cuDNN for the rest; a call neither takes is
refused with ``UnsupportedFeature`` (both reasons) before anything compiles, and the dispatcher takes
Pallas, Triton or XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel_cuda import cudnn_attention, native_flash

KERNELS = ("cudnn", "native")

# The dispatcher's rank (``Implementation.priority_for``) of the calls only the native kernels take (cuDNN
# refuses them: soft cap, sinks, segment ids, packed varlen, windows reaching right, causal masks over unequal
# lengths): above Pallas' Mosaic GPU kernels (17) and Triton (15). One H200 run, 2026-11-27, bf16, D=128, 16k
# tokens (`results/nvidia-h200-2026-11-27b-cuda-native.json`), TFLOP/s forward / forward+backward: native
# 547-631 / 483-552 (causal 398-633 / 355-540), Mosaic 523-599 / 457-487 (causal 364-576 / 360-464): faster in
# 11 of the 12 cells, 1.4 % behind in the 12th (S=2k causal forward+backward). Calls cuDNN takes keep the
# backend's 20.
NATIVE_PRIORITY = 18


def native_preferred(call: FlashAttentionCall) -> bool:
    """Whether the native kernels run a call cuDNN takes too: calls at head_dim 128, where they measured at or
    above cuDNN in every cell (bf16, 16k tokens, S = 2k, 8k, 16k, causal or not; native / cuDNN forward 1.00-1.12
    and forward+backward 1.02-1.13 on an H100, 2026-11-27 23:08 UTC, `results/nvidia-h100-2026-11-27m-cuda-
    native.json`; forward 1.00-1.08 and forward+backward 1.01-1.12 on an H200, 22:52 UTC, `...h200-...`).
    Non-causal calls went to cuDNN until the forward's lagging maximum (its forward had been 0.95-1.07 × cuDNN's).
    At head_dim 64 cuDNN: the native forward is 0.91-0.97 of cuDNN's, forward+backward 0.96-1.06
    (`results/nvidia-h100-2026-11-27m-cuda-native-d64.json`)."""
    return call.query.shape[-1] == 128


@dataclasses.dataclass(frozen=True)
class CudaFlashConfig:
    """Which kernel runs the call: ``"cudnn"`` (cuDNN's fused flash attention) or ``"native"`` (our sm_90a
    kernels). A config naming a kernel that cannot take the call is refused with ``UnsupportedFeature``."""

    kernel: Literal["cudnn", "native"] = "cudnn"

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"CudaFlashConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")


def cudnn_refusal(call: FlashAttentionCall) -> str | None:
    """Why cuDNN cannot take ``call`` (its ``UnsupportedFeature`` message), or None."""
    try:
        cudnn_attention.check_supported(
            "flash_attention", call.query, call.key, call.value, causal=call.causal,
            sliding_window=call.sliding_window,
            unsupported=dict(bias=call.bias, attention_mask=call.attention_mask, segment_ids=call.q_segment_ids,
                             cum_seqlens=call.cum_seqlens_q, logits_soft_cap=call.logits_soft_cap,
                             softmax_aux=call.softmax_aux, dropout_prob=call.dropout_prob))
    except UnsupportedFeature as error:
        return str(error)
    return None


def refusals(call: FlashAttentionCall) -> dict[str, str | None]:
    """Each kernel's reason for refusing ``call`` here (None: it takes it), cuDNN first."""
    return {"cudnn": cudnn_refusal(call), "native": native_flash.refusal(call)}


class CudaFlashAttention(Implementation[FlashAttentionCall, CudaFlashConfig]):
    """cuDNN or the native kernels (see the module docstring); nothing else to tune."""

    config_type = CudaFlashConfig

    def supports(self, call: FlashAttentionCall) -> None:
        reasons = refusals(call)
        if all(reasons.values()):
            raise UnsupportedFeature(f"{reasons['cudnn']}; {native_flash.NAME}: {reasons['native']}")

    def priority_for(self, call: FlashAttentionCall) -> int | None:
        reasons = refusals(call)
        return NATIVE_PRIORITY if reasons["cudnn"] and not reasons["native"] else None

    def heuristic_config(self, call: FlashAttentionCall) -> CudaFlashConfig:
        if cudnn_refusal(call) is not None:
            return CudaFlashConfig("native")
        # the native kernels' own checks only where they would be preferred
        preferred = native_preferred(call) and native_flash.refusal(call) is None
        return CudaFlashConfig("native" if preferred else "cudnn")

    def candidate_configs(self, call: FlashAttentionCall) -> list[CudaFlashConfig]:
        return [CudaFlashConfig(kernel) for kernel, reason in refusals(call).items() if reason is None]

    def __call__(self, call: FlashAttentionCall, config: CudaFlashConfig) -> jax.Array:
        if config.kernel == "native":
            return native_flash.call_attention(call)
        reason = cudnn_refusal(call)
        if reason is not None:
            raise UnsupportedFeature(reason)
        return cudnn_attention.attention(call.query, call.key, call.value, call.softmax_scale, bool(call.causal),
                                         cudnn_attention.window_length(call.sliding_window))


IMPLEMENTATION = CudaFlashAttention()
