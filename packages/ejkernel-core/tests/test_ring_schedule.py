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
