"""Fails at import, like a plugin whose own dependency is not installed."""

import a_package_that_is_not_installed  # noqa: F401
