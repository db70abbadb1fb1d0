"""Public operations. Each name loads its module on first access, so importing this package is cheap.

To add an operation, put it in ``operations/<name>.py`` and list its public names in ``_EXPORTS``.
"""

from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {
    # base
    "KernelConfig": "ejkernel.modules.base",
    "create_default_executor": "ejkernel.modules.base",
    "detect_platform": "ejkernel.modules.base",
    # operations: "public name": "module"
    "flash_attention": "ejkernel.modules.operations.flash_attention",
    "FlashAttention": "ejkernel.modules.operations.flash_attention",
    "FlashAttentionCall": "ejkernel.modules.operations.flash_attention",
    "scaled_dot_product_attention": "ejkernel.modules.operations.scaled_dot_product_attention",
    "ScaledDotProductAttention": "ejkernel.modules.operations.scaled_dot_product_attention",
    "ScaledDotProductAttentionCall": "ejkernel.modules.operations.scaled_dot_product_attention",
    "attention": "ejkernel.modules.operations.attention",
    "Attention": "ejkernel.modules.operations.attention",
    "AttentionCall": "ejkernel.modules.operations.attention",
    "page_attention": "ejkernel.modules.operations.page_attention",
    "PageAttention": "ejkernel.modules.operations.page_attention",
    "PageAttentionCall": "ejkernel.modules.operations.page_attention",
    "ragged_page_attention": "ejkernel.modules.operations.ragged_page_attention",
    "RaggedPageAttention": "ejkernel.modules.operations.ragged_page_attention",
    "RaggedPageAttentionCall": "ejkernel.modules.operations.ragged_page_attention",
    "ragged_decode_attention": "ejkernel.modules.operations.ragged_decode_attention",
    "RaggedDecodeAttention": "ejkernel.modules.operations.ragged_decode_attention",
    "RaggedDecodeAttentionCall": "ejkernel.modules.operations.ragged_decode_attention",
    "multi_head_latent_attention": "ejkernel.modules.operations.multi_head_latent_attention",
    "flash_mla": "ejkernel.modules.operations.multi_head_latent_attention",
    "mla_attention": "ejkernel.modules.operations.multi_head_latent_attention",
    "MultiHeadLatentAttention": "ejkernel.modules.operations.multi_head_latent_attention",
    "FlashMLA": "ejkernel.modules.operations.multi_head_latent_attention",
    "MultiHeadLatentAttentionCall": "ejkernel.modules.operations.multi_head_latent_attention",
    "blocksparse_attention": "ejkernel.modules.operations.blocksparse_attention",
    "BlockSparseAttention": "ejkernel.modules.operations.blocksparse_attention",
    "BlockSparseAttentionCall": "ejkernel.modules.operations.blocksparse_attention",
    "causal_block_mask": "ejkernel.modules.operations.blocksparse_attention",
    "local_block_mask": "ejkernel.modules.operations.blocksparse_attention",
    "chunked_block_mask": "ejkernel.modules.operations.blocksparse_attention",
    "native_sparse_attention": "ejkernel.modules.operations.native_sparse_attention",
    "NativeSparseAttention": "ejkernel.modules.operations.native_sparse_attention",
    "NativeSparseAttentionCall": "ejkernel.modules.operations.native_sparse_attention",
    "grouped_matmul": "ejkernel.modules.operations.grouped_matmul",
    "GroupedMatmul": "ejkernel.modules.operations.grouped_matmul",
    "GroupedMatmulCall": "ejkernel.modules.operations.grouped_matmul",
    "mean_pooling": "ejkernel.modules.operations.mean_pooling",
    "MeanPooling": "ejkernel.modules.operations.mean_pooling",
    "MeanPoolingCall": "ejkernel.modules.operations.mean_pooling",
    "recurrent_attention": "ejkernel.modules.operations.recurrent",
    "recurrent": "ejkernel.modules.operations.recurrent",
    "RecurrentAttention": "ejkernel.modules.operations.recurrent",
    "LinearAttentionCall": "ejkernel.modules.operations.recurrent",
    "gla_attention": "ejkernel.modules.operations.gla",
    "GLAttention": "ejkernel.modules.operations.gla",
    "lightning_attention": "ejkernel.modules.operations.lightning_attention",
    "LightningAttention": "ejkernel.modules.operations.lightning_attention",
    "ring_attention": "ejkernel.modules.operations.ring_attention",
    "RingAttention": "ejkernel.modules.operations.ring_attention",
    "RingAttentionCall": "ejkernel.modules.operations.ring_attention",
    "zigzag_shard": "ejkernel.modules.operations.ring_attention",
    "zigzag_unshard": "ejkernel.modules.operations.ring_attention",
}

__all__ = sorted(_EXPORTS)

HELPERS = ("create_default_executor", "detect_platform", "causal_block_mask", "local_block_mask",
           "chunked_block_mask", "zigzag_shard", "zigzag_unshard")
"""The public functions that are not operations (no registry entry, no page of their own, no export case)."""


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ejkernel.modules' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
