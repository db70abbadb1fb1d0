"""ejkernel xla backend (see plugin.py for its entry point)."""
