"""The ring schedule the GPU rings share (``operations._ring_schedule``), on CPU devices with plain jnp
blocks (``ejkernel.testing.ring_attention.ReferenceRingBlocks``): output and every gradient against
single-device flash attention, for each kind of step (non-causal, causal contiguous, causal zig-zag), on
rings of 8 (the scanned middle steps), 3 and 2 (only the peeled first and last steps)."""

from __future__ import annotations

import pytest

from ejkernel.testing.ring_attention import CASES, SCHEDULE_REFERENCE, run_in_subprocess

# what the schedule takes (no sinks, no sliding window) and what its users refuse
TAKEN = {"zigzag_causal_gqa_segments", "causal_gqa_softcap", "full_gqa_segments_bf16"}


@pytest.mark.parametrize("devices", [8, 3, 2])
def test_schedule_matches_flash_attention_on_a_ring(devices):
    result = run_in_subprocess(SCHEDULE_REFERENCE, sorted(CASES), devices=devices)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    for name in CASES:
        assert (f"OK {name}:" if name in TAKEN else f"REFUSED {name}:") in result.stdout, (name, result.stdout)


@pytest.mark.parametrize("causal", [False, True])
def test_merged_blocks_helper_is_flash_attention(causal):
    """The helper the backends' GPU tests check their blocks with (``merged_blocks``), on the reference
    blocks: the first kv half (diagonal when causal, for the second half's queries) and the second merged."""
    import jax
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention
    from ejkernel.testing.numerics import assert_close, normal_array
    from ejkernel.testing.ring_attention import ReferenceRingBlocks, merged_blocks

    b, s, h, hkv, d = 1, 64, 4, 2, 16
    q, k, v, do = (normal_array(i, shape, "float32") for i, shape in
                   enumerate([(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)]))
    half = s // 2
    qh, doh = (q[:, half:], do[:, half:]) if causal else (q, do)
    parts = [(k[:, :half], v[:, :half], None, False), (k[:, half:], v[:, half:], None, causal)]
    got = merged_blocks(ReferenceRingBlocks(d ** -0.5), qh, doh, parts)
    out, pullback = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="xla")[:, s - qh.shape[1]:],
                            q, k, v)
    dq, dk, dv = pullback(doh)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (out, dq[:, s - qh.shape[1]:], dk, dv)):
        assert_close(g, w, dtype=jnp.float32, gradient=name != "out", name=name)


@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("zigzag", True)])
def test_one_device_ring_helper(layout, causal):
    from ejkernel.testing.ring_attention import check_one_device_ring

    check_one_device_ring("xla", "xla", layout, causal, (1, 64, 4, 2, 16), dtype="float32")
