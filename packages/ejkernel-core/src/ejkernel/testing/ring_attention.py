"""Conformance suite of ``ring_attention`` (``docs/ops/ring_attention.md``).

Its reference is single-device ``ejkernel.modules.flash_attention`` on the global arrays (itself checked
against a float64 dense reference by its own suite): on a CPU mesh of ``devices`` (default 8) the ring
result and every gradient must match it. jax fixes its device count when it initializes, so the
multi-device cases run in a fresh interpreter (``python -m ejkernel.testing.ring_attention --platform NAME
--devices N``) started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``; the in-process tests
cover the one-device case and the argument checks (including segment ids given on one side only).

A backend's test module subclasses :class:`RingAttentionConformance` and sets ``platform``::

    class TestXlaRingAttention(RingAttentionConformance):
        platform = "xla"

On a host with several GPUs, :class:`DeviceRingConformance` runs the same cases (and GPU-sized ones) over
every real device in the test's own process; :func:`merged_blocks` and :func:`check_one_device_ring` check
a backend's ring blocks and its one-device ring.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing.numerics import Tolerance, assert_close, normal_array

DEVICES = 8
AXIS = "sp"
DATA_AXIS = "dp"

# name -> (batch, local q_len, local kv_len, heads, kv_heads, head_dim, dtype, options)
CASES: dict[str, tuple] = {
    "causal_gqa_sinks_bf16": (1, 4, 4, 4, 2, 16, "bfloat16", dict(causal=True, softmax_aux=True)),
    "full_softcap_sinks": (2, 3, 3, 2, 2, 8, "float32", dict(softmax_aux=True, logits_soft_cap=5.0)),
    "window_segments_q_ne_kv": (1, 3, 4, 2, 1, 8, "float32", dict(causal=True, sliding_window=(6, 0), segments=True)),
    "zigzag_causal_gqa_segments": (
        1, 4, 4, 4, 2, 8, "float32", dict(causal=True, segments=True, sequence_layout="zigzag")),
    "causal_gqa_softcap": (2, 4, 4, 4, 1, 8, "float32", dict(causal=True, logits_soft_cap=4.0)),
    "full_gqa_segments_bf16": (1, 4, 4, 4, 2, 16, "bfloat16", dict(segments=True)),
}


# Cases of GPU size for rings of real devices (:class:`DeviceRingConformance`): kernels such as cuDNN's take
# only bfloat16/float16 with head dims of 64 and more, and blocks of 128 tokens want longer shards.
DEVICE_CASES: dict[str, tuple] = {
    "device_full_gqa_bf16": (2, 384, 384, 8, 2, 128, "bfloat16", dict()),
    "device_causal_bf16": (1, 512, 512, 4, 4, 64, "bfloat16", dict(causal=True)),
    "device_zigzag_causal_gqa_bf16": (1, 512, 512, 8, 2, 128, "bfloat16", dict(causal=True, sequence_layout="zigzag")),
    "device_zigzag_causal_fp16": (2, 256, 256, 4, 1, 128, "float16", dict(causal=True, sequence_layout="zigzag")),
    "device_zigzag_causal_segments_softcap_bf16": (
        1, 256, 256, 4, 2, 128, "bfloat16", dict(causal=True, segments=True, logits_soft_cap=20.0,
                                                  sequence_layout="zigzag")),
}


def case_inputs(name: str, seed: int = 0, devices: int = DEVICES) -> tuple[dict[str, Any], dict[str, Any]]:
    """Global (unsharded) arrays and static options of a case on a ring of ``devices``."""
    batch, q_loc, kv_loc, heads, kv_heads, head_dim, dtype, options = {**CASES, **DEVICE_CASES}[name]
    q_len, kv_len = devices * q_loc, devices * kv_loc
    arrays = dict(
        query=normal_array(seed * 10 + 0, (batch, q_len, heads, head_dim), dtype),
        key=normal_array(seed * 10 + 1, (batch, kv_len, kv_heads, head_dim), dtype),
        value=normal_array(seed * 10 + 2, (batch, kv_len, kv_heads, head_dim), dtype),
    )
    options = dict(options)
    if options.pop("softmax_aux", False):
        arrays["softmax_aux"] = normal_array(seed * 10 + 3, (heads,), dtype)
    if options.pop("segments", False):  # a few segments per row whose boundaries cross device shards
        q_ids = np.minimum(np.arange(q_len) * 3 // q_len, 2)
        kv_ids = np.minimum(np.arange(kv_len) * 3 // kv_len, 2)
        arrays["q_segment_ids"] = jnp.asarray(np.broadcast_to(q_ids, (batch, q_len)), jnp.int32)
        arrays["kv_segment_ids"] = jnp.asarray(np.broadcast_to(kv_ids, (batch, kv_len)), jnp.int32)
    return arrays, options


SCHEDULE_REFERENCE = "schedule-reference"
"""The ``platform`` that runs the shared ring schedule (``operations._ring_schedule``) on
:class:`ReferenceRingBlocks` instead of a registered backend: the CPU check of the schedule the GPU rings use."""


@dataclasses.dataclass(frozen=True)
class ReferenceRingBlocks:
    """Local blocks for ``operations._ring_schedule`` in float32 jnp (dense logits of one block): the
    schedule's contract (``RingBlocks``) written plainly, for its CPU tests."""

    softmax_scale: float
    logits_soft_cap: float | None = None

    def _probabilities(self, q, k, q_seg, kv_seg, causal, lse=None):
        groups = q.shape[2] // k.shape[2]
        kr = jnp.repeat(k.astype(jnp.float32), groups, axis=2)
        raw = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * self.softmax_scale
        s = raw if self.logits_soft_cap is None else self.logits_soft_cap * jnp.tanh(raw / self.logits_soft_cap)
        mask = jnp.ones(s.shape[-2:], bool)
        if causal:
            mask = jnp.tril(mask)
        mask = jnp.broadcast_to(mask, s.shape)
        if q_seg is not None:
            mask = mask & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
        s = jnp.where(mask, s, -jnp.inf)
        if lse is None:
            lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
        return p, lse, raw, kr

    def forward(self, q, k, v, q_seg, kv_seg, causal):
        p, lse, _, _ = self._probabilities(q, k, q_seg, kv_seg, causal)
        vr = jnp.repeat(v.astype(jnp.float32), q.shape[2] // k.shape[2], axis=2)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vr).astype(q.dtype), lse

    def backward(self, q, k, v, q_seg, kv_seg, out, lse, d_out, causal):
        groups = q.shape[2] // k.shape[2]
        p, _, raw, kr = self._probabilities(q, k, q_seg, kv_seg, causal, lse)
        do = d_out.astype(jnp.float32)
        vr = jnp.repeat(v.astype(jnp.float32), groups, axis=2)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(jnp.float32))
        ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do, vr) - delta[..., None])
        if self.logits_soft_cap is not None:
            ds = ds * (1.0 - jnp.tanh(raw / self.logits_soft_cap) ** 2)
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kr) * self.softmax_scale
        fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], groups, x.shape[-1]).sum(3)  # noqa: E731
        dk = fold(jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * self.softmax_scale)
        return dq, dk, fold(jnp.einsum("bhqk,bqhd->bkhd", p, do))


def merged_blocks(blocks, q, d_out, parts, q_seg=None):
    """What a ring does with a backend's ``blocks`` (``_ring_schedule.RingBlocks``) for one query shard: each
    ``(k, v, kv_seg, causal)`` of ``parts`` through ``blocks.forward``, merged by log-sum-exp, then each part's
    ``blocks.backward`` from the merged output and log-sum-exp. Returns ``(out, dq, dk, dv)``, dk/dv
    concatenated over the parts' keys: compare with flash attention over all the keys (the contract each
    backend's GPU test checks on its kernels)."""
    from ejkernel.modules.operations._ring_schedule import _merge

    out = jnp.zeros(q.shape[:3] + parts[0][1].shape[3:], jnp.float32)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    for k, v, kv_seg, causal in parts:
        part_out, part_lse = blocks.forward(q, k, v, q_seg, kv_seg, causal)
        out, lse = _merge(out, lse, part_out.astype(jnp.float32), part_lse)
    out = out.astype(q.dtype)
    grads = [blocks.backward(q, k, v, q_seg, kv_seg, out, lse, d_out, causal) for k, v, kv_seg, causal in parts]
    dq = sum(g[0].astype(jnp.float32) for g in grads)
    return out, dq, jnp.concatenate([g[1] for g in grads], 1), jnp.concatenate([g[2] for g in grads], 1)


def check_one_device_ring(platform: str, flash_platform: str, layout: str, causal: bool, shape, dtype="bfloat16"):
    """``ring_attention(platform=...)`` under ``shard_map`` on a one-device mesh (the own shard's step only)
    against ``flash_attention(platform=flash_platform)``: output and the three gradients. ``shape``:
    ``(batch, seq, heads, kv_heads, head_dim)``."""
    from jax.sharding import PartitionSpec as P

    from ejkernel.modules import flash_attention, ring_attention

    b, s, h, hkv, d = shape
    q, k, v, do = (normal_array(i, x, dtype) for i, x in enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d),
                                                                    (b, s, h, d)]))
    mesh = jax.make_mesh((1,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    spec = P(None, AXIS)

    def ring(q, k, v):
        local = lambda q, k, v: ring_attention(q, k, v, causal=causal, axis_name=AXIS,  # noqa: E731
                                               sequence_layout=layout, platform=platform)
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)

    def forward_backward(fn):
        def run(q, k, v, do):
            out, pullback = jax.vjp(fn, q, k, v)
            return (out, *pullback(do))

        return jax.jit(run)(q, k, v, do)

    flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, platform=flash_platform)  # noqa: E731
    for name, got, want in zip(("out", "dq", "dk", "dv"), forward_backward(ring), forward_backward(flash)):
        assert_close(got, want, dtype=dtype, gradient=name != "out", name=name)


def _schedule_reference(**arguments):
    """The shared schedule on :class:`ReferenceRingBlocks` (refuses what the schedule's users refuse)."""
    from ejkernel.errors import UnsupportedFeature
    from ejkernel.modules.operations import _ring_schedule
    from ejkernel.modules.operations.ring_attention import RingAttention

    call = RingAttention().validate(**arguments)
    if call.softmax_aux is not None or call.sliding_window is not None:
        raise UnsupportedFeature("the ring schedule's blocks take neither sinks nor sliding windows")
    return _ring_schedule.ring_attention(ReferenceRingBlocks(call.softmax_scale, call.logits_soft_cap), call)


def run_case(
    name: str,
    platform: str,
    tolerances: Mapping[str, Tolerance] | None = None,
    devices: int = DEVICES,
    data: int | None = None,
) -> str:
    """Ring attention on a ``devices``-device ring vs flash_attention on one device: output and gradients.
    ``data`` given: the mesh is ``(data, devices)`` over axes ``("dp", "sp")``, the batch sharded over ``dp``
    (another mesh axis beside the ring's); otherwise a one-axis mesh."""
    from jax.sharding import PartitionSpec as P

    from ejkernel.modules import flash_attention, ring_attention, zigzag_shard, zigzag_unshard

    arrays, options = case_inputs(name, devices=devices)
    dtype = arrays["query"].dtype
    names = list(arrays)
    if data is None:
        mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:devices])
        sequence = P(None, AXIS)
    else:
        if arrays["query"].shape[0] % data:
            raise ValueError(f"case {name}: batch {arrays['query'].shape[0]} is not a multiple of data={data}")
        mesh = jax.make_mesh((data, devices), (DATA_AXIS, AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                             devices=jax.devices()[: data * devices])
        sequence = P(DATA_AXIS, AXIS)
    spec = {"query": sequence, "key": sequence, "value": sequence, "q_segment_ids": sequence,
            "kv_segment_ids": sequence, "softmax_aux": P()}

    zigzag = options.get("sequence_layout") == "zigzag"  # laid out by the user helpers, checked on the global order

    def ring(*values):
        def local(*shards):
            if platform == SCHEDULE_REFERENCE:
                return _schedule_reference(**dict(zip(names, shards)), **options, axis_name=AXIS)
            return ring_attention(**dict(zip(names, shards)), **options, axis_name=AXIS, platform=platform)

        if zigzag:
            values = [zigzag_shard(x, devices) if spec[n] != P() else x for n, x in zip(names, values)]
        out = jax.shard_map(local, mesh=mesh, in_specs=tuple(spec[n] for n in names), out_specs=sequence)(*values)
        return zigzag_unshard(out, devices) if zigzag else out

    flash_options = {k: v for k, v in options.items() if k != "sequence_layout"}

    def flash(*values):
        return flash_attention(**dict(zip(names, values)), **flash_options, platform="xla")

    diff = [i for i, n in enumerate(names) if jnp.issubdtype(arrays[n].dtype, jnp.floating)]

    def forward_backward(fn):
        @jax.jit
        def run(values, cotangent):
            def partial(*d):
                full = list(values)
                for i, x in zip(diff, d):
                    full[i] = x
                return fn(*full)

            out, vjp = jax.vjp(partial, *(values[i] for i in diff))
            return out, vjp(cotangent)

        return run

    values = tuple(arrays[n] for n in names)
    shape = jax.eval_shape(flash, *values)
    cotangent = normal_array(99, shape.shape, shape.dtype)
    out, grads = forward_backward(ring)(values, cotangent)
    want, want_grads = forward_backward(flash)(values, cotangent)
    report = [f"{name}: output {assert_close(out, want, dtype=dtype, tolerances=tolerances, scale=2.0):.1e}"]
    for i, g, w in zip(diff, grads, want_grads):
        error = assert_close(g, w, dtype=dtype, gradient=True, tolerances=tolerances, scale=2.0, name=f"d{names[i]}")
        report.append(f"d{names[i]} {error:.1e}")
    return ", ".join(report)


def run_in_subprocess(
    platform: str,
    cases: list[str],
    timeout: float = 600.0,
    devices: int = DEVICES,
    compiler_options: Mapping[str, Any] | None = None,
    data: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cases`` in a fresh interpreter with ``data * devices`` host devices (see the module docstring
    and :func:`run_case`); ``compiler_options`` become XLA flags there (``--name=value``)."""
    env = dict(os.environ)
    flags = [f"--xla_force_host_platform_device_count={(data or 1) * devices}"]
    flags += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (compiler_options or {}).items()]
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    command = [
        sys.executable, "-m", "ejkernel.testing.ring_attention", "--platform", platform, "--devices", str(devices),
        *(["--data", str(data)] if data else []), *cases,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


class RingAttentionConformance:
    """Test base: subclass and set ``platform`` (see the module docstring)."""

    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    devices: ClassVar[int] = DEVICES
    """Ring size of the multi-device test. A backend whose kernels run in an interpreter (a cost growing
    with devices x ring steps) may choose fewer, down to 3: with 2, rotating the wrong way goes unnoticed."""
    refused_cases: ClassVar[int] = 0
    """How many of :data:`CASES` the backend may refuse with ``UnsupportedFeature`` (its layouts or features)."""
    compiler_options: ClassVar[Mapping[str, Any] | None] = None
    """XLA options for the compiled checks (``numerics.INTERPRET_COMPILER_OPTIONS`` for interpret-mode kernels)."""

    def call(self, *args, **kwargs):
        from ejkernel.modules import ring_attention

        return ring_attention(*args, **kwargs, platform=self.platform)

    def test_matches_flash_attention_on_a_ring_of_devices(self):
        if self.devices < 3:
            raise ValueError(f"{type(self).__name__}.devices = {self.devices}: a ring test needs at least 3 devices")
        result = run_in_subprocess(
            self.platform, sorted(CASES), devices=self.devices, compiler_options=self.compiler_options
        )
        assert result.returncode == 0, (
            f"ring attention on {self.devices} devices failed:\n{result.stdout}\n{result.stderr[-4000:]}"
        )
        assert result.stdout.count("OK ") + result.stdout.count("REFUSED ") == len(CASES), result.stdout
        assert result.stdout.count("OK ") >= len(CASES) - self.refused_cases, result.stdout

    def test_ring_beside_a_data_axis(self):
        """A (2, 4) mesh: the batch sharded over "dp", the sequence over a ring of 4 on "sp"."""
        cases = ["causal_gqa_softcap", "full_softcap_sinks"]
        result = run_in_subprocess(self.platform, cases, devices=4, data=2, compiler_options=self.compiler_options)
        assert result.returncode == 0, f"ring beside a data axis failed:\n{result.stdout}\n{result.stderr[-4000:]}"
        assert result.stdout.count("OK ") + result.stdout.count("REFUSED ") == len(cases), result.stdout
        assert result.stdout.count("OK ") >= 1, result.stdout

    def test_one_device_is_flash_attention(self):
        from ejkernel.modules import flash_attention

        arrays, options = case_inputs("window_segments_q_ne_kv", seed=3)
        arrays["softmax_aux"] = normal_array(4, (arrays["query"].shape[2], 2))
        fn = jax.jit(
            jax.value_and_grad(lambda q, k, aux, f: jnp.sum(f(q, k, aux) ** 2), argnums=(0, 1, 2)),
            static_argnums=3,
            compiler_options=dict(self.compiler_options or {}) or None,
        )
        rest = {k: v for k, v in arrays.items() if k not in ("query", "key", "softmax_aux")}
        ring = lambda q, k, aux: self.call(q, k, **rest, softmax_aux=aux, **options)  # noqa: E731
        flash = lambda q, k, aux: flash_attention(q, k, **rest, softmax_aux=aux, **options, platform="xla")  # noqa: E731
        got, want = fn(arrays["query"], arrays["key"], arrays["softmax_aux"], ring), fn(
            arrays["query"], arrays["key"], arrays["softmax_aux"], flash
        )
        assert_close(got[0], want[0], dtype=jnp.float32)
        for name, g, w in zip(("dquery", "dkey", "dsoftmax_aux"), got[1], want[1]):
            assert_close(g, w, dtype=jnp.float32, gradient=True, name=name)

    def test_bad_inputs_raise_value_errors(self):
        import pytest

        arrays, _ = case_inputs("full_softcap_sinks")
        q, k, v = arrays["query"], arrays["key"], arrays["value"]
        cases = [
            ((q[0], k, v), {}, "query"),
            ((q, k[..., :4], v), {}, "key"),
            ((q, k, v.astype(jnp.bfloat16)), {}, "value"),
            ((q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2)), {}, "kv heads"),
            ((q, k, v), {"sliding_window": (-1, 2)}, "sliding_window"),
            ((q, k, v), {"logits_soft_cap": -1.0}, "logits_soft_cap"),
            ((q, k, v), {"axis_name": 3}, "axis_name"),
            ((q, k, v), {"precision": "fastest"}, "precision"),
            ((q, k, v, *[jnp.zeros((q.shape[0], q.shape[1] + 1), jnp.int32)] * 2), {}, "q_segment_ids"),
        ]
        for args, kwargs, match in cases:
            with pytest.raises((ValueError, TypeError), match=match):
                self.call(*args, **kwargs)

    def test_one_sided_segment_ids_are_refused(self):
        """Key/value shards travel with their own segment ids: core requires both sides (no self-attention
        fill as in flash_attention), with a ValueError naming the missing one, before anything compiles."""
        import pytest

        from ejkernel.modules.operations.ring_attention import RingAttention
        from ejkernel.ops import get_default_executor

        arrays, _ = case_inputs("full_softcap_sinks")
        q, k, v = arrays["query"], arrays["key"], arrays["value"]
        q_seg, kv_seg = jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32)
        for segments, missing in (((q_seg, None), "kv_segment_ids"), ((None, kv_seg), "q_segment_ids")):
            with pytest.raises(ValueError, match=f"{missing} is required"):
                get_default_executor()(RingAttention(), q, k, v, *segments, platform=self.platform)
            with pytest.raises(ValueError, match=f"{missing} is required"):
                self.call(q, k, v, *segments)


class DeviceRingConformance:
    """Test base for a ring over the real accelerators of one host (every local device, at least 2; skips
    with fewer): :data:`CASES` and :data:`DEVICE_CASES` in this process, and a mesh with a data axis beside
    the ring's (``(2, P / 2)`` with four or more devices, else ``(1, P)``). Cases the backend refuses (``UnsupportedFeature``) are skipped with its reason;
    at least ``min_accepted`` must run. Subclass, set ``platform``, and mark the module for its device."""

    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    min_accepted: ClassVar[int] = 3

    @staticmethod
    def _devices() -> int:
        import pytest

        devices = jax.device_count()
        if devices < 2:
            pytest.skip(f"a ring of devices needs 2 or more, jax sees {devices}")
        return devices

    def _run(self, name: str, **kwargs) -> str:
        import pytest

        from ejkernel.errors import UnsupportedFeature

        try:
            return run_case(name, self.platform, self.tolerances, **kwargs)
        except UnsupportedFeature as reason:
            pytest.skip(f"{self.platform} refuses {name}: {reason}")

    def test_cases_on_a_ring_of_devices(self):
        from ejkernel.errors import UnsupportedFeature

        devices, accepted, report = self._devices(), 0, []
        for name in sorted(CASES) + sorted(DEVICE_CASES):
            try:
                report.append(run_case(name, self.platform, self.tolerances, devices=devices))
                accepted += 1
            except UnsupportedFeature as reason:
                report.append(f"{name}: refused ({reason})")
        print("\n".join(report))
        assert accepted >= self.min_accepted, report

    def test_ring_beside_a_data_axis(self):
        devices = self._devices()
        data = 2 if devices >= 4 and devices % 2 == 0 else 1  # batch 2 over "dp", the rest a ring on "sp"
        for name in ("device_full_gqa_bf16", "device_zigzag_causal_fp16"):
            self._run(name, devices=devices // data, data=data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default="xla")
    parser.add_argument("--devices", type=int, default=DEVICES, help="the ring's size")
    parser.add_argument("--data", type=int, default=None, help="size of a data axis beside the ring's")
    parser.add_argument("cases", nargs="*", default=sorted(CASES))
    args = parser.parse_args(argv)
    if jax.device_count() < args.devices * (args.data or 1):
        print(f"needs {args.devices * (args.data or 1)} devices, jax sees {jax.device_count()} (set XLA_FLAGS)",
              file=sys.stderr)
        return 2
    failed = 0
    from ejkernel.errors import UnsupportedFeature

    for name in args.cases:
        try:
            print("OK", run_case(name, args.platform, devices=args.devices, data=args.data), flush=True)
        except UnsupportedFeature as exc:  # the backend refuses the case's feature (the dispatcher falls back)
            print(f"REFUSED {name}: {exc}", flush=True)
        except Exception as exc:  # report every case, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
