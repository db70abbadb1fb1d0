"""``Kernel``: the base class of a configurable operation (``Invocation`` lives in ``invocation.py``).

A kernel implements ``run``, proposes a default config (``heuristic_cfg``) and candidates for autotuning
(``config_space``). Optional, as the spec describes them:

* ``run_<platform>(self, *args, cfg, **kwargs)``: used instead of ``run`` when the call runs on that
  platform (an explicit ``platform=`` keyword, else the device's: ``triton`` on GPU, ``pallas`` on TPU,
  ``xla`` on CPU).
* ``custom_vjp(self, primals, cfg, kwargs, cotangents) -> grads``: a custom backward. ``primals`` are
  the positional arguments, ``cotangents`` a tuple (one entry per output of a tuple output, else one);
  ``grads`` has one entry per positional argument (None: no gradient). Keyword array arguments get no
  gradient: pass differentiable inputs positionally. Without it JAX differentiates ``run``.
* ``prepare(self, *args, **kwargs) -> (args, kwargs)``: validates and normalizes a call before anything
  else (the public operations resolve ``platform="auto"`` here, so the platform enters the cache key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic

from ejkernel.ops.core.invocation import Invocation
from ejkernel.ops.core.types import Cfg, Out
from ejkernel.ops.execution.executor import get_default_executor

__all__ = ["Invocation", "Kernel"]


class Kernel(Generic[Cfg, Out]):
    """Base class of a configurable operation. Subclass it and implement ``run`` and ``heuristic_cfg``.

    Class attributes a subclass may set:

    * ``version``: part of the cache key; bump it when configs tuned for an older implementation no
      longer apply.
    * ``key_includes_sharding``: put the layout of arrays spread over several devices into the cache key
      (for kernels whose best config depends on it; tracers carry no layout and are keyed by shape).
    """

    version: ClassVar[str] = "1"
    key_includes_sharding: ClassVar[bool] = False
    prepare: ClassVar[Callable[..., tuple[tuple, dict]] | None] = None
    """Define ``prepare(self, *args, **kwargs) -> (args, kwargs)`` to validate a call first (see above)."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"Kernel name must be a non-empty string, got {name!r}")
        self.name = name

    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        """The implementation used when no ``run_<platform>`` matches."""
        raise NotImplementedError(f"kernel {self.name!r} ({type(self).__qualname__}) implements no run()")

    def heuristic_cfg(self, inv: Invocation[Cfg, Out]) -> Cfg:
        """The default config for this call, from shapes, dtypes and static arguments."""
        raise NotImplementedError(f"kernel {self.name!r} ({type(self).__qualname__}) implements no heuristic_cfg()")

    def config_space(self, inv: Invocation[Cfg, Out]) -> Iterable[Cfg]:
        """Candidate configs for autotuning this call (none by default: nothing to tune)."""
        return ()

    def __call__(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        """Run through the process-wide default executor (:func:`ejkernel.ops.get_default_executor`)."""
        return get_default_executor()(self, *args, cfg=cfg, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(name={getattr(self, 'name', None)!r}, version={self.version!r})"
