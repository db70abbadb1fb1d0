"""``scaled_dot_product_attention`` on the GPU by the Triton flash-attention kernels: the call is a
``flash_attention`` call restricted to fewer features, so this backend's ``flash_attention`` implementation
runs it (``ThroughFlashAttention``): the same refusals and configs, O(S) memory instead of the dense O(S²)."""

from __future__ import annotations

from ejkernel.modules.operations.flash_attention import ThroughFlashAttention
from ejkernel_triton.flash_attention import IMPLEMENTATION as FLASH

IMPLEMENTATION = ThroughFlashAttention(FLASH)
