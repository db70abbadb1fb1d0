"""Ring attention with the TPU block kernels, interpret mode: the shared suite (a 4-device CPU mesh in a
subprocess, 8 with EJKERNEL_PALLAS_CONFORMANCE=1; one device in process)."""

from __future__ import annotations

import jax
import jax.extend
import pytest
from pallas_test_helpers import InterpretedConformance, full_conformance, jaxprs

from ejkernel.modules import ring_attention
from ejkernel.testing.numerics import matmul_precisions
from ejkernel.testing.ring_attention import RingAttentionConformance, case_inputs


class TestPallasRingAttentionConformance(InterpretedConformance, RingAttentionConformance):
    # Under shard_map only the TPU-faithful interpreter runs (NOTES.md), at a cost growing with devices x
    # ring steps: 8 devices take ~150 s on 2 cores, 4 devices (3 hops, all cases) a quarter of the run time.
    devices = 8 if full_conformance() else 4
    refused_cases = 1  # the zig-zag layout: the TPU block kernels take contiguous shards (platform="xla" does)


@pytest.mark.parametrize("precision, expected", [(None, jax.lax.Precision.HIGHEST), ("high", jax.lax.Precision.HIGH)])
def test_float32_dots_take_the_calls_precision(pallas_interpret, precision, expected):
    """Mosaic's default dot is bf16 passes: a float32 call's precision reaches every dot, in the block
    kernels (forward, dK/dV, dQ) and in the merges outside them (delta, sink gradient)."""
    arrays, options = case_inputs("full_softcap_sinks", devices=1)

    def loss(query):
        return ring_attention(**{**arrays, "query": query}, **options, precision=precision, platform="pallas").sum()

    found = matmul_precisions(jax.grad(loss), arrays["query"])
    assert found and set(found) == {expected}, found


_COLLECTIVES = {"ppermute", "psum", "psum_invariant", "all_gather", "all_to_all", "reduce_scatter", "pmax", "pmin"}


def _collectives_out_of_turn(jaxpr) -> list[str]:
    """Collectives among ``jaxpr``'s own equations whose operands do not come from an ordered host callback
    (through varying-axis casts) or whose results do not go into one."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    consumers: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jax.extend.core.Literal):
                consumers.setdefault(v, []).append(e)

    def ordered_callback(e) -> bool:
        return e is not None and e.primitive.name == "io_callback" and bool(e.params.get("ordered"))

    def source(v):
        e = producers.get(v)
        while e is not None and e.primitive.name in ("pvary", "pcast"):
            e = producers.get(e.invars[0])
        return e

    found = []
    for e in jaxpr.eqns:
        if e.primitive.name in _COLLECTIVES:
            fed = all(isinstance(v, jax.extend.core.Literal) or ordered_callback(source(v)) for v in e.invars)
            read = all(any(map(ordered_callback, consumers.get(v, []))) for v in e.outvars)
            if not (fed and read):
                found.append(f"{e.primitive.name} (operands from an ordered callback: {fed}, results into one: {read})")
    return found


def test_interpreted_ring_runs_its_collectives_between_kernels(pallas_interpret):
    """The TPU interpreter's kernels wait for the other devices' at barriers, ordered after the previous
    kernel but not after their data: every ppermute and psum of an interpreted ring passes through ordered
    callbacks, or a device could start a kernel beside its ppermute and hang the ring (ring_attention.py's
    ``_in_turn``). Traced on an abstract 4-device mesh, forward and every gradient."""
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    arrays, options = case_inputs("full_softcap_sinks", devices=4)
    names = ("query", "key", "value", "softmax_aux")
    mesh = AbstractMesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    sequence = P(None, "sp")

    def local(*values):
        return ring_attention(**dict(zip(names, values)), **options, axis_name="sp", platform="pallas")

    ring = jax.shard_map(local, mesh=mesh, in_specs=(sequence,) * 3 + (P(),), out_specs=sequence)
    loss = lambda *values: ring(*values).sum()  # noqa: E731
    scopes = jaxprs(jax.grad(loss, argnums=(0, 1, 2, 3)), *(arrays[n] for n in names))
    primitives = {e.primitive.name for jaxpr in scopes for e in jaxpr.eqns}
    assert {"ppermute", "psum_invariant", "pallas_call"} <= primitives, "the traced ring has no collectives to check"
    assert [found for jaxpr in scopes for found in _collectives_out_of_turn(jaxpr)] == []
