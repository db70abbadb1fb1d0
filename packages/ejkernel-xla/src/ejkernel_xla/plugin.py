"""Entry point of the XLA backend: describes it and registers its implementations lazily."""

from __future__ import annotations

from ejkernel.plugins.declare import DeclaredBackend

# algorithm -> "module:function" inside this package. Every operation runs on every machine here.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_xla.flash_attention:IMPLEMENTATION",
    "scaled_dot_product_attention": "ejkernel_xla.scaled_dot_product_attention:IMPLEMENTATION",
    "attention": "ejkernel_xla.attention:IMPLEMENTATION",
    "page_attention": "ejkernel_xla.page_attention:IMPLEMENTATION",
    "ragged_page_attention": "ejkernel_xla.ragged_page_attention:IMPLEMENTATION",
    "ragged_decode_attention": "ejkernel_xla.ragged_decode_attention:IMPLEMENTATION",
    "multi_head_latent_attention": "ejkernel_xla.multi_head_latent_attention:IMPLEMENTATION",
    "blocksparse_attention": "ejkernel_xla.blocksparse_attention:IMPLEMENTATION",
    "native_sparse_attention": "ejkernel_xla.native_sparse_attention:IMPLEMENTATION",
    "grouped_matmul": "ejkernel_xla.grouped_matmul:IMPLEMENTATION",
    "mean_pooling": "ejkernel_xla.mean_pooling:IMPLEMENTATION",
    "recurrent": "ejkernel_xla.recurrent:IMPLEMENTATION",
    "gla": "ejkernel_xla.recurrent:IMPLEMENTATION",
    "lightning_attention": "ejkernel_xla.recurrent:IMPLEMENTATION",
    "ring_attention": "ejkernel_xla.ring_attention:IMPLEMENTATION",
}


BACKEND = DeclaredBackend(
    name="xla",
    distribution="ejkernel-xla",
    platform="xla",
    targets=("cpu", "gpu", "tpu"),
    implementations=IMPLEMENTATIONS,
    register_for=("any",),
    priority=0,
    description="pure JAX: blockwise, memory O(S); the fallback for every operation",
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()
