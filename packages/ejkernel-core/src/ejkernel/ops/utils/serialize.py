"""Typed JSON for configs: a lossless round trip of (nested) frozen dataclasses, enums and tuples.

Encoding keeps JSON readable: a dataclass becomes an object with its fields plus ``"__type__":
"module:QualName"``; an enum becomes ``{"__enum__": "module:QualName", "value": ...}``; a tuple becomes
``{"__tuple__": [...]}``; a mapping whose keys are not plain strings becomes ``{"__items__": [[k, v],
...]}``. :func:`stable_json` is the same encoding with sorted keys and no whitespace: equal values give
byte-identical text in every process, which is what cache keys are built from.

Decoding resolves ``"module:QualName"`` only for modules already imported or belonging to ejkernel
(``ejkernel*`` packages), so a cache file from elsewhere cannot make us import arbitrary code.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import sys
import typing
from typing import Any

__all__ = ["from_json", "from_jsonable", "stable_json", "to_json", "to_jsonable", "type_name"]

_TYPE = "__type__"
_ENUM = "__enum__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_DTYPE = "__dtype__"


def type_name(cls: type) -> str:
    """``"module:QualName"`` of a class (the form stored in ``__type__``)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (dicts, lists, str, numbers, bool, None) with type markers."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):  # before int/str: IntEnum and StrEnum are ints/strs too
        return {_ENUM: type_name(type(value)), "value": to_jsonable(value.value)}
    if isinstance(value, (int, float)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        encoded: dict[str, Any] = {_TYPE: type_name(type(value))}
        for field in dataclasses.fields(value):
            if field.init:
                encoded[field.name] = to_jsonable(getattr(value, field.name))
        return encoded
    if isinstance(value, tuple):
        return {_TUPLE: [to_jsonable(item) for item in value]}
    if isinstance(value, list):
        return [to_jsonable(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: to_jsonable(item) for key, item in value.items()}
        return {_ITEMS: [[to_jsonable(key), to_jsonable(item)] for key, item in value.items()]}
    item = getattr(value, "item", None)  # numpy / jax scalars
    if item is not None and getattr(value, "shape", None) == ():
        return to_jsonable(item())
    if _is_dtype(value):
        return {_DTYPE: str(value)}
    raise TypeError(
        f"cannot serialize {type(value).__module__}.{type(value).__qualname__} to JSON; configs may hold "
        "dataclasses, enums, tuples, lists, dicts, str, int, float, bool and None"
    )


def _is_dtype(value: Any) -> bool:
    import numpy as np

    if isinstance(value, np.dtype):
        return True
    return isinstance(value, type) and issubclass(value, np.generic)


def to_json(value: Any, *, indent: int | None = None) -> str:
    """Serialize a config (or any value :func:`to_jsonable` accepts) to typed JSON text."""
    return json.dumps(to_jsonable(value), indent=indent)


def stable_json(value: Any) -> str:
    """Deterministic compact JSON (sorted keys, no whitespace): equal values give identical text."""
    return json.dumps(to_jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _resolve(name: str) -> Any:
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"malformed type name {name!r}; expected 'module:QualName'")
    module = sys.modules.get(module_name)
    if module is None:
        if not module_name.split(".")[0].startswith("ejkernel"):
            raise ValueError(
                f"type {name!r} lives in module {module_name!r}, which is not imported; import it before "
                "decoding (only ejkernel modules are imported on demand)"
            )
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"type {name!r} not found: {module_name!r} has no {qualname!r}") from None
    return obj


def from_jsonable(data: Any, cls: Any = None) -> Any:
    """Inverse of :func:`to_jsonable`. ``cls`` (a dataclass, enum or annotation) guides untyped data."""
    if isinstance(data, list):
        item_type = _item_annotation(cls)
        return [from_jsonable(item, item_type) for item in data]
    if not isinstance(data, dict):
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and not isinstance(data, cls):
            return cls(data)
        return data
    if _ENUM in data:
        enum_type = _resolve(data[_ENUM])
        if not (isinstance(enum_type, type) and issubclass(enum_type, enum.Enum)):
            raise ValueError(f"{data[_ENUM]!r} is not an Enum")
        return enum_type(from_jsonable(data.get("value")))
    if _TUPLE in data:
        return tuple(from_jsonable(item) for item in data[_TUPLE])
    if _ITEMS in data:
        return {from_jsonable(key): from_jsonable(item) for key, item in data[_ITEMS]}
    if _DTYPE in data:
        import numpy as np

        return np.dtype(data[_DTYPE])
    target = _dataclass_target(data, cls)
    if target is None:
        return {key: from_jsonable(item) for key, item in data.items()}
    hints = _type_hints(target)
    init_fields = {field.name for field in dataclasses.fields(target) if field.init}
    unknown = sorted(set(data) - init_fields - {_TYPE})
    if unknown:
        raise ValueError(f"{target.__qualname__} has no field(s) {', '.join(map(repr, unknown))}")
    values = {key: from_jsonable(item, hints.get(key)) for key, item in data.items() if key != _TYPE}
    return target(**values)


def _dataclass_target(data: dict, cls: Any) -> type | None:
    expected = _dataclass_in(cls)
    if _TYPE not in data:
        return expected
    name = data[_TYPE]
    if expected is not None and name.partition(":")[2] == expected.__qualname__:
        return expected  # trust the caller's class (the module may have moved)
    resolved = _resolve(name)
    if not (isinstance(resolved, type) and dataclasses.is_dataclass(resolved)):
        raise ValueError(f"{name!r} is not a dataclass")
    if expected is not None and not issubclass(resolved, expected):
        raise ValueError(f"JSON holds a {name!r}, expected {type_name(expected)!r}")
    return resolved


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass named by ``annotation`` (also inside ``X | None``), else None."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    candidates = [a for a in typing.get_args(annotation) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return candidates[0] if len(candidates) == 1 else None


def _item_annotation(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    return args[0] if len(args) == 1 else None


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: fall back to the typed markers alone
        return {}


def from_json(text: str | bytes, cls: Any = None) -> Any:
    """Decode typed JSON from :func:`to_json`; ``cls`` is the expected type (also for plain JSON)."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"from_json expects JSON text (str or bytes), got {type(text).__name__}")
    value = from_jsonable(json.loads(text), cls)
    if isinstance(cls, type) and not isinstance(value, cls):
        raise ValueError(f"JSON decodes to {type(value).__qualname__}, expected {cls.__qualname__}")
    return value
