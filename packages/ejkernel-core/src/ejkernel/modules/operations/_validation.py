"""Argument checks shared by every operation: each error names the argument, shows its shape/dtype
and says what was expected, and is raised before anything is traced or compiled."""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

F = TypeVar("F", bound=Callable)

DEFAULT_DROPOUT_SEED = 0
"""Seed used when ``dropout_prob > 0`` and no ``dropout_seed`` is given (the same mask on every call)."""

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INT_DTYPES = (jnp.int32, jnp.int64, jnp.int16, jnp.int8, jnp.uint32)
QUANTIZED_CACHE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)
"""Dtypes a KV cache may hold instead of the query's (the operations that take ``key_scale``/``value_scale``)."""


def is_quantized_cache(x: Any) -> bool:
    """Whether ``x`` (an array) holds one of :data:`QUANTIZED_CACHE_DTYPES`."""
    return jnp.dtype(x.dtype) in [jnp.dtype(d) for d in QUANTIZED_CACHE_DTYPES]


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
    if isinstance(value, np.ndarray) and "Array" in expected.group(1):
        # the shape may well fit: say what does not (a numpy array where a JAX array is annotated)
        text = text.replace(f"is {actual};", f"is a numpy array {actual} (pass a JAX array: jnp.asarray(...));", 1)
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


# ---- arguments shared by the attention operations --------------------------------------------


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def resolve_softmax_scale(value: Any, head_dim: int, name: str = "softmax_scale") -> float:
    """``None`` -> ``1/sqrt(head_dim)``; otherwise a finite real number."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_real(value) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite float or None, got {value!r}")
    return float(value)


def normalize_sliding_window(value: Any) -> tuple[int, int] | None:
    """``None``, an int ``w`` (-> ``(w, w)``) or ``(left, right)``; every size a non-negative int."""
    if value is None:
        return None
    pair = (value, value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0 for w in pair)
    ):
        raise ValueError(
            "sliding_window must be None, a non-negative int or a (left, right) pair of non-negative ints, "
            f"got {value!r}"
        )
    return int(pair[0]), int(pair[1])


def normalize_soft_cap(value: Any, name: str = "logits_soft_cap") -> float | None:
    if value is None:
        return None
    if not _is_real(value) or not float(value) > 0 or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a positive finite float or None, got {value!r}")
    return float(value)


def check_gqa(query_heads_name: str, num_heads: int, kv_name: str, num_kv_heads: int, kv_array: Any) -> None:
    """``num_kv_heads`` divides ``num_heads`` (grouped-query / multi-query attention)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{kv_name} has {num_kv_heads} kv heads, which must divide the {num_heads} heads of "
            f"{query_heads_name} (GQA/MQA); got {describe(kv_array)}"
        )


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as numpy when its values are known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except Exception:  # a tracer: values are checked where they are known
        return None


def check_qkv(query, key, value) -> tuple[int, int, int, int, int, int]:
    """Rank, dtype and shape agreement of query/key/value; returns (B, Sq, H, D, Skv, Hkv)."""
    check_array("query", query, rank=4, dtypes=FLOAT_DTYPES, what="[batch, q_len, num_heads, head_dim]")
    check_array("key", key, rank=4, dtypes=FLOAT_DTYPES, what="[batch, kv_len, num_kv_heads, head_dim]")
    check_array("value", value, rank=4, dtypes=FLOAT_DTYPES, what="[batch, kv_len, num_kv_heads, v_head_dim]")
    check_same_dtype("query", query, key=key, value=value)
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1], key.shape[2]
    check_dim("key", key, 0, batch, "batch of query")
    check_dim("key", key, 3, head_dim, "head_dim of query")
    check_dim("value", value, 0, batch, "batch of query")
    check_dim("value", value, 1, kv_len, "kv_len of key")
    check_dim("value", value, 2, num_kv_heads, "num_kv_heads of key")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"key has {num_kv_heads} kv heads, which must divide the {num_heads} heads of query (GQA/MQA); "
            f"got key {describe(key)}, query {describe(query)}"
        )
    return batch, q_len, num_heads, head_dim, kv_len, num_kv_heads


def check_bias(bias, batch: int, num_heads: int, q_len: int, kv_len: int) -> None:
    if bias is None:
        return
    check_array("bias", bias, rank=4, dtypes=FLOAT_DTYPES, what="[batch or 1, num_heads or 1, q_len, kv_len]")
    check_broadcastable("bias", bias, (batch, num_heads, q_len, kv_len), "[batch, num_heads, q_len, kv_len]")
    for axis, size, meaning in ((2, q_len, "q_len"), (3, kv_len, "kv_len")):
        check_dim("bias", bias, axis, size, meaning)


def normalize_attention_mask(mask, batch: int, num_heads: int, q_len: int, kv_len: int):
    """bool ``[B or 1, 1 or H, Sq, Skv]`` -> ``[B, 1 or H, Sq, Skv]``."""
    if mask is None:
        return None
    check_array("attention_mask", mask, rank=4, dtypes=(jnp.bool_,), what="[batch, 1 or num_heads, q_len, kv_len]")
    check_broadcastable("attention_mask", mask, (batch, num_heads, q_len, kv_len), "[batch, num_heads, q_len, kv_len]")
    for axis, size, meaning in ((2, q_len, "q_len"), (3, kv_len, "kv_len")):
        check_dim("attention_mask", mask, axis, size, meaning)
    if mask.shape[0] != batch:
        mask = jnp.broadcast_to(mask, (batch, *mask.shape[1:]))
    return mask


def normalize_segment_ids(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int):
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None
    if q_segment_ids is None or kv_segment_ids is None:
        if q_segment_ids is not None:
            given, name = q_segment_ids, "q_segment_ids"
        else:
            given, name = kv_segment_ids, "kv_segment_ids"
        if q_len != kv_len:
            missing = "kv_segment_ids" if name == "q_segment_ids" else "q_segment_ids"
            raise ValueError(
                f"{missing} is required when {name} is given and q_len ({q_len}) != kv_len ({kv_len}); "
                f"got {name} {describe(given)}"
            )
        q_segment_ids = kv_segment_ids = given
    check_array("q_segment_ids", q_segment_ids, rank=2, dtypes=INT_DTYPES, what="[batch, q_len]")
    check_array("kv_segment_ids", kv_segment_ids, rank=2, dtypes=INT_DTYPES, what="[batch, kv_len]")
    check_dim("q_segment_ids", q_segment_ids, 0, batch, "batch of query")
    check_dim("q_segment_ids", q_segment_ids, 1, q_len, "q_len of query")
    check_dim("kv_segment_ids", kv_segment_ids, 0, batch, "batch of key")
    check_dim("kv_segment_ids", kv_segment_ids, 1, kv_len, "kv_len of key")
    return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def normalize_cum_seqlens(cum_seqlens_q, cum_seqlens_k, batch: int, q_len: int, kv_len: int):
    args_q = cum_seqlens_q
    if cum_seqlens_q is None and cum_seqlens_k is None:
        return None, None
    if cum_seqlens_q is None or cum_seqlens_k is None:
        given = "cum_seqlens_q" if cum_seqlens_q is not None else "cum_seqlens_k"
        raise ValueError(f"cum_seqlens_q and cum_seqlens_k must be given together; got only {given}")
    if batch != 1:
        raise ValueError(
            f"with cum_seqlens_q/cum_seqlens_k the sequences are packed along axis 1 and batch must be 1; "
            f"got query batch {batch}"
        )
    check_cum_seqlens("cum_seqlens_q", cum_seqlens_q, q_len, "q_len of the packed query")
    check_cum_seqlens("cum_seqlens_k", cum_seqlens_k, kv_len, "kv_len of the packed key")
    if cum_seqlens_q.shape != cum_seqlens_k.shape:
        raise ValueError(
            f"cum_seqlens_q and cum_seqlens_k must both have num_seqs + 1 entries; got cum_seqlens_q "
            f"{describe(cum_seqlens_q)}, cum_seqlens_k {describe(cum_seqlens_k)}"
        )
    cum_seqlens_q = cum_seqlens_q.astype(jnp.int32)
    # one array for both stays one (packed self-attention: a kernel may treat the sequences as segments)
    return cum_seqlens_q, cum_seqlens_q if cum_seqlens_k is args_q else cum_seqlens_k.astype(jnp.int32)


def normalize_packed_seqlens(cu_seqlens, query, name: str = "cu_seqlens"):
    """Offsets of sequences packed along axis 1 of ``query`` (then batch is 1): int ``[N + 1]`` -> int32."""
    if cu_seqlens is None:
        return None
    check_cum_seqlens(name, cu_seqlens, query.shape[1], "seq_len of query")
    if query.shape[0] != 1:
        raise ValueError(
            f"with {name} the sequences are packed along seq_len, so batch must be 1; got query {describe(query)}"
        )
    return cu_seqlens.astype(jnp.int32)


def check_softmax_aux(softmax_aux, num_heads: int, name: str = "softmax_aux"):
    """Attention-sink logits: float ``[num_heads]`` or ``[num_heads, num_sinks]`` (one row per query head)."""
    if softmax_aux is None:
        return None
    what = "(sink logits [num_heads] or [num_heads, num_sinks])"
    check_array(name, softmax_aux, dtypes=FLOAT_DTYPES, what=what)
    if softmax_aux.ndim not in (1, 2) or softmax_aux.shape[0] != num_heads:
        raise ValueError(
            f"{name} must be [num_heads] or [num_heads, num_sinks] with num_heads = {num_heads}, "
            f"got {describe(softmax_aux)}"
        )
    return softmax_aux


def normalize_dropout(dropout_prob: Any, dropout_seed: Any) -> tuple[float, Any]:
    check_probability("dropout_prob", dropout_prob)
    dropout_prob = float(dropout_prob)
    if dropout_prob == 0.0:
        return 0.0, None
    if dropout_seed is None:
        return dropout_prob, DEFAULT_DROPOUT_SEED
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        return dropout_prob, int(dropout_seed)
    if hasattr(dropout_seed, "dtype") and jnp.issubdtype(dropout_seed.dtype, jnp.integer) and dropout_seed.ndim == 0:
        return dropout_prob, dropout_seed  # a traced seed (varies per step under jit)
    raise ValueError(f"dropout_seed must be an int or an integer scalar array, got {describe(dropout_seed)}")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


# ---- serving (page_attention, ragged_page_attention, ragged_decode_attention) --------------------------


def check_values_in(name: str, value: Any, low: int, high: int | None = None, meaning: str = "") -> None:
    """The values of an int array lie in ``[low, high]`` (``high`` None: no upper bound); checked when concrete
    (traced values are the caller's contract)."""
    values = concrete(value)
    if values is None:
        return
    bad = (values < low) | (values > high if high is not None else False)
    if np.any(bad):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}{f' ({meaning})' if meaning else ''}, got {values.tolist()}")


def check_matching_dims(name: str, x: Any, reference_name: str, reference: Any, meanings: tuple[str, ...]) -> None:
    """``x`` has ``reference``'s size on every axis (``meanings`` names the axes)."""
    for axis, meaning in enumerate(meanings):
        check_dim(name, x, axis, reference.shape[axis], f"{meaning} of {reference_name}")


def check_decode_inputs(
    query: Any, key_name: str, key: Any, value_name: str, value: Any, query_axes: str, kv_axes: tuple[str, ...],
    kv_heads_axis: int, quantized_cache: bool = False,
) -> None:
    """The arrays of a decode operation: float ``query`` ``[rows, num_heads, head_dim]`` (``query_axes``
    names them), ``key``/``value`` rank 4 with axes ``kv_axes`` (head_dim last), of one shape and query's
    dtype; ``key``'s axis ``kv_heads_axis`` holds the KV heads (GQA: they divide the query heads).
    ``quantized_cache``: ``key``/``value`` may instead share one of :data:`QUANTIZED_CACHE_DTYPES`."""
    check_array("query", query, rank=3, dtypes=FLOAT_DTYPES, what=query_axes)
    layout = f"[{', '.join(kv_axes)}]"
    cache_dtypes = FLOAT_DTYPES + QUANTIZED_CACHE_DTYPES if quantized_cache else FLOAT_DTYPES
    check_array(key_name, key, rank=4, dtypes=cache_dtypes, what=layout)
    check_array(value_name, value, rank=4, dtypes=cache_dtypes, what=layout)
    if quantized_cache and is_quantized_cache(key):
        check_same_dtype(key_name, key, **{value_name: value})
    else:
        check_same_dtype("query", query, **{key_name: key, value_name: value})
    check_dim(key_name, key, 3, query.shape[2], "head_dim of query")
    check_matching_dims(value_name, value, key_name, key, kv_axes)
    check_gqa("query", query.shape[1], key_name, key.shape[kv_heads_axis], key)


def cache_scale(name: str, scale: Any, kv_heads: int, num_pages: int | None = None, pages_name: str = "num_blocks"
                ) -> Any:
    """A KV cache's dequantization scale as float32: ``[kv_heads]`` when it does not depend on the page (given
    as a scalar or per kv head), ``[num_pages, kv_heads]`` when given per page and kv head (paged caches:
    ``num_pages`` given, named ``pages_name`` in errors); None stays None."""
    if scale is None:
        return None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = jnp.float32(scale)
    shapes = [(), (kv_heads,)] + ([(num_pages, kv_heads)] if num_pages is not None else [])
    what = (f"(), [num_kv_heads={kv_heads}] or [{pages_name}={num_pages}, num_kv_heads={kv_heads}]"
            if num_pages is not None else f"() or [num_kv_heads={kv_heads}]")
    check_array(name, scale, dtypes=FLOAT_DTYPES, what=what)
    if scale.shape not in shapes:
        raise ValueError(f"{name} must have shape {what}, got {describe(scale)}")
    values = concrete(scale)
    if values is not None and not np.all(np.isfinite(values)):
        raise ValueError(f"{name} must be finite, got {describe(scale)} with non-finite entries")
    return jnp.broadcast_to(scale.astype(jnp.float32), scale.shape if scale.ndim == 2 else (kv_heads,))


def check_page_indices(name: str, block_tables: Any, lengths: Any, page_size: int, num_pages: int) -> None:
    """The block-table entries that are read (a sequence's pages below ``ceil(length / page_size)``) are page
    indices in ``[0, num_pages)``; entries past a sequence's last page may hold anything (-1 often). Checked
    when the tables and lengths are concrete. Traced tables are not checked: an out-of-range id that is read is
    the caller's contract (the kernels clamp it into ``[0, num_pages)``, so they read some other page: a wrong
    but finite output, never memory outside the cache)."""
    tables, lens = concrete(block_tables), concrete(lengths)
    if tables is None or lens is None:
        return
    used = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // page_size)
    bad = used & ((tables < 0) | (tables >= num_pages))
    if bad.any():
        s, p = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}[{s}, {p}] = {int(tables[s, p])} is read (the sequence has {int(lens[s])} tokens) but is not a "
            f"page index in [0, {num_pages})"
        )
