"""Config selection: in-memory and persistent caches, overlays, policies and the selector chain."""
