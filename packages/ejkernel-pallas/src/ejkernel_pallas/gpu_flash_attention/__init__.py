"""Flash attention for NVIDIA GPUs in Pallas (Triton lowering; Mosaic GPU on Hopper), forward and backward.

On a Hopper GPU the calls the Mosaic GPU kernels of :mod:`ejkernel_pallas.mosaic_attention` take
(bf16/fp16, head_dim 64 or 128, no dropout, varlen only with one ``cum_seqlens`` array) run through them over
the dense block schedules (every block of 128 x 128 the causal / window rules reach;
``GpuFlashTuning.mosaic_forward`` / ``mosaic_backward``, set by the heuristic there, and ``priority_for`` ranks
this implementation above the Triton backend's for those calls). Everything below describes the
Triton-lowered kernels, which serve every other call.

``IMPLEMENTATION`` (registered by ``plugin.py``) takes the validated ``FlashAttentionCall`` and a
:class:`GpuFlashTuning` config. Semantics of docs/flash_attention.md for: causal, sliding window, soft cap,
GQA/MQA, segment ids, varlen (packed sequences through cum_seqlens), attention sinks, dropout (the shared
index-hash mask, recomputed in the backward). Bias, attention_mask, segment ids together with cum_seqlens
and head dims above 256 are refused with ``UnsupportedFeature`` (the dispatcher falls back; platform='xla'
takes them). On CPU it runs only in interpret mode ``gpu`` (:mod:`ejkernel_pallas.interpret`).

Precision: the Triton lowering runs a float32 dot as TF32 for ``DEFAULT`` (and, in jax 0.11, also for
``HIGH``, below the bf16x3-class accuracy ``HIGH`` promises) and as IEEE float32 for ``HIGHEST``. Float32
calls therefore run their dots at TF32 when the caller asked for ``precision="default"`` and at IEEE
float32 otherwise (``HIGHEST``, the float32 default, and ``HIGH``: more precise than asked, which the
policy allows); no precision is refused. 16-bit operands multiply exactly into float32 accumulators.

Arrays stay in the public [B, S, H, D] layout (blocks are strided row loads); lengths are padded to whole
blocks and head dims to powers of two inside the wrapper. Each program owns one query block (forward, dQ)
or one KV block (dK/dV) and loops over the other axis in three ranges: blocks before and after the ones a
mask can touch run the mask-free body, which keeps the common causal case at one masked diagonal band.
The forward works in base 2 (exp2 with log2(e) folded into the scale) when there is no soft cap.

Modules: ``tuning`` (the config :class:`GpuFlashTuning`, its defaults and autotuning candidates), ``kernels``
(the Pallas kernels, their mask ranges and block-sparse schedule loops, shared with block-sparse attention),
``launch`` (the pallas_calls and the custom VJP), ``implementation`` (the registered ``IMPLEMENTATION``),
``__main__`` (micro-benchmark).
"""

from __future__ import annotations

from ejkernel_pallas.gpu_flash_attention.implementation import (
    IMPLEMENTATION,
    MOSAIC_BLOCK,
    GpuFlashAttention,
    flash_attention,
)
from ejkernel_pallas.gpu_flash_attention.kernels import LOG2E, gpu_schedule
from ejkernel_pallas.gpu_flash_attention.tuning import GpuFlashTuning, candidate_tunings, fitted, heuristic_tuning

# their public path: configs, error messages and the dispatcher's reports name them from here
GpuFlashTuning.__module__ = GpuFlashAttention.__module__ = __name__

__all__ = [
    "IMPLEMENTATION",
    "LOG2E",
    "MOSAIC_BLOCK",
    "GpuFlashAttention",
    "GpuFlashTuning",
    "candidate_tunings",
    "fitted",
    "flash_attention",
    "gpu_schedule",
    "heuristic_tuning",
]
