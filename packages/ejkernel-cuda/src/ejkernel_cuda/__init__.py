"""ejkernel cuda backend (see plugin.py for its entry point)."""
