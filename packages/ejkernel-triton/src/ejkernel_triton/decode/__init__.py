"""Decode attention on the GPU: one Triton kernel family (split-K flash-decoding with a combine pass,
``kernels``) behind two operations that differ only in how keys are addressed: ``page_attention`` (a paged
KV cache and block tables) and ``ragged_decode_attention`` (per-sequence slices of a dense buffer).

Modules: ``config`` (:class:`TritonDecodeConfig`, the heuristic and autotuning space), ``kernels`` (the
Triton kernels and their launch), ``page_attention`` and ``ragged_decode_attention`` (the
``ejkernel.Implementation`` of each operation, registered for the GPU by ``ejkernel_triton.plugin``).
Forward-only (inference kernels): a gradient raises ``UnsupportedFeature``.
"""

from ejkernel_triton.decode.config import TritonDecodeConfig

__all__ = ["TritonDecodeConfig"]
