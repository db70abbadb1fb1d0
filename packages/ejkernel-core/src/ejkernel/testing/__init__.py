"""Conformance suites shipped with ejkernel: for each operation a float64 reference and a pytest base
class any backend runs by naming its platform (see ``docs/testing.md``).

``ejkernel.testing.numerics`` holds the shared pieces: fresh random inputs and dtype-aware relative-error
comparisons. Importing this package is cheap; each suite is its own module
(``ejkernel.testing.flash_attention`` ...).
"""

from ejkernel.testing.numerics import (
    TOLERANCES,
    Tolerance,
    assert_close,
    assert_finite,
    assert_tree_close,
    fresh_keys,
    random_inputs,
    random_normal,
    relative_error,
    rmse_ratio,
    to_float64,
    jax_float64,
)

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_close",
    "assert_finite",
    "assert_tree_close",
    "fresh_keys",
    "jax_float64",
    "random_inputs",
    "random_normal",
    "relative_error",
    "rmse_ratio",
    "to_float64",
]
