"""Utilities of the kernel framework: parameter carriers, fingerprints, serialization, HLO labels."""
