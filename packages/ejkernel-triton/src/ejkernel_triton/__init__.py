"""ejkernel triton backend (see plugin.py for its entry point)."""
