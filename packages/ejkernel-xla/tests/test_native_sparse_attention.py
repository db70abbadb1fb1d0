"""XLA ``native_sparse_attention`` against the shared conformance suite."""

from __future__ import annotations

from ejkernel.testing.native_sparse_attention import NativeSparseAttentionConformance


class TestXlaNativeSparseAttention(NativeSparseAttentionConformance):
    platform = "xla"
