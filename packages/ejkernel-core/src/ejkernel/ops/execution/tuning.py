"""Validated autotuning and benchmarking.

For a new cache key the :class:`Tuner` compiles each candidate config and times it on fresh random
concrete inputs of the call's shapes (float inputs are always freshly drawn, never zeros; concrete
integer/bool inputs such as lengths or indices are reused because their values carry meaning). Timing
is warm-up runs, then the median of several. It never times tracers or tracing: under ``jax.jit`` the
work happens at trace time, in an eager context, and the traced program only receives the winner.

Validation: the heuristic config is the reference. A candidate that fails to compile or run (including
out of memory) is skipped with its reason logged; a candidate whose outputs -- and, for kernels with a
``custom_vjp``, whose gradients -- differ from the reference's beyond the dtype's tolerance is rejected,
however fast. Kernels with a ``custom_vjp`` are timed forward + backward, so the config also suits the
backward pass. Tolerance: max |candidate - reference| / max |reference| per output, at most
``kernel.autotune_rtol`` if the kernel sets it, else 1e-6 (f64), 2e-3 (f32), 1e-2 (f16), 4e-2 (bf16),
0.25 (fp8).

``EJKERNEL_LOG_AUTOTUNE=1`` logs every candidate's time (logger ``ejkernel.ops.autotune``); a progress
line is drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from ejkernel.errors import EjkernelRuntimeError
from ejkernel.ops.config.policy import AutotunePolicy
from ejkernel.ops.core.invocation import Invocation, is_array_like, is_inexact, require_kernel
from ejkernel.ops.execution.runner import ArrayLeaves, has_custom_vjp, run_with_config
from ejkernel.ops.utils.env import env_flag

__all__ = ["LOG_ENV", "Autotuner", "CandidateResult", "TuneResult", "Tuner", "autotune", "benchmark", "tuning_inputs"]

LOG_ENV = "EJKERNEL_LOG_AUTOTUNE"
logger = logging.getLogger("ejkernel.ops.autotune")
_UNSET = object()

_TOLERANCE = {"float64": 1e-6, "float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}


def _log_enabled() -> bool:
    return env_flag(LOG_ENV)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced after the handler is made)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


_handler: logging.Handler | None = None


def _log(level: int, message: str, *args: Any) -> None:
    global _handler
    if _log_enabled() and _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter("[ejkernel autotune] %(message)s"))
        logger.addHandler(_handler)
        logger.setLevel(logging.INFO)
    logger.log(level, message, *args)


def _block(value: Any) -> Any:
    import jax

    return jax.block_until_ready(value)


def benchmark(fn: Callable, *args: Any, num_iters: int = 100, num_warmup: int = 3, **kwargs: Any) -> float:
    """Median wall time of ``fn(*args, **kwargs)`` in milliseconds (after ``num_warmup`` untimed runs)."""
    if not callable(fn):
        raise TypeError(f"benchmark expects a callable, got {type(fn).__name__}")
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"num_iters must be an int >= 1, got {num_iters!r}")
    if not isinstance(num_warmup, int) or num_warmup < 0:
        raise ValueError(f"num_warmup must be an int >= 0, got {num_warmup!r}")
    for _ in range(num_warmup):
        _block(fn(*args, **kwargs))
    times = []
    for _ in range(num_iters):
        start = time.perf_counter()
        _block(fn(*args, **kwargs))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class CandidateResult:
    """What happened to one candidate."""

    cfg: Any
    status: str
    """``"ok"``, ``"failed"`` (compile/run error), ``"rejected"`` (wrong result) or ``"skipped"`` (budget)."""
    time_ms: float | None = None
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one invocation."""

    best: Any
    """The fastest valid config, or None when not even the reference ran."""
    best_time_ms: float | None
    candidates: tuple[CandidateResult, ...]

    @property
    def timings(self) -> dict[str, float]:
        """``{repr(cfg): ms}`` of the candidates that ran and passed validation."""
        return {repr(c.cfg): c.time_ms for c in self.candidates if c.status == "ok" and c.time_ms is not None}


def _concrete(value: Any) -> bool:
    import jax
    import numpy as np

    if isinstance(value, jax.core.Tracer) or isinstance(value, jax.ShapeDtypeStruct):
        return False
    return isinstance(value, (np.ndarray, np.generic, jax.Array))


def _random_array(rng, shape: tuple, dtype: Any):
    import jax
    import numpy as np

    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        data = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    elif is_inexact(dtype):  # bfloat16 and fp8 too
        data = rng.standard_normal(shape)
    elif dtype == np.bool_:
        data = rng.random(shape) < 0.5
    elif np.issubdtype(dtype, np.integer):
        data = rng.integers(1, 8, size=shape)  # small, positive: safe as lengths/indices of small shapes
    else:
        raise TypeError(f"cannot draw random inputs of dtype {dtype}")
    return jax.device_put(np.asarray(data).astype(dtype))


def tuning_inputs(inv: Invocation, seed: int = 0) -> tuple[tuple, dict]:
    """Concrete inputs for timing ``inv``: ``kernel.make_tuning_inputs(inv, seed)`` if defined, else random.

    Float arrays are always freshly drawn (standard normal); concrete integer and bool arrays are kept.
    """
    import jax
    import numpy as np

    maker = getattr(inv.kernel, "make_tuning_inputs", None)
    if callable(maker):
        args, kwargs = maker(inv, seed)
        return tuple(args), dict(kwargs)
    rng = np.random.default_rng(seed)

    def leaf(value: Any) -> Any:
        if not is_array_like(value):
            return value
        dtype = np.dtype(value.dtype)
        keep = _concrete(value) and not is_inexact(dtype)
        return value if keep else _random_array(rng, tuple(value.shape), dtype)

    args, kwargs = jax.tree_util.tree_map(leaf, (inv.args, inv.kwargs))
    return tuple(args), kwargs


def _tolerance(kernel: Any, dtype: Any) -> float:
    override = getattr(kernel, "autotune_rtol", None)
    if override is not None:
        return float(override)
    import numpy as np

    name = np.dtype(dtype).name
    if name.startswith("float8"):
        return 0.25
    return _TOLERANCE.get(name, 2e-3)


def _mismatch(kernel: Any, got: Any, want: Any, what: str) -> str | None:
    """Why ``got`` differs from ``want`` beyond tolerance, or None when they agree."""
    import jax
    import numpy as np

    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    if got_def != want_def:
        return f"{what} structure {got_def} differs from the reference's {want_def}"
    for index, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}[{index}] is {a.dtype}{list(a.shape)}, the reference's is {b.dtype}{list(b.shape)}"
        if a.dtype == jax.dtypes.float0:
            continue
        if not is_inexact(a.dtype):
            if not np.array_equal(a, b):
                return f"{what}[{index}] differs from the reference (exact dtype {a.dtype})"
            continue
        wide = np.complex128 if np.issubdtype(a.dtype, np.complexfloating) else np.float64
        a64, b64 = a.astype(wide), b.astype(wide)
        finite = np.isfinite(b64)
        if not np.array_equal(finite, np.isfinite(a64)) or not np.array_equal(np.isnan(a64), np.isnan(b64)):
            return f"{what}[{index}] has non-finite values where the reference does not (or vice versa)"
        if not finite.any():
            continue
        scale = max(float(np.max(np.abs(b64[finite]))), np.finfo(np.float32).tiny)
        error = float(np.max(np.abs(a64[finite] - b64[finite]))) / scale
        tolerance = _tolerance(kernel, a.dtype)
        if error > tolerance:
            return f"{what}[{index}] differs from the reference: relative max error {error:.3g} > {tolerance:g}"
    return None


def _cfg_identity(cfg: Any) -> Any:
    try:
        hash(cfg)
        return ("hash", cfg)
    except TypeError:
        return ("repr", repr(cfg))


class _Progress:
    def __init__(self, enabled: bool, title: str, total: int):
        self.enabled, self.title, self.total = enabled, title, total

    def update(self, done: int) -> None:
        if self.enabled:
            sys.stderr.write(f"\r[ejkernel] autotuning {self.title}: {done}/{self.total} candidates")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class Tuner:
    """Benchmarks candidate configs of an invocation and returns the fastest valid one.

    Args:
        warmup: untimed runs per candidate (after the first, validating, run).
        iters: timed runs per candidate; the median is kept.
        seed: seed of the random inputs.
        progress: draw a progress line on stderr (default: only when stderr is a terminal).
    """

    def __init__(self, warmup: int = 2, iters: int = 5, *, seed: int = 0, progress: bool | None = None):
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters must be an int >= 1, got {iters!r}")
        self.warmup, self.iters, self.seed, self.progress = warmup, iters, seed, progress

    def __repr__(self) -> str:
        return f"Tuner(warmup={self.warmup}, iters={self.iters})"

    def tune(
        self,
        inv: Invocation,
        candidates: Iterable[Any],
        *,
        heuristic: Any = _UNSET,
        policy: AutotunePolicy | None = None,
    ) -> TuneResult:
        """Time ``candidates`` (plus the heuristic config, the reference) and pick the fastest valid one."""
        import jax

        policy = policy or AutotunePolicy()
        kernel = inv.kernel
        if heuristic is _UNSET:
            heuristic = kernel.heuristic_cfg(inv)
        ordered, seen = [], set()
        for cfg in [heuristic, *candidates]:
            identity = _cfg_identity(cfg)
            if identity not in seen:
                seen.add(identity)
                ordered.append(cfg)
        pruned = ordered[policy.max_candidates :]
        ordered = ordered[: policy.max_candidates]
        with jax.ensure_compile_time_eval():  # run eagerly even when called while tracing
            results = self._run_all(inv, ordered, policy)
        results += [CandidateResult(cfg, "skipped", reason="over max_candidates") for cfg in pruned]
        valid = [r for r in results if r.status == "ok"]
        best = min(valid, key=lambda r: r.time_ms) if valid else None
        if best is not None:
            _log(
                logging.INFO,
                "%s: best %r (%.4f ms) of %d candidates",
                kernel.name,
                best.cfg,
                best.time_ms,
                len(results),
            )
        return TuneResult(best.cfg if best else None, best.time_ms if best else None, tuple(results))

    def _run_all(self, inv: Invocation, configs: list, policy: AutotunePolicy) -> list[CandidateResult]:
        kernel = inv.kernel
        args, kwargs = tuning_inputs(inv, self.seed)
        split = ArrayLeaves(args, kwargs)
        dynamic = split.arrays
        with_grad = has_custom_vjp(kernel)
        cotangent = self._cotangent(kernel, split, dynamic, configs[0]) if with_grad else None
        progress = _Progress(sys.stderr.isatty() if self.progress is None else self.progress, kernel.name, len(configs))
        start = time.perf_counter()
        reference: Any = _UNSET
        results: list[CandidateResult] = []
        try:
            for index, cfg in enumerate(configs):
                progress.update(index)
                if index > 0 and time.perf_counter() - start > policy.time_budget_s:
                    results.append(CandidateResult(cfg, "skipped", reason=f"time budget {policy.time_budget_s}s spent"))
                    continue
                if index > 0 and policy.validate and reference is _UNSET:
                    results.append(CandidateResult(cfg, "skipped", reason="the reference (heuristic) config failed"))
                    continue
                result, output = self._measure(kernel, split, dynamic, cotangent, cfg, with_grad)
                if result.status == "ok" and index == 0:
                    reference = output
                elif result.status == "ok" and policy.validate:
                    why = _mismatch(kernel, output[0], reference[0], "output")
                    if why is None and with_grad:
                        why = _mismatch(kernel, output[1], reference[1], "gradient")
                    if why is not None:
                        result = CandidateResult(cfg, "rejected", result.time_ms, why)
                self._report(kernel, result)
                results.append(result)
        finally:
            progress.close()
        return results

    def _cotangent(self, kernel: Any, split: ArrayLeaves, dynamic: list, cfg: Any) -> Any:
        import jax
        import numpy as np

        shapes = jax.eval_shape(lambda dyn: _forward(kernel, split, cfg)(dyn), dynamic)
        rng = np.random.default_rng(self.seed + 1)

        def leaf(shape):
            if is_inexact(shape.dtype):
                return _random_array(rng, shape.shape, shape.dtype)
            return np.zeros(shape.shape, jax.dtypes.float0)

        return jax.tree_util.tree_map(leaf, shapes)

    def _measure(self, kernel, split, dynamic, cotangent, cfg, with_grad) -> tuple[CandidateResult, Any]:
        import jax

        forward = _forward(kernel, split, cfg)
        if with_grad:

            def program(dyn, ct):
                out, pullback = jax.vjp(forward, dyn)
                return out, pullback(ct)[0]

            operands = (dynamic, cotangent)
        else:

            def program(dyn):
                return (forward(dyn),)

            operands = (dynamic,)
        try:
            compiled = jax.jit(program).lower(*operands).compile()
        except Exception as exc:
            return CandidateResult(cfg, "failed", reason=f"compile: {type(exc).__name__}: {_short(exc)}"), None
        try:
            output = _block(compiled(*operands))
            time_ms = benchmark(compiled, *operands, num_iters=self.iters, num_warmup=self.warmup)
        except Exception as exc:
            return CandidateResult(cfg, "failed", reason=f"run: {type(exc).__name__}: {_short(exc)}"), None
        return CandidateResult(cfg, "ok", time_ms), output

    @staticmethod
    def _report(kernel: Any, result: CandidateResult) -> None:
        if result.status == "ok":
            _log(logging.INFO, "%s: %r: %.4f ms", kernel.name, result.cfg, result.time_ms)
        else:
            _log(logging.INFO, "%s: %r %s: %s", kernel.name, result.cfg, result.status, result.reason)


Autotuner = Tuner
"""The spec's module listing names the tuner ``Autotuner``."""


def _forward(kernel: Any, split: ArrayLeaves, cfg: Any) -> Callable:
    def forward(dynamic):
        args, kwargs = split.rebuild(dynamic)
        return run_with_config(kernel, args, kwargs, cfg)

    return forward


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def autotune(
    kernel: Any,
    *args: Any,
    configs: Iterable[Any] | None = None,
    num_warmup: int = 3,
    num_iters: int = 10,
    validate: bool = True,
    **kwargs: Any,
) -> Any:
    """Benchmark ``configs`` (default: the kernel's config space) for this call; return the fastest valid one.

    The heuristic config is always measured too and is the reference for validation. Nothing is cached:
    store the result yourself (``ConfigCache.put``) or use :func:`ejkernel.ops.autotune_recorded`.
    """
    require_kernel(kernel, "autotune")
    if getattr(kernel, "prepare", None) is not None:
        args, kwargs = kernel.prepare(*args, **kwargs)
    inv = Invocation(kernel, tuple(args), kwargs)
    candidates = list(configs) if configs is not None else list(kernel.config_space(inv))
    policy = AutotunePolicy(max_candidates=len(candidates) + 1, time_budget_s=float("inf"), validate=validate)
    result = Tuner(warmup=num_warmup, iters=num_iters).tune(inv, candidates, policy=policy)
    if result.best is None:
        reasons = "; ".join(f"{c.cfg!r}: {c.reason}" for c in result.candidates)
        raise EjkernelRuntimeError(f"autotune of {kernel.name!r}: no candidate ran ({reasons})")
    return result.best
