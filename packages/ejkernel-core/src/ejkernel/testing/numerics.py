"""Numerics shared by every conformance suite: fresh random inputs, dtype-aware comparisons, the
forward + VJP check against a float64 reference, and the bad-input checks of the suites.

How results are compared
------------------------
A backend's output is compared with a float64 reference computed *from the same (already rounded)
inputs*, by relative L2 error::

    relative_error(actual, expected) = ||actual - expected||_2 / ||expected||_2

(the RMSE of the difference divided by the RMS of the reference). Element-wise ``allclose`` is the wrong
tool for low precision: a few values near zero dominate it while saying nothing about the kernel.

The tolerances below are what a *good* implementation reaches: inputs rounded to the dtype, float32
accumulation, the output (and, in flash kernels, the probabilities fed to the second matmul) rounded to
the dtype. They were calibrated on attention (see ``docs/testing.md``): an XLA float32-accumulating
blockwise kernel sits 4-50x below them (measured, unit-normal q/k/v, D=64: float32 3e-7, bfloat16 2.3e-3
with bf16 probabilities, float16 3e-4), a kernel accumulating in bf16 sits near the bound, and a wrong
rescale or mask lands orders of magnitude above. Gradients get a looser bound because
``dS = P * (dP - rowsum(dO * O))`` cancels.

The float32 bound is float32's on every device: the precision policy (``docs/precision.md``) runs
float32 inputs' matmuls at ``HIGHEST`` unless the caller asks otherwise, so a GPU backend computes float32
in full precision (never TF32) or refuses the call; no suite loosens it.

``rmse_ratio(actual, baseline, reference)`` is the other way of saying "as good as XLA": the kernel's
error divided by the error of a trusted baseline at the same dtype (both against the float64 reference).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest relative L2 error accepted for the forward output and for each gradient."""

    forward: float
    gradient: float


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(forward=2e-5, gradient=1e-4),
    "bfloat16": Tolerance(forward=1e-2, gradient=2e-2),
    "float16": Tolerance(forward=1.5e-3, gradient=3e-3),
}
"""Per dtype (see the module docstring). Keys are ``jnp.dtype(...).name``."""

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
DTYPES = ("float32", "bfloat16", "float16")
"""The same, by name (for ``pytest.mark.parametrize``)."""

INTERPRET_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""``compiler_options`` for a suite whose kernels run in an interpreter on CPU (Pallas / Triton interpret
mode). Such a program is the interpreter's loop nest over small blocks: compiling it dominates the suite's
time, and XLA's CPU backend optimizations are about 45% of each compile while saving almost nothing at
run time (Pallas TPU flash attention forward+backward on a 2-core CPU: 1.6-2.2 s -> 0.9-1.1 s per
compile). Tolerances are unchanged: the checks still compare against the float64 reference."""


def dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def tolerance_for(dtype: Any, tolerances: Mapping[str, Tolerance] | None = None) -> Tolerance:
    table = TOLERANCES if tolerances is None else tolerances
    try:
        return table[dtype_name(dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype_name(dtype)}; known: {sorted(table)}") from None


# ---- comparisons ---------------------------------------------------------------------------------


def _as_float64(x: Any) -> np.ndarray:
    # numpy converts bfloat16/float16 exactly (ml_dtypes); an eager jnp cast would compile per shape
    return np.asarray(x).astype(np.float64)


def relative_error(actual: Any, expected: Any) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are exactly zero; inf when ``actual``
    has a non-finite value, so no tolerance passes it)."""
    a, e = _as_float64(actual), _as_float64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {e.shape}")
    if not np.all(np.isfinite(a)):
        return float("inf")
    denominator = np.linalg.norm(e.ravel())
    numerator = np.linalg.norm((a - e).ravel())
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else float("inf")
    return float(numerator / denominator)


def rmse_ratio(actual: Any, baseline: Any, reference: Any) -> float:
    """Error of ``actual`` over error of ``baseline``, both against ``reference`` (≈1: as good as it)."""
    a, b, r = _as_float64(actual), _as_float64(baseline), _as_float64(reference)
    error_actual = np.sqrt(np.mean((a - r) ** 2))
    error_baseline = np.sqrt(np.mean((b - r) ** 2))
    if error_baseline == 0.0:
        return 0.0 if error_actual == 0.0 else float("inf")
    return float(error_actual / error_baseline)


def assert_finite(x: Any, name: str = "value") -> None:
    values = _as_float64(x)
    bad = ~np.isfinite(values)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values of {values.size} (first at {where})")


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: Any,
    gradient: bool = False,
    name: str = "output",
    tolerances: Mapping[str, Tolerance] | None = None,
    scale: float = 1.0,
) -> float:
    """Finite, same shape, and relative L2 error within the dtype's tolerance (``scale`` loosens it);
    returns the error. ``dtype`` is the dtype the computation ran in (the inputs' dtype)."""
    assert_finite(actual, name)
    tol = tolerance_for(dtype, tolerances)
    bound = (tol.gradient if gradient else tol.forward) * scale
    error = relative_error(actual, expected)
    if not error <= bound:
        raise AssertionError(
            f"{name}: relative L2 error {error:.3e} exceeds the {dtype_name(dtype)} "
            f"{'gradient' if gradient else 'forward'} tolerance {bound:.3e}"
        )
    return error


def assert_tree_close(
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    dtype: Any,
    gradient: bool = True,
    tolerances: Mapping[str, Tolerance] | None = None,
    scale: float = 1.0,
) -> dict[str, float]:
    """``assert_close`` on every entry of two dicts with the same keys (e.g. gradients by argument)."""
    if set(actual) != set(expected):
        raise AssertionError(f"keys differ: {sorted(actual)} vs {sorted(expected)}")
    errors = {}
    failures = []
    for key in sorted(expected):
        try:
            errors[key] = assert_close(
                actual[key], expected[key], dtype=dtype, gradient=gradient, name=key, tolerances=tolerances, scale=scale
            )
        except AssertionError as exc:
            failures.append(str(exc))
    if failures:
        raise AssertionError("; ".join(failures))
    return errors


# ---- inputs --------------------------------------------------------------------------------------


def fresh_keys(seed: int | jax.Array, count: int) -> list[jax.Array]:
    """``count`` independent PRNG keys (one per tensor: q, k and v must never share randomness)."""
    key = jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed
    return list(jax.random.split(key, count))


def normal_array(
    seed: int | Sequence[int], shape: Sequence[int], dtype: Any = jnp.float32, scale: float = 1.0
) -> jax.Array:
    """Standard normal (times ``scale``) from numpy's generator seeded with ``seed`` (an int, or a tuple
    such as ``(seed, tensor_index)`` for independent streams), rounded to ``dtype``; no exact zeros.

    numpy rather than ``jax.random``: XLA compiles the threefry sampler anew for every shape (about a
    second each on a 2-core CI machine, i.e. per test), while numpy draws in microseconds."""
    x = np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32) * np.float32(scale)
    x[x == 0] = np.float32(scale)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))  # rounded by numpy (ml_dtypes): no XLA compile per shape


def random_normal(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32, scale: float = 1.0) -> jax.Array:
    """Standard normal (times ``scale``) drawn in float32 then rounded to ``dtype``; zeros are replaced
    by ``scale`` so no element is exactly zero."""
    x = jax.random.normal(key, tuple(shape), jnp.float32) * scale
    x = jnp.where(x == 0, jnp.float32(scale), x)
    return x.astype(dtype)


def random_inputs(
    seed: int | jax.Array,
    shapes: Mapping[str, Sequence[int] | None],
    dtype: Any = jnp.float32,
    scale: float | Mapping[str, float] = 1.0,
) -> dict[str, jax.Array | None]:
    """One fresh normal tensor per name, each from its own key: ``random_inputs(0, {"query": (2, 17, 4,
    64), "key": ..., "value": ...}, jnp.bfloat16)``. A ``None`` shape gives ``None`` (optional inputs)."""
    keys = fresh_keys(seed, len(shapes))
    out: dict[str, jax.Array | None] = {}
    for k, (name, shape) in zip(keys, shapes.items()):
        s = scale.get(name, 1.0) if isinstance(scale, Mapping) else scale
        out[name] = None if shape is None else random_normal(k, shape, dtype, s)
    return out


def to_float64(tree: Any) -> Any:
    """numpy float64 copies of every floating array in ``tree`` (integers/bools/None unchanged); use
    inside ``jax.enable_x64(True)`` to feed a float64 reference the exact values the kernel saw."""

    def convert(x):
        if x is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return _as_float64(x)

    return jax.tree.map(convert, tree, is_leaf=lambda x: x is None)


def jax_float64(tree: Any) -> Any:
    """Like ``to_float64`` but jax float64 arrays (call within ``jax.enable_x64(True)``)."""
    return jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64) if isinstance(x, np.ndarray) and x.dtype == np.float64 else x,
        to_float64(tree),
        is_leaf=lambda x: x is None,
    )


# ---- forward + VJP against a float64 reference -----------------------------------------------------


def forward_and_vjp(
    fn: Callable[..., jax.Array],
    inputs: Mapping[str, Any],
    wrt: Sequence[str],
    cotangent_seed: int,
    compiler_options: Mapping[str, Any] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """``fn(**inputs)``, its VJP w.r.t. the inputs named in ``wrt`` with a fresh random cotangent, and
    that cotangent. ``compiler_options`` go to ``jax.jit`` (a suite's ``compiler_options`` attribute)."""

    # non-differentiated inputs are closed over: they stay concrete, so value checks still run
    fixed = {k: v for k, v in inputs.items() if k not in wrt}

    # one compilation per check instead of one per primitive
    @functools.partial(jax.jit, compiler_options=dict(compiler_options) if compiler_options else None)
    def forward_backward(diff, cotangent):
        out, vjp = jax.vjp(lambda *d: fn(**fixed, **dict(zip(wrt, d, strict=True))), *diff)
        return out, (vjp(cotangent) if wrt else ())

    shape = jax.eval_shape(lambda: fn(**inputs))
    cotangent = normal_array(cotangent_seed, shape.shape, shape.dtype)
    out, grads = forward_backward(tuple(inputs[name] for name in wrt), cotangent)
    return out, dict(zip(wrt, grads, strict=True)), cotangent


def reference_forward_and_vjp(
    reference: Callable[..., jax.Array], inputs: Mapping[str, Any], wrt: Sequence[str], cotangent: jax.Array
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The float64 reference on the exact values the kernel saw, and its VJP with the same cotangent."""
    with jax.enable_x64(True):
        inputs64 = jax_float64(dict(inputs))
        inputs64 = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in inputs64.items()}

        fixed = {k: v for k, v in inputs64.items() if k not in wrt}

        @jax.jit
        def forward_backward(diff, cotangent):
            out, vjp = jax.vjp(lambda *d: reference(**fixed, **dict(zip(wrt, d, strict=True))), *diff)
            return out, (vjp(cotangent.astype(out.dtype)) if wrt else ())

        out, grads = forward_backward(tuple(inputs64[name] for name in wrt), jnp.asarray(jax_float64(cotangent)))
        return np.asarray(out), {name: np.asarray(g) for name, g in zip(wrt, grads, strict=True)}


def check_against_reference(
    fn: Callable[..., jax.Array],
    reference: Callable[..., jax.Array],
    inputs: Mapping[str, Any],
    wrt: Sequence[str],
    *,
    dtype: Any,
    tolerances: Mapping[str, Tolerance] | None = None,
    cotangent_seed: int = 12345,
    scale: float = 1.0,
    compiler_options: Mapping[str, Any] | None = None,
) -> jax.Array:
    """Forward output and every gradient in ``wrt`` within the dtype's tolerance of the reference."""
    out, grads, cotangent = forward_and_vjp(fn, inputs, wrt, cotangent_seed, compiler_options)
    expected, expected_grads = reference_forward_and_vjp(reference, inputs, wrt, cotangent)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype}, expected {jnp.dtype(dtype)}"
    assert_close(out, expected, dtype=dtype, tolerances=tolerances, scale=scale)
    if wrt:
        assert_tree_close(grads, expected_grads, dtype=dtype, tolerances=tolerances, scale=scale)
    return out


def assert_gradient_refused(fn: Callable[..., jax.Array], inputs: Mapping[str, Any], wrt: Sequence[str]) -> None:
    """For forward-only backends: a gradient must raise, never come back wrong."""
    import pytest

    with pytest.raises(Exception):  # noqa: PT011 - any clear error is acceptable
        forward_and_vjp(fn, inputs, wrt, 0)


def exact_matmuls(reference: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a reference so its JAX matmuls run at full float32 precision wherever it runs (on NVIDIA GPUs
    XLA's own default is TF32, ~3e-4 relative error: no yardstick for a float32 kernel)."""

    @functools.wraps(reference)
    def exact(*args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision("highest"):
            return reference(*args, **kwargs)

    return exact


def run_jitted(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as one compiled computation with every input a closed-over constant (eager
    dispatch would compile every primitive separately; constants keep value checks working)."""
    return jax.jit(lambda: fn(*args, **kwargs))()


# ---- bad inputs --------------------------------------------------------------------------------------


class BadInputChecks:
    """Mixin of the suites: ``assert_rejected(match, **call)`` checks that a bad call is refused with a
    ``ValueError`` naming ``match`` by the operation itself (through the executor, so before anything
    compiles), and by the public function (whose type annotations may speak first: ``TypeError``).

    The call goes by keyword (``Op.validate`` binds to the public signature). ``operation_arguments``, where
    a suite still sets it, names arguments passed as None where the call lacks them."""

    platform: ClassVar[str]
    operation_type: ClassVar[type]
    operation_arguments: ClassVar[tuple[str, ...]] = ()

    def assert_rejected(self, match: str, **call: Any) -> None:
        import pytest

        from ejkernel.ops import get_default_executor

        call = {**dict.fromkeys(self.operation_arguments), **call}
        with pytest.raises(ValueError, match=match):
            get_default_executor()(self.operation_type(), platform=self.platform, **call)
        with pytest.raises((ValueError, TypeError), match=match):
            self.call(**call)


class ConformanceSuite(BadInputChecks):
    """Base of the operation suites: the knobs a backend's test class sets, and :meth:`check_call`.

    ``platform`` (required); ``cfg``, a config of the implementation under test used for every call (None:
    its heuristic); ``supports_gradients`` (False: a forward-only backend, whose gradients must raise);
    ``tolerances`` (None: :data:`TOLERANCES`); ``compiler_options`` (:data:`INTERPRET_COMPILER_OPTIONS` for
    interpret-mode kernels)."""

    platform: ClassVar[str]
    cfg: ClassVar[Any] = None
    supports_gradients: ClassVar[bool] = True
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    compiler_options: ClassVar[Mapping[str, Any] | None] = None
    public_name: ClassVar[str]
    """The operation's public function in ``ejkernel.modules``: what :meth:`call` runs."""

    def call(self, **arguments: Any) -> Any:
        """The public function on ``arguments`` (by name; its positional-only ones in their places) with
        the suite's ``platform`` and ``cfg`` (a ``cfg`` in ``arguments`` wins)."""
        import ejkernel.modules

        function = getattr(ejkernel.modules, self.public_name)
        arguments = {"platform": self.platform, "cfg": self.cfg, **arguments}
        positional = []
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind is not parameter.POSITIONAL_ONLY or parameter.name not in arguments:
                break
            positional.append(arguments.pop(parameter.name))
        return function(*positional, **arguments)

    def check_call(
        self,
        reference: Callable[..., jax.Array],
        inputs: Mapping[str, Any],
        wrt: Sequence[str],
        dtype: Any,
        *,
        scale: float = 1.0,
        **static: Any,
    ) -> jax.Array:
        """:func:`check_against_reference` of ``self.call`` and ``reference``, both given ``**inputs`` and the
        keywords ``static``, with the suite's options; a forward-only backend is checked forward only and
        must refuse the gradients of ``wrt``."""
        fn = lambda **kw: self.call(**kw, **static)  # noqa: E731
        reference = functools.partial(reference, **static)
        options = dict(dtype=dtype, tolerances=self.tolerances, scale=scale, compiler_options=self.compiler_options)
        if not self.supports_gradients:
            out = check_against_reference(fn, reference, inputs, (), **options)
            assert_gradient_refused(fn, inputs, wrt)
            return out
        return check_against_reference(fn, reference, inputs, wrt, **options)

    def gradients_of(self, *names: str) -> tuple[str, ...]:
        """``names`` where the backend takes gradients, else nothing."""
        return names if self.supports_gradients else ()

    def assert_rows_are_zero(self, inputs: Mapping[str, Any], rows: Any, wrt: Sequence[str]) -> jax.Array:
        """The call's output, and its finite gradients w.r.t. ``wrt`` (where the backend takes gradients), are 0
        on ``rows`` (an index into axis 0: rows that attend to nothing); returns the output."""
        wrt = self.gradients_of(*wrt)
        out, grads, _ = forward_and_vjp(lambda **kw: self.call(**kw), inputs, wrt, 5, self.compiler_options)
        np.testing.assert_array_equal(np.asarray(out[rows]), 0.0)
        for name, grad in grads.items():
            assert_finite(grad, f"d {name}")
            np.testing.assert_array_equal(np.asarray(grad[rows]), 0.0)
        return out

    def heuristic_config_that_runs(self, implementation: Any, inputs: Mapping[str, Any], unset_config: Any) -> Any:
        """``implementation``'s heuristic config for the call on ``inputs``, checked to run bit for bit as
        ``unset_config`` (its fields left at None, resolved by the implementation): the heuristic spells out
        what runs, which the executor stores."""
        cfg = implementation.heuristic_config(self.operation_type().validate(**inputs))
        run = jax.jit(lambda c, **kw: self.call(**kw, cfg=c), static_argnums=0)
        assert (run(cfg, **inputs) == run(unset_config, **inputs)).all()
        return cfg

    def assert_matmul_precision(self, inputs: Mapping[str, Any], wrt: str, precision: Any, expected: Any) -> None:
        """Every matmul of the call with ``precision=precision``, and of its gradient w.r.t. ``wrt``, runs at
        ``expected``."""

        def loss(x):
            return self.call(**{**inputs, wrt: x}, precision=precision).sum()

        found = matmul_precisions(jax.grad(loss), inputs[wrt])
        assert found and all(p == expected for p in found), found


def call_precision_cases():
    """``pytest.mark.parametrize("dtype,precision,expected", ...)`` over the precision policy's cases of a
    matmul-precision test: float32 runs at HIGHEST unless the call asks otherwise, bfloat16 at DEFAULT."""
    import pytest

    highest, default = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
    return pytest.mark.parametrize(
        "dtype,precision,expected",
        [("float32", None, highest), ("float32", "default", default), ("bfloat16", None, default)],
        ids=["float32", "float32-asked-default", "bfloat16"],
    )


def program(jaxpr) -> Iterator[tuple[Any, Any]]:
    """(jaxpr, equation) of ``jaxpr`` and of every jaxpr nested in it (scan, cond, custom VJP, shard_map,
    kernel bodies), in program order: a nested jaxpr's equations right after the equation holding it."""
    for eqn in jaxpr.eqns:
        yield jaxpr, eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from program(inner)


def matmul_precisions(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """The :class:`jax.lax.Precision` of every matmul (``dot_general``, ``ragged_dot_general``) in
    ``fn(*args)``'s jaxpr, nested jaxprs (scan, cond, custom VJP, ...) included; ``DEFAULT`` where none was
    recorded. Pass a gradient function to see the backward's matmuls too."""
    return [
        jax.lax.Precision.DEFAULT if eqn.params["precision"] is None else eqn.params["precision"][0]
        for _, eqn in program(jax.make_jaxpr(fn)(*args).jaxpr)
        if eqn.primitive.name in ("dot_general", "ragged_dot_general")
    ]
