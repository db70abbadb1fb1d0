"""The vmap rule shared by the Triton operations whose kernel calls take batch-first arrays (jax-triton's
primitive has no batching rule): flash attention, block-sparse attention, linear attention, mean pooling."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["fold_batch_rule"]


def fold_batch_rule(call, batch_like: int, num_out: int, foldable: bool = True, varlen_args: int = 2):
    """vmap rule: fold the vmapped axis into the batch axis of the first `batch_like` arguments.

    The remaining arguments (cum_seqlens, sinks, seed; block-sparse schedules) must be unbatched for that;
    otherwise, for varlen (the `varlen_args` arguments after the batch-like ones, cum_seqlens, given: one
    packed sequence per call) and with dropout (its mask hashes the batch index), the rule loops over the
    vmapped axis with `lax.map`.
    """

    def rule(axis_size, in_batched, *args):
        shared_batched = any(bool(x) for x in jax.tree.leaves(in_batched[batch_like:]))
        varlen = any(a is not None for a in args[batch_like:batch_like + varlen_args])
        if shared_batched or varlen or not foldable:
            bcast = [jax.tree.map(lambda a, bt: a if bt else jnp.broadcast_to(a, (axis_size, *a.shape)), x, bx)
                     if x is not None else None for x, bx in zip(args, in_batched)]
            outs = jax.lax.map(lambda xs: call(*xs), bcast)
            return outs, (True,) * num_out
        folded = []
        for x, bx in zip(args[:batch_like], in_batched[:batch_like]):
            if x is None:
                folded.append(None)
                continue
            if not bx:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        outs = call(*folded, *args[batch_like:])
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, (True,) * num_out

    return rule
