"""Which benchmark times which operation (issue #18: one benchmark per operation). ``tests/test_benchmarks.py``
checks that every operation core registers is here, that each script named exists and is in README.md's
table, and runs the ``QUICK`` scripts' ``--quick`` smoke runs on the CPU."""

# operation -> its benchmark script (in benchmarks/); some scripts time several operations
BENCHMARKS = {
    "attention": "dense_attention.py",
    "blocksparse_attention": "blocksparse.py",
    "flash_attention": "attention.py",
    "gla": "linear_attention.py",
    "grouped_matmul": "grouped_matmul.py",
    "lightning_attention": "linear_attention.py",
    "mean_pooling": "mean_pooling.py",
    "multi_head_latent_attention": "mla.py",
    "native_sparse_attention": "native_sparse_attention.py",
    "page_attention": "decode.py",
    "ragged_decode_attention": "decode.py",
    "ragged_page_attention": "decode.py",
    "recurrent": "linear_attention.py",
    "ring_attention": "ring_scaling.py",
    "scaled_dot_product_attention": "dense_attention.py",
}

# further studies of an operation, beside its benchmark
STUDIES = {
    "flash_attention": ["xla_flash.py", "xla_memory.py", "xla_gpu_hlo.py", "tune_triton_flash_attention.py"],
    "blocksparse_attention": ["blocksparse_pallas.py"],
    "mean_pooling": ["blocksparse.py"],
    "page_attention": ["decode_resources.py"],
    "ragged_decode_attention": ["decode_resources.py"],
    "ragged_page_attention": ["decode_resources.py"],
}

# the scripts whose --quick mode is a CPU smoke run of a few seconds (built on _harness.py)
QUICK = ("dense_attention.py", "grouped_matmul.py", "mean_pooling.py", "mla.py")
