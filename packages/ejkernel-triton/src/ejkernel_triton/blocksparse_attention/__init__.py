"""Block-sparse attention (forward and backward) as Triton kernels: the semantics of
``ejkernel.modules.operations.blocksparse_attention``, skipping disabled blocks entirely.

Kernels walk the shared block schedule (``ejkernel.ops.utils.block_sparse``), so their time is
proportional to the kept blocks; a fully masked block is never loaded, a partial one is masked in-kernel
(causal, sliding window, segment ids, ragged tails). Also: logits soft cap, sinks (with gradient), GQA/MQA
without repeated kv, any lengths, bf16/fp16/fp32 (IEEE float32 dots). Refused with
:class:`ejkernel.UnsupportedFeature` (the dispatcher falls back): head dims other than 64 and 128, and mask
blocks that no kernel tile (a power of two >= 16) divides.

Modules: ``kernels`` (schedule order, the forward, dK/dV and dQ kernels and their launches), ``vjp``
(custom VJP and vmap rules). Tile steps, online softmax, tuning tables and launching are flash
attention's (``ejkernel_triton.flash_attention``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.blocksparse_attention import BlockSparseAttentionCall
from ejkernel_triton.flash_attention import tuning
from ejkernel_triton.flash_attention.common import StaticParams
from ejkernel_triton.flash_attention.tuning import TritonFlashConfig
from ejkernel_triton.interpret import interpreting
from ejkernel_triton import launch
from ejkernel_triton.launch import gpu_device_kind

__all__ = [
    "IMPLEMENTATION", "TMA_FORWARD", "TritonBlockSparseAttention", "TritonBlockSparseConfig",
    "tma_forward_applies",
]

HEAD_DIMS = (64, 128)
MIN_TILE = 16  # tl.dot's smallest tile
Q_SIDE = ("fwd_block_q", "dkv_block_q", "dq_block_q")
KV_SIDE = ("fwd_block_kv", "dkv_block_kv", "dq_block_kv")


@dataclasses.dataclass(frozen=True)
class TritonBlockSparseConfig(TritonFlashConfig):
    """Flash attention's blocks and launch parameters (:class:`TritonFlashConfig`), for the block-sparse
    kernels: every ``*_block_q`` must divide the mask's ``q_block_size``, every ``*_block_kv`` its
    ``kv_block_size`` (a mask block is then a whole number of kernel tiles).

    ``tma_forward``: run the Hopper TMA + warp-specialized forward (`kernels._fwd_tma_kernel`) where it applies
    (:func:`tma_forward_applies`; elsewhere the pointer kernel runs). Its GPU tests hung on the H200 on
    2026-11-23 on masks with rows that visit no block (a warp-specialized loop of zero trips): the loop now
    always runs at least one (discarded) visit (`kernels._tma_visits`)."""

    tma_forward: bool = False
    persistent_forward: int = 0
    """Programs per SM of the forward's persistent variant (`kernels._fwd_persistent_kernel`, or
    `kernels._fwd_tma_persistent_kernel` where the TMA forward runs: each program loops over (batch, head,
    query tile) items, longest schedule rows first); 0: one program per query tile. Opt-in: no faster than the
    one-item TMA forward on the H100 (0.550 vs 0.545 ms, 2026-11-24); GPU-tested (alone: 34 s, compile included)."""

    def __post_init__(self):
        if not isinstance(self.tma_forward, bool):
            raise ValueError(f"TritonBlockSparseConfig.tma_forward must be a bool, got {self.tma_forward!r}")
        if isinstance(self.persistent_forward, bool) or not isinstance(self.persistent_forward, int) or \
                self.persistent_forward < 0:
            raise ValueError("TritonBlockSparseConfig.persistent_forward must be an int >= 0, got "
                             f"{self.persistent_forward!r}")
        TritonFlashConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TritonFlashConfig)})


def tma_forward_applies(call: BlockSparseAttentionCall, config: TritonBlockSparseConfig) -> bool:
    """Whether `config` asks for the TMA forward and the call admits it: every visited block full (no causal,
    window or segment ids; lengths multiples of the mask blocks), bf16/fp16, q/v head dim 128, a Hopper (or
    newer) target, and forward launch parameters the warp specialization takes (4 warps, <= 2 stages, as
    flash attention's TMA kernel)."""
    q_len, kv_len = call.query.shape[1], call.key.shape[1]
    return (config.tma_forward and not call.causal and call.sliding_window is None and call.q_segment_ids is None
            and q_len % call.q_block_size == 0 and kv_len % call.kv_block_size == 0
            and jnp.dtype(call.query.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and call.query.shape[-1] == call.value.shape[-1] == 128
            and config.fwd_num_warps == 4 and config.fwd_num_stages <= 2
            and launch.target_compute_capability() >= 90 and launch.available())


TMA_FORWARD = dict(fwd_block_q=128, fwd_block_kv=128, fwd_num_warps=4, fwd_num_stages=2, tma_forward=True)
"""The heuristic's forward where the TMA forward applies (one program per query tile). H100, 2026-11-24,
S=16k, 10 % (benchmarks/blocksparse.py --final --calls 10): 0.545 ms, against 0.550 for its persistent form,
0.681 for the pointer forward (128 x 64, 8 warps, 3 stages) and 3.940 for the dense TMA flash forward."""


def largest_tile(block_size: int) -> int:
    """The largest power of two dividing `block_size` (the largest kernel tile that fits a mask block)."""
    return block_size & -block_size


def fit_blocks(config: TritonFlashConfig, call: BlockSparseAttentionCall) -> TritonBlockSparseConfig:
    """`config` with each block shrunk to divide its side of the mask's blocks."""
    q_limit, kv_limit = largest_tile(call.q_block_size), largest_tile(call.kv_block_size)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(TritonFlashConfig)}
    fields.update({name: min(fields[name], q_limit) for name in Q_SIDE})
    fields.update({name: min(fields[name], kv_limit) for name in KV_SIDE})
    return TritonBlockSparseConfig(**fields)


class TritonBlockSparseAttention(Implementation[BlockSparseAttentionCall, TritonBlockSparseConfig]):
    """Triton kernels through jax-triton (see the module docstring).

    Precision: every ``call.precision`` is honoured (float32 inputs run IEEE float32 dots, never TF32;
    bf16/fp16 products are exact with float32 accumulation), as in flash attention.
    """

    config_type = TritonBlockSparseConfig

    def supports(self, call: BlockSparseAttentionCall) -> None:
        d, dv = call.query.shape[-1], call.value.shape[-1]
        if d not in HEAD_DIMS or dv not in HEAD_DIMS:
            raise UnsupportedFeature(f"triton blocksparse_attention: head dims {d}/{dv} (the kernels take "
                                     f"{' and '.join(map(str, HEAD_DIMS))})")
        for name in ("q_block_size", "kv_block_size"):
            size = getattr(call, name)
            if largest_tile(size) < MIN_TILE:
                raise UnsupportedFeature(f"triton blocksparse_attention: {name}={size} is not a multiple of "
                                         f"{MIN_TILE} (kernel tiles, powers of two >= {MIN_TILE}, must divide it)")

    def heuristic_config(self, call: BlockSparseAttentionCall) -> TritonBlockSparseConfig:
        """Flash attention's tuned blocks, fitted to the mask blocks; where it applies
        (:func:`tma_forward_applies`), the TMA forward (``TMA_FORWARD``)."""
        base = tuning.heuristic_config(call.query.shape[-1], call.value.shape[-1], call.query.dtype,
                                       device_kind=gpu_device_kind(), causal=call.causal)
        tma = dataclasses.replace(fit_blocks(dataclasses.replace(base, **{
            name: value for name, value in TMA_FORWARD.items() if name != "tma_forward"}), call), tma_forward=True)
        return tma if tma_forward_applies(call, tma) else fit_blocks(base, call)

    def candidate_configs(self, call: BlockSparseAttentionCall) -> Sequence[TritonBlockSparseConfig]:
        if tuning.shipped_entries(gpu_device_kind()):
            return ()  # tuned for this device kind: the heuristic reads flash attention's table
        configs = []
        for config in tuning.config_space(call.query.shape[-1], call.value.shape[-1], call.query.dtype):
            fitted = fit_blocks(config, call)
            if fitted not in configs:
                configs.append(fitted)
        return configs

    def __call__(self, call: BlockSparseAttentionCall, config: TritonBlockSparseConfig) -> jax.Array:
        from ejkernel_triton.blocksparse_attention.kernels import kernel_schedule
        from ejkernel_triton.blocksparse_attention.vjp import BlockSparseStatic, attention

        for names, size in ((Q_SIDE, call.q_block_size), (KV_SIDE, call.kv_block_size)):
            for name in names:
                if size % getattr(config, name):
                    raise ValueError(f"TritonBlockSparseConfig.{name}={getattr(config, name)} must divide the "
                                     f"mask's block size {size}")
        num_heads = call.query.shape[2]
        aux = None
        if call.softmax_aux is not None:  # the kernels read [H, num_sinks] float32
            aux = call.softmax_aux.astype(jnp.float32).reshape(num_heads, -1)
        left, right = call.sliding_window if call.sliding_window is not None else (-1, -1)
        flash = StaticParams(softmax_scale=call.softmax_scale, causal=call.causal, window_left=left,
                             window_right=right, softcap=call.logits_soft_cap or 0.0, config=config,
                             interpret=interpreting())
        st = BlockSparseStatic(flash=flash, q_block_size=call.q_block_size, kv_block_size=call.kv_block_size,
                               tma_forward=tma_forward_applies(call, config),
                               persistent_forward=config.persistent_forward)
        return attention(call.query, call.key, call.value, call.q_segment_ids, call.kv_segment_ids, aux,
                         *kernel_schedule(call, "q"), *kernel_schedule(call, "kv"), st)


IMPLEMENTATION = TritonBlockSparseAttention()
