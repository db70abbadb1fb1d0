"""Argument checks shared by every operation: each error names the argument, shows its shape/dtype
and says what was expected, and is raised before anything is traced or compiled."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

F = TypeVar("F", bound=Callable)

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INT_DTYPES = (jnp.int32, jnp.int64, jnp.int16, jnp.int8, jnp.uint32)


def describe(x: Any) -> str:
    """``bfloat16[2, 128, 8, 64]`` for arrays (and abstract arrays), ``repr`` otherwise."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x)
    return f"{jnp.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_array(
    name: str,
    x: Any,
    *,
    rank: int | None = None,
    dtypes: Iterable[Any] | None = None,
    what: str = "",
) -> None:
    """``x`` is an array of the given rank and one of ``dtypes``; ``what`` describes the layout."""
    layout = f" {what}" if what else ""
    if not is_array(x):
        raise ValueError(f"{name} must be an array{layout}, got {type(x).__name__}: {x!r}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}{layout}, got {describe(x)} (rank {x.ndim})")
    if dtypes is not None:
        allowed = [jnp.dtype(d) for d in dtypes]
        if jnp.dtype(x.dtype) not in allowed:
            names = ", ".join(d.name for d in allowed)
            raise ValueError(f"{name} must have dtype in ({names}){layout}, got {describe(x)}")


def check_dim(name: str, x: Any, axis: int, expected: int, meaning: str) -> None:
    """``x.shape[axis] == expected``; ``meaning`` says where the expectation comes from."""
    if x.shape[axis] != expected:
        raise ValueError(f"{name} has {x.shape[axis]} along axis {axis}, expected {expected} ({meaning}); got {describe(x)}")


def check_same_dtype(reference_name: str, reference: Any, **others: Any) -> None:
    """Every array in ``others`` has ``reference``'s dtype (mixed dtypes are refused, not promoted)."""
    for name, value in others.items():
        if value is not None and jnp.dtype(value.dtype) != jnp.dtype(reference.dtype):
            raise ValueError(
                f"{name} must have the same dtype as {reference_name} ({jnp.dtype(reference.dtype).name}), "
                f"got {describe(value)}"
            )


def check_broadcastable(name: str, x: Any, target: tuple[int, ...], meaning: str) -> None:
    """``x`` has ``target``'s rank and each dim equals the target's or 1."""
    if x.ndim != len(target) or any(d not in (1, t) for d, t in zip(x.shape, target)):
        expected = "[" + ", ".join(f"{t} or 1" for t in target) + "]"
        raise ValueError(f"{name} must broadcast to {meaning} {expected}, got {describe(x)}")


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_probability(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")


def check_cum_seqlens(name: str, value: Any, total: int, total_name: str) -> None:
    """int array [N+1], starting at 0, non-decreasing, last entry <= ``total`` (checked when concrete)."""
    check_array(name, value, rank=1, dtypes=INT_DTYPES, what="(cumulative sequence lengths [num_seqs + 1])")
    if value.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 entries ([0, len_0, ...]), got {describe(value)}")
    try:
        concrete = np.asarray(value)
    except Exception:  # a tracer: values are checked where they are known
        return
    if concrete[0] != 0 or np.any(np.diff(concrete) < 0) or concrete[-1] > total:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at most at {total} ({total_name}), got {concrete.tolist()}"
        )


class ArgumentTypeError(ValueError, TypeError):
    """An argument violates the operation's shape/dtype annotations (a ValueError like the other checks)."""


@functools.cache
def _typechecker() -> tuple[Callable, type]:
    import beartype
    import jaxtyping

    return (lambda fn: jaxtyping.jaxtyped(typechecker=beartype.beartype)(fn)), jaxtyping.TypeCheckError


_PARAMETER = re.compile(r"typechecking parameter '(\w+)'")
_ACTUAL = re.compile(r"Actual value: (.*)")
_EXPECTED = re.compile(r"Expected type: (?:<class ')?(.*?)(?:'>)?\.?$", re.M)
_AXES = "The current values for each jaxtyping axis annotation are as follows."


def _concise(function: str, message: str, arguments: dict[str, Any]) -> str | None:
    """One readable sentence from jaxtyping's report: argument, its shape/dtype, what was expected."""
    parameter = _PARAMETER.search(message)
    expected = _EXPECTED.search(message)
    if parameter is None or expected is None:
        return None
    name = parameter.group(1)
    value = arguments.get(name, None)
    actual = describe(value) if value is not None else (_ACTUAL.search(message) or [None, "?"])[1]
    text = f"{function}: argument {name!r} is {actual}; expected {expected.group(1).replace('jaxtyping.', '')}"
    if _AXES in message:
        axes = [line.strip() for line in message.split(_AXES, 1)[1].strip().splitlines() if "=" in line]
        if axes:
            text += " with " + ", ".join(axes) + " (sizes taken from the arguments before it)"
    return text


def typechecked(fn: F) -> F:
    """Check ``fn``'s jaxtyping/beartype annotations on every call (at trace time under jit).

    A violation raises :class:`ArgumentTypeError` with one sentence naming the argument, its shape/dtype
    and the expected annotation with the dimension sizes bound so far.
    """
    checked = None
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal checked
        make_checked, check_error = _typechecker()
        if checked is None:
            checked = make_checked(fn)
        try:
            return checked(*args, **kwargs)
        except check_error as error:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            concise = _concise(fn.__name__, str(error), arguments)
            if concise is None:
                raise
            raise ArgumentTypeError(concise) from None

    return wrapper  # type: ignore[return-value]
