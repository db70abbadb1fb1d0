"""``flash_attention`` entry of the Pallas backend: routes to the TPU or GPU kernel, or to interpret mode.

On a TPU the Mosaic TPU kernel compiles; on an NVIDIA GPU the Triton-lowered kernel; on CPU the kernels
run only in interpret mode (see :mod:`ejkernel_pallas.interpret`), otherwise the call is refused with
``UnsupportedFeature`` naming the fix, before anything is traced.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ejkernel.errors import UnsupportedFeature

from ejkernel_pallas.interpret import interpret_mode, need_device_message, tpu_interpret_argument


def _target() -> tuple[str, object]:
    """(kernel family, interpret argument) for this machine and the interpret setting."""
    mode = interpret_mode()
    platform = jax.default_backend().lower()
    if mode == "gpu":
        return "gpu", True
    if mode is not None:
        return "tpu", tpu_interpret_argument(mode)
    if platform == "tpu":
        return "tpu", False
    if platform in ("gpu", "cuda"):
        return "gpu", False
    raise UnsupportedFeature(need_device_message())


# Arguments that are arrays (or None); the rest of the canonical keywords are static (scalars, tuples).
_ARRAY_KWARGS = (
    "attention_mask",
    "q_segment_ids",
    "kv_segment_ids",
    "cum_seqlens_q",
    "cum_seqlens_k",
    "softmax_aux",
    "dropout_seed",
)


def _impl(family: str):
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as impl
    else:
        from ejkernel_pallas import gpu_flash_attention as impl
    return impl


@functools.lru_cache(maxsize=256)
def _compiled(family: str, interpret, cfg, static: tuple):
    """One ``jax.jit`` per static configuration: an eager call compiles the whole wrapper (padding, three
    kernels, custom VJP) once per shape instead of dispatching dozens of small ops one by one; under a
    caller's ``jit`` it is inlined."""
    return jax.jit(functools.partial(_impl(family).flash_attention, cfg=cfg, interpret=interpret, **dict(static)))


def check_supported(*args, **kwargs):
    family, _ = _target()
    kwargs.pop("cfg", None)
    _impl(family).check_supported(*args, **kwargs)


def flash_attention(query, key, value, bias=None, *, cfg=None, **kwargs):
    family, interpret = _target()
    arrays = {name: kwargs.pop(name) for name in _ARRAY_KWARGS if name in kwargs}
    seed = arrays.get("dropout_seed")
    if isinstance(seed, (int, np.integer)):
        # the mask hashes the seed's low 32 bits (ejkernel.ops.utils.dropout): an array, not a static int,
        # so a new seed per step does not recompile
        arrays["dropout_seed"] = np.uint32(int(seed) & 0xFFFFFFFF)
    static = tuple(sorted(kwargs.items()))
    try:
        fn = _compiled(family, interpret, cfg, static)
    except TypeError:  # an unhashable cfg (a duck-typed stand-in): no cached jit
        fn = functools.partial(_impl(family).flash_attention, cfg=cfg, interpret=interpret, **kwargs)
    return fn(query, key, value, bias, **arrays)


def _call_facts(inv) -> tuple[int, int, int, object, bool]:
    """(q_len, kv_len, head_dim, dtype, has_mask) of a FlashAttention invocation (validated arguments)."""
    query, key = inv.args[0], inv.args[1]
    return query.shape[1], key.shape[1], query.shape[3], query.dtype, inv.kwargs.get("attention_mask") is not None


def heuristic_cfg(inv):
    """The executor's default config for this call: TPU blocks (multiples of the (8, 128) tiles, one block
    over short lengths, capped by head dim) or the GPU tuning measured on an H200 (fwd 128x64 w4 s2, bwd
    64x64 w4 s2, shrunk to short lengths), for whichever family runs here."""
    from ejkernel.modules.operations.flash_attention import FlashAttentionConfig

    sq, skv, d, dtype, has_mask = _call_facts(inv)
    family, _ = _target()
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as tpu

        return tpu.blocks_to_config(tpu.heuristic_blocks(sq, skv, dtype, d, has_mask), FlashAttentionConfig)
    from ejkernel_pallas import gpu_flash_attention as gpu

    return gpu.tuning_to_config(gpu.choose_tuning(None, sq, skv, d))


def config_space(inv):
    """Pruned autotuning candidates (at most 8 on TPU, 5 on GPU), the heuristic first."""
    from ejkernel.modules.operations.flash_attention import FlashAttentionConfig

    sq, skv, d, dtype, has_mask = _call_facts(inv)
    family, _ = _target()
    if family == "tpu":
        from ejkernel_pallas import tpu_flash_attention as tpu

        return [tpu.blocks_to_config(b, FlashAttentionConfig) for b in tpu.config_space(sq, skv, dtype, d, has_mask)]
    from ejkernel_pallas import gpu_flash_attention as gpu

    return [gpu.tuning_to_config(t) for t in gpu.config_space(sq, skv, d)]


flash_attention.check_supported = check_supported
flash_attention.heuristic_cfg = heuristic_cfg
flash_attention.config_space = config_space
