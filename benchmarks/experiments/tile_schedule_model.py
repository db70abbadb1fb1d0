"""List-scheduling model of the native kernels' tile orders on a GPU's SMs (no GPU needed).

Predicts how long a grid of uneven tiles takes under three ways of handing tiles to SMs, in the order of
``tile_at`` (``csrc/flash_attention/common.cuh``: sections of (head, batch) pairs, each section rank by rank):

- ``greedy``: an SM takes the next tile when it finishes one (a non-persistent grid; a persistent kernel that
  draws its ticket at a tile's end);
- ``lead``: a persistent kernel drawing its next ticket ``--lead`` blocks before the tile ends (the forward
  draws once the tile's loads are issued, about two blocks before);
- ``reserve``: a persistent kernel drawing its next ticket when a tile starts (the forward until 2026-11-28g).

A tile of the causal forward at rank r (128 query rows, the last rows first) runs ``tile_us + (tiles_per_pair -
r) * block_us``; the causal backward's key tile at rank r streams 128 / 64 query blocks per key block it
sees. The defaults are the H100/H200 figures of NOTES.md (1.81 us per forward block; per-tile cost 2.2 us).

    python benchmarks/experiments/tile_schedule_model.py            # forward and backward, S = 2k / 8k / 16k
"""

from __future__ import annotations

import argparse
import heapq

SECTION_BYTES = 16 * 2**20  # grid_section's budget: a third of an H100's / H200's L2


def tile_at(linear: int, tiles_per_pair: int, pairs: int, section: int) -> tuple[int, int]:
    """(rank, pair) of tile ``linear``: common.cuh's tile_at."""
    if section <= 0:
        return linear % tiles_per_pair, linear // tiles_per_pair
    span = section * tiles_per_pair
    first = linear // span * section
    width = min(section, pairs - first)
    within = linear - linear // span * span
    return within // width, first + within % width


def tile_times(seq: int, heads: int, tokens: int, head_dim: int, backward: bool, tile_us: float,
               block_us: float) -> list[float]:
    """Each tile's time in tile_at's order for one causal call of ``tokens`` tokens (batch = tokens / seq)."""
    pairs, tiles_per_pair = tokens // seq * heads, seq // 128
    # grid_section's bytes per pair: K and V (forward); Q, dO and the float32 dQ (backward)
    bytes_per_pair = (2 * 2 + 4) * seq * head_dim if backward else 2 * seq * head_dim * 2
    section = max(1, min(pairs, int(SECTION_BYTES // bytes_per_pair)))
    steps_per_block = 2 if backward else 1  # the backward streams 64-query blocks past 128-key tiles
    return [tile_us + (tiles_per_pair - tile_at(i, tiles_per_pair, pairs, section)[0]) * steps_per_block * block_us
            for i in range(tiles_per_pair * pairs)]


def makespan(times: list[float], sms: int, policy: str, lead_us: float = 0.0) -> float:
    """When the last tile ends: each SM starts with tile = its index, then takes tickets in order."""
    draws = []  # (when the SM draws its next ticket, when its current tile ends, SM)

    def schedule(start: float, tile: int, sm: int) -> None:
        end = start + times[tile]
        draw = {"greedy": end, "lead": max(start, end - lead_us), "reserve": start}[policy]
        heapq.heappush(draws, (draw, end, sm))

    for sm in range(min(sms, len(times))):
        schedule(0.0, sm, sm)
    ticket, last = min(sms, len(times)), 0.0
    while draws:
        _, end, sm = heapq.heappop(draws)
        last = max(last, end)
        if ticket < len(times):
            schedule(end, ticket, sm)
            ticket += 1
    return last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="2048,8192,16384")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--tile-us", type=float, default=2.2, help="per-tile cost (start-up, epilogue)")
    parser.add_argument("--block-us", type=float, default=1.81, help="per 128-key block of a 128-row tile")
    parser.add_argument("--lead", type=float, default=2.0, help="blocks before the tile's end of the lead policy")
    args = parser.parse_args(argv)
    positive = {"--sms": args.sms, "--heads": args.heads, "--tokens": args.tokens, "--head-dim": args.head_dim,
                "--block-us": args.block_us}
    for flag, value in positive.items():
        if value <= 0:
            parser.error(f"{flag} {value}: expected a value > 0")
    for flag, value in (("--tile-us", args.tile_us), ("--lead", args.lead)):
        if value < 0:
            parser.error(f"{flag} {value}: expected a value >= 0")
    try:
        seqs = [int(seq) for seq in args.seqs.split(",")]
    except ValueError:
        parser.error(f"--seqs {args.seqs!r}: expected comma-separated whole numbers, e.g. 2048,8192")
    for seq in seqs:  # the model's tiles are whole 128-row tiles of whole sequences
        if seq <= 0 or seq % 128 or args.tokens % seq:
            parser.error(f"--seqs {seq}: expected a positive multiple of 128 that divides --tokens {args.tokens}")
    print("causal, us    | greedy | lead   | reserve | reserve / greedy")
    for backward in (False, True):
        for seq in seqs:
            block_us = args.block_us * (0.5 * 2.2 / 1.81 if backward else 1.0)  # a backward 64-row step ~1.1 us
            times = tile_times(seq, args.heads, args.tokens, args.head_dim, backward, args.tile_us, block_us)
            spans = {p: makespan(times, args.sms, p, args.lead * block_us) for p in ("greedy", "lead", "reserve")}
            print(f"{'bwd' if backward else 'fwd'} S={seq:<6} | {spans['greedy']:6.1f} | {spans['lead']:6.1f} | "
                  f"{spans['reserve']:7.1f} | {spans['reserve'] / spans['greedy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
