"""XLA ``blocksparse_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.blocksparse_attention import BlockSparseAttentionConformance


class TestXlaBlockSparseAttention(BlockSparseAttentionConformance):
    platform = "xla"
