"""Kernel and Invocation: what a kernel is and what one call of it looks like."""
