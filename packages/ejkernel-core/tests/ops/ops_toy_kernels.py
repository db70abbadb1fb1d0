"""A toy kernel family with known-different candidates, shared by the ops tests and their subprocesses.

``ToyMatmul`` computes ``(x @ w) * scale`` in row blocks; its config space holds correct candidates
(other block sizes), one that is much faster but wrong (``wrong=True``: no matmul at all), one that fails
to compile and one that fails at run time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops import Kernel


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    block: int = 8
    wrong: bool = False
    fail: str | None = None
    """``"compile"``: raises while tracing; ``"run"``: raises while executing."""


def _raise_at_runtime(x):
    raise RuntimeError("simulated RESOURCE_EXHAUSTED: out of memory")


class ToyMatmul(Kernel[ToyConfig, jax.Array]):
    def __init__(self, name: str = "toy_matmul", space: tuple[ToyConfig, ...] | None = None):
        super().__init__(name)
        self.space = space
        self.heuristic_calls = 0

    def run(self, x, w, *, cfg, scale=1.0):
        if cfg.fail == "compile":
            raise ValueError(f"block {cfg.block} does not fit")
        if cfg.wrong:
            return jnp.broadcast_to(x[:, :1], (x.shape[0], w.shape[1])) * scale
        out = jnp.concatenate([x[i : i + cfg.block] @ w for i in range(0, x.shape[0], cfg.block)])
        if cfg.fail == "run":
            out = out + jax.pure_callback(_raise_at_runtime, jax.ShapeDtypeStruct((), out.dtype), out[0, 0])
        return out * scale

    def heuristic_cfg(self, inv):
        self.heuristic_calls += 1
        return ToyConfig(block=min(8, inv.args[0].shape[0]))

    def config_space(self, inv):
        if self.space is not None:
            return self.space
        return (
            ToyConfig(block=4),
            ToyConfig(block=16),
            ToyConfig(wrong=True),
            ToyConfig(fail="compile"),
            ToyConfig(block=32, fail="run"),
        )


class SpecVjpKernel(Kernel[ToyConfig, jax.Array]):
    """``x * w`` with the spec's ``custom_vjp(primals, cfg, kwargs, cotangents)`` form.

    ``ToyConfig(wrong=True)`` has a correct forward but a wrong backward.
    """

    def __init__(self):
        super().__init__("toy_spec_vjp")
        self.backward_calls = 0

    def run(self, x, w, *, cfg, offset=0.0):
        return x * w + offset

    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        self.backward_calls += 1
        x, w = primals
        (ct,) = cotangents
        grad_x = ct * w * (2.0 if cfg.wrong else 1.0)
        return grad_x, ct * x

    def heuristic_cfg(self, inv):
        return ToyConfig(block=8)

    def config_space(self, inv):
        return (ToyConfig(block=4), ToyConfig(block=4, wrong=True))


class TupleVjpKernel(Kernel[ToyConfig, tuple]):
    """``(sin(x) * w, x + w)``: a tuple output, whose ``custom_vjp`` gets one cotangent per output."""

    def __init__(self):
        super().__init__("toy_tuple_vjp")
        self.backward_calls = 0

    def run(self, x, w, *, cfg):
        return jnp.sin(x) * w, x + w

    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        self.backward_calls += 1
        x, w = primals
        ct_a, ct_b = cotangents
        return ct_a * jnp.cos(x) * w + ct_b, ct_a * jnp.sin(x) + ct_b

    def heuristic_cfg(self, inv):
        return ToyConfig()


class PlatformKernel(Kernel[ToyConfig, jax.Array]):
    """Tells which method ran: ``run`` adds 1, ``run_xla`` adds 2, ``run_triton`` adds 3."""

    def __init__(self):
        super().__init__("toy_platform")
        self.seen_platform = []

    def run(self, x, *, cfg, platform=None):
        self.seen_platform.append(("run", platform))
        return x + 1

    def run_xla(self, x, *, cfg, platform=None):
        self.seen_platform.append(("run_xla", platform))
        return x + 2

    def run_triton(self, x, *, cfg, platform=None):
        self.seen_platform.append(("run_triton", platform))
        return x + 3

    def heuristic_cfg(self, inv):
        return ToyConfig()


def random_inputs(m=16, k=8, n=4, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((m, k)), dtype), jnp.asarray(rng.standard_normal((k, n)), dtype)
