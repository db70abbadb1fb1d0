"""The custom VJP and vmap rules around the block-sparse kernels (flash attention's plumbing, reused).

:func:`attention` is differentiable in q, k, v and the sinks (``aux``); the schedules (int arrays from
:func:`kernels.kernel_schedule`) get no gradient. Under ``jax.vmap`` the vmapped axis folds into the
batch axis (one launch; the kernels read the schedule of batch ``b % mask_batch``), unless a schedule or
the sinks are batched, when the rule loops (`flash_attention.vjp.fold_batch_rule`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from ejkernel_triton.blocksparse_attention.kernels import run_backward, run_forward
from ejkernel_triton.flash_attention.common import StaticParams
from ejkernel_triton.flash_attention.vjp import fold_batch_rule, sink_gradient


@dataclasses.dataclass(frozen=True)
class BlockSparseStatic:
    """Everything static about one call (hashable): flash attention's parameters and the mask's blocks."""

    flash: StaticParams
    q_block_size: int
    kv_block_size: int
    tma_forward: bool = False  # the forward runs `kernels._fwd_tma_kernel`
    persistent_forward: int = 0  # > 0: the forward's persistent form, with that many programs per SM


@functools.lru_cache(maxsize=None)
def _batched_calls(st: BlockSparseStatic):
    blocks = (st.q_block_size, st.kv_block_size)

    @jax.custom_batching.custom_vmap
    def fwd(q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count):
        return tuple(run_forward(q, k, v, q_seg, kv_seg, aux, (q_idx, q_full, q_count), st.flash, *blocks,
                                 tma=st.tma_forward, persistent=st.persistent_forward))

    fwd.def_vmap(fold_batch_rule(fwd, 5, 2, varlen_args=0))

    @jax.custom_batching.custom_vmap
    def bwd(q, k, v, do, lse, out, q_seg, kv_seg, q_idx, q_full, q_count, kv_idx, kv_full, kv_count):
        return tuple(run_backward(q, k, v, do, lse, out, q_seg, kv_seg, (q_idx, q_full, q_count),
                                  (kv_idx, kv_full, kv_count), st.flash, *blocks))

    bwd.def_vmap(fold_batch_rule(bwd, 8, 4, varlen_args=0))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def attention(q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count, kv_idx, kv_full, kv_count,
              st: BlockSparseStatic):
    """Output [B, Sq, H, Dv]; `aux` [H, num_sinks] float32 or None; the schedules of `kernel_schedule`."""
    return _attention_fwd(q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count, kv_idx, kv_full, kv_count, st)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count, kv_idx, kv_full, kv_count,
                   st: BlockSparseStatic):
    fwd, _ = _batched_calls(st)
    out, lse = fwd(q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count)
    return out, (q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count, kv_idx, kv_full, kv_count, out, lse)


def _attention_bwd(st: BlockSparseStatic, res, d_out):
    q, k, v, q_seg, kv_seg, aux, q_idx, q_full, q_count, kv_idx, kv_full, kv_count, out, lse = res
    _, bwd = _batched_calls(st)
    dq, dk, dv, delta = bwd(q, k, v, d_out.astype(q.dtype), lse, out, q_seg, kv_seg, q_idx, q_full, q_count,
                            kv_idx, kv_full, kv_count)
    d_aux = sink_gradient(aux, lse, delta) if aux is not None else None
    return dq, dk, dv, None, None, d_aux, None, None, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
