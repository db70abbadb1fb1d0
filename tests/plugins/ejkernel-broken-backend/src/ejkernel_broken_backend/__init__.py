"""Broken plugins for tests."""
