"""HLO labels: name the kernel, platform and config inside a compiled program, and read them back.

A label is a ``jax.named_scope`` whose name has one of these forms (so it rides along as op metadata
into StableHLO locations and compiled HLO, at zero runtime cost):

* ``ejk[<name>]``: a user label (:func:`label`).
* ``ejk[<kernel>|<platform>|h:<hash>]``: an executor stamp with ``EJKERNEL_OPS_STAMP=hash``; the hash
  is of the config's stable JSON and resolves through this process's stamp table.
* ``ejk[<kernel>|<platform>|j:<base64url>]``: with ``EJKERNEL_OPS_STAMP=json``; the payload is the
  config's typed JSON and the call's cache key, readable in any process.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ejkernel.ops.utils.env import env_get
from ejkernel.ops.utils.serialize import from_jsonable, stable_json, to_jsonable

__all__ = [
    "STAMP_ENV",
    "OpLabel",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "label",
    "labels_to_configs",
    "stamp_mode",
    "stamp_name",
]

STAMP_ENV = "EJKERNEL_OPS_STAMP"
_UNSAFE = re.compile(r'[\[\]|/"\\\s]')
_LABEL = re.compile(r"ejk\[([^\[\]|/\"\\\s]+)(?:\|([^\[\]|/\"\\\s]+)\|([hj]):([A-Za-z0-9_=-]+))?\]")


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text) or "_"


def stamp_mode() -> str | None:
    """``"hash"``, ``"json"`` or None, from ``EJKERNEL_OPS_STAMP`` (``none``/unset/unknown: None)."""
    value = env_get(STAMP_ENV)
    if not value:
        return None
    value = value.strip().lower()
    return value if value in ("hash", "json") else None


@dataclasses.dataclass(frozen=True)
class StampRecord:
    """What a hash stamp stands for (kept in this process)."""

    kernel: str
    platform: str
    cfg: Any
    cache_key: str | None
    invocation: Any = dataclasses.field(default=None, compare=False)


_stamps: dict[str, StampRecord] = {}
_stamps_lock = threading.Lock()


def config_hash(cfg: Any) -> str:
    """12 hex digits identifying a config by its stable JSON (its repr if it has no JSON form)."""
    try:
        text = stable_json(cfg)
    except TypeError:  # a stamp must never break the call it stamps
        text = repr(cfg)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _config_payload(cfg: Any) -> Any:
    try:
        return to_jsonable(cfg)
    except TypeError:
        return {"__repr__": repr(cfg)}


def stamp_name(
    kernel: str, platform: str, cfg: Any, mode: str, *, cache_key: str | None = None, invocation=None
) -> str:
    """The scope name stamping one kernel call (see the module docstring)."""
    if mode == "json":
        payload = json.dumps({"cfg": _config_payload(cfg), "key": cache_key}, sort_keys=True, separators=(",", ":"))
        encoded = base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")
        return f"ejk[{_safe(kernel)}|{_safe(platform)}|j:{encoded}]"
    digest = config_hash(cfg)
    with _stamps_lock:
        if digest not in _stamps or _stamps[digest].cache_key != cache_key:
            _stamps[digest] = StampRecord(kernel, platform, cfg, cache_key, invocation)
    return f"ejk[{_safe(kernel)}|{_safe(platform)}|h:{digest}]"


def label(name: str) -> Callable[[Callable], Callable]:
    """Decorator: ops traced inside the function carry the label ``ejk[<name>]`` in the HLO."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"label name must be a non-empty string, got {name!r}")
    scope = f"ejk[{_safe(name)}]"

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            import jax

            with jax.named_scope(scope):
                return fn(*args, **kwargs)

        return labelled

    return decorate


@dataclasses.dataclass(frozen=True)
class OpLabel:
    """A label found in program text."""

    name: str
    """The user label, or the kernel name of a stamp."""
    platform: str | None = None
    mode: str | None = None
    """``"hash"``, ``"json"`` or None (a user label)."""
    payload: str | None = None
    raw: str = ""

    @property
    def is_stamp(self) -> bool:
        return self.mode is not None

    def _decoded(self) -> dict | None:
        if self.mode != "json" or self.payload is None:
            return None
        padded = self.payload + "=" * (-len(self.payload) % 4)
        return json.loads(base64.urlsafe_b64decode(padded.encode()))

    @property
    def config(self) -> Any:
        """The config this stamp names (None for user labels and hashes unknown to this process)."""
        if self.mode == "json":
            payload = self._decoded()["cfg"]
            return None if isinstance(payload, dict) and "__repr__" in payload else from_jsonable(payload)
        if self.mode == "hash":
            record = _stamps.get(self.payload or "")
            return None if record is None else record.cfg
        return None

    @property
    def cache_key(self) -> str | None:
        if self.mode == "json":
            return self._decoded().get("key")
        record = _stamps.get(self.payload or "") if self.mode == "hash" else None
        return None if record is None else record.cache_key

    @property
    def invocation(self) -> Any:
        """The (abstract) invocation behind a hash stamp made in this process, else None."""
        record = _stamps.get(self.payload or "") if self.mode == "hash" else None
        return None if record is None else record.invocation


def extract_labels_from_hlo_text(text: str) -> list[OpLabel]:
    """Every distinct label in HLO / StableHLO text, in order of first appearance."""
    if not isinstance(text, str):
        raise TypeError(f"extract_labels_from_hlo_text expects str, got {type(text).__name__}")
    found: dict[str, OpLabel] = {}
    for match in _LABEL.finditer(text):
        raw = match.group(0)
        if raw in found:
            continue
        name, platform, mode, payload = match.groups()
        found[raw] = OpLabel(
            name=name,
            platform=platform,
            mode={"h": "hash", "j": "json"}.get(mode) if mode else None,
            payload=payload,
            raw=raw,
        )
    return list(found.values())


def find_labels_in_lowered(lowered: Any) -> list[OpLabel]:
    """Labels in a ``jax.jit(f).lower(...)`` result, a compiled program, or program text."""
    if isinstance(lowered, str):
        return extract_labels_from_hlo_text(lowered)
    as_text = getattr(lowered, "as_text", None)
    if as_text is None:
        raise TypeError(f"find_labels_in_lowered expects a Lowered, a Compiled or text, got {type(lowered).__name__}")
    try:
        text = as_text(debug_info=True)  # Lowered: scope names live in the (debug) locations
    except TypeError:
        text = as_text()  # Compiled: scope names live in op metadata
    return extract_labels_from_hlo_text(text)


def labels_to_configs(labels: Iterable[OpLabel | str]) -> dict[str, Any]:
    """``{raw label: config}`` for every stamp whose config can be recovered (user labels are skipped)."""
    configs: dict[str, Any] = {}
    for item in labels:
        parsed = extract_labels_from_hlo_text(item) if isinstance(item, str) else [item]
        for op_label in parsed:
            if not isinstance(op_label, OpLabel):
                raise TypeError(f"labels_to_configs expects OpLabel or str items, got {type(op_label).__name__}")
            cfg = op_label.config if op_label.is_stamp else None
            if cfg is not None:
                configs[op_label.raw] = cfg
    return configs
