"""The operations; see ``ejkernel.modules`` for the public names."""
