"""Running kernels: the executor, batch helpers and autotuning."""
