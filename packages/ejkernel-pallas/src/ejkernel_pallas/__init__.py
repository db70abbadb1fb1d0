"""ejkernel pallas backend (see plugin.py for its entry point)."""
