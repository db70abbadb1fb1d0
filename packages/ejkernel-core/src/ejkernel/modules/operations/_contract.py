"""The contract between an operation (core) and its implementations (backends).

Core owns each operation's keywords: its public function is the only place they appear, and its
``validate`` turns them into one frozen **canonical call** (a :func:`canonical_call` dataclass: arrays
plus normalized static values, every default resolved). Backends receive that object and nothing else;
they never re-validate or re-default.

A backend implements an operation by subclassing :class:`Implementation`:

    @dataclasses.dataclass(frozen=True)
    class MyFlashConfig:                      # the backend's own typed config, stored as-is by the executor
        block_q: int = 128
        block_kv: int = 64

    class MyFlashAttention(Implementation[FlashAttentionCall, MyFlashConfig]):
        config_type = MyFlashConfig

        def supports(self, call):             # raise UnsupportedFeature for calls it does not take
            if call.bias is not None:
                raise UnsupportedFeature("bias is not implemented")

        def heuristic_config(self, call):     # the config used when nothing better is known
            return MyFlashConfig()

        def candidate_configs(self, call):    # what autotuning may try (empty: nothing to tune)
            return [MyFlashConfig(q, kv) for q in (64, 128) for kv in (32, 64)]

        def __call__(self, call, config):     # trace/compute the result
            ...

    IMPLEMENTATION = MyFlashAttention()       # registered by import path: "my_pkg.flash:IMPLEMENTATION"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

CallT = TypeVar("CallT")
ConfigT = TypeVar("ConfigT")

__all__ = ["Implementation", "NoConfig", "array_field", "canonical_call", "is_canonical_call"]

_CALL_MARKER = "__ejkernel_call__"


def array_field(default: Any = None) -> Any:
    """A field of a canonical call that holds an array (or None): traced, differentiated, keyed by shape."""
    return dataclasses.field(default=default, metadata={"array": True})


def canonical_call(cls: type) -> type:
    """Make ``cls`` a frozen canonical-call dataclass and a JAX pytree.

    Fields declared with :func:`array_field` are the pytree's children (arrays, tracers or None); every
    other field is static (hashable, part of the tree structure and of the executor's cache key).
    """
    import jax

    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(cls)
    arrays = [f.name for f in fields if f.metadata.get("array")]
    static = [f.name for f in fields if not f.metadata.get("array")]
    jax.tree_util.register_dataclass(cls, data_fields=arrays, meta_fields=static)
    setattr(cls, _CALL_MARKER, True)
    cls.array_fields = tuple(arrays)
    cls.static_fields = tuple(static)
    return cls


def is_canonical_call(value: Any) -> bool:
    return getattr(type(value), _CALL_MARKER, False)


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """The config of an implementation with nothing to tune."""


class Implementation(Generic[CallT, ConfigT]):
    """One backend's implementation of one operation (see the module docstring)."""

    config_type: ClassVar[type] = NoConfig
    """Frozen dataclass of this implementation's configs; instances are stored by the executor as-is."""

    def supports(self, call: CallT) -> None:
        """Raise :class:`ejkernel.UnsupportedFeature` (naming the feature) for a call this cannot take.

        Called at dispatch, before anything compiles: look at shapes, dtypes and static fields only.
        """

    def priority_for(self, call: CallT) -> int | None:
        """This implementation's rank for ``call`` under ``platform="auto"`` where it differs from its
        registered priority (None: the registered one): a kernel measured faster on some calls only (say, a
        Hopper path beside a slower general one) ranks above another backend's for those calls alone."""
        return None

    def heuristic_config(self, call: CallT) -> ConfigT:
        """The config for ``call`` when no cached or tuned one is known."""
        return self.config_type()

    def candidate_configs(self, call: CallT) -> Sequence[ConfigT]:
        """Configs autotuning may time for ``call`` (empty: nothing to tune)."""
        return ()

    def __call__(self, call: CallT, config: ConfigT) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} does not implement __call__(call, config)")

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__}>"
