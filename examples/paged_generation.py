"""Batched greedy generation with a paged KV cache, and its tokens/s.

    python examples/paged_generation.py --config tiny --op page      # CPU, seconds
    python examples/paged_generation.py --config gpu-100m --op both --out $OUT/gen

The GPT of ``gpt_model.py`` (random weights: this measures speed, not prose) generates for a batch of
prompts of different lengths. Each layer's keys/values live in fixed-size pages of one shared cache,
found through a block table (pages are handed out shuffled, as a server's allocator would).

- ``--op page``: prefill the padded prompts with ``flash_attention``, write their keys/values into the
  pages, then decode one token per sequence per step with ``ejkernel.modules.page_attention``
  (cache ``[num_pages, kv_heads, page_size, head_dim]``, keys and values apart).
- ``--op ragged``: the prompts are packed without padding and both prefill and decode run
  ``ejkernel.modules.ragged_page_attention`` (cache ``[num_pages, page_size, 2 * kv_heads, head_dim]``,
  key and value heads interleaved).

The whole decode loop is one ``lax.scan`` under ``jit``. Afterwards the model reruns every sequence in
full, without a cache, and the logits of each generated position are compared with the cached ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpt_model import GPT, GPTConfig, num_params, training_text  # noqa: E402


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    model: GPTConfig
    num_seqs: int
    min_prompt: int
    max_prompt: int
    new_tokens: int
    page_size: int
    compiler_options: dict[str, Any] | None = None  # for jax.jit of generate (see train_gpt.CONFIGS)


CONFIGS = {
    "tiny": GenerationConfig(GPTConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=128),
                             num_seqs=4, min_prompt=3, max_prompt=13, new_tokens=6, page_size=4,
                             compiler_options={"xla_backend_optimization_level": 0}),
    "gpu-100m": GenerationConfig(GPTConfig(d_model=1024, num_layers=8, num_heads=8, num_kv_heads=2, mlp_hidden=3328,
                                           dtype="bfloat16"),
                                 num_seqs=64, min_prompt=64, max_prompt=1024, new_tokens=256, page_size=16),
}


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """Where token ``p`` of sequence ``s`` lives: page ``block_tables[s, p // page_size]``, slot ``p % page_size``."""

    op: str
    page_size: int
    block_tables: jax.Array  # int32 [num_seqs, pages_per_seq]

    def empty(self, cfg: GPTConfig) -> list:
        pages = self.block_tables.size
        dtype = jnp.dtype(cfg.dtype)
        if self.op == "page":  # keys and values apart, kv heads before the slots
            shape = (pages, cfg.num_kv_heads, self.page_size, cfg.head_dim)
            return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
        shape = (pages, self.page_size, 2 * cfg.num_kv_heads, cfg.head_dim)  # key head k at 2k, value at 2k+1
        return [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]

    def write(self, cache, k, v, seq_ids, positions):
        """Store ``k, v [n, kv_heads, head_dim]`` of tokens ``(seq_ids[i], positions[i])``."""
        pages = self.block_tables[seq_ids, positions // self.page_size]
        slots = positions % self.page_size
        if self.op == "page":
            key_cache, value_cache = cache
            return key_cache.at[pages, :, slots].set(k), value_cache.at[pages, :, slots].set(v)
        return cache.at[pages, slots, 0::2].set(k).at[pages, slots, 1::2].set(v)


def attend_paged(paged: PagedCache, seq_ids, positions, context_lens, query_start_loc, platform):
    """``attend`` for tokens packed ``[n, ...]`` whose keys/values join the cache before attending to it."""
    from ejkernel.modules import page_attention, ragged_page_attention

    def attend(q, k, v, cache):
        cache = paged.write(cache, k, v, seq_ids, positions)
        if paged.op == "page":  # one query per sequence (decode)
            out = page_attention(q, *cache, context_lens, paged.block_tables, platform=platform)
        else:
            out = ragged_page_attention(q, cache, context_lens, paged.block_tables, query_start_loc,
                                        jnp.array([context_lens.shape[0]], jnp.int32), platform=platform)
        return out, cache

    return attend


def attend_prefill_padded(paged: PagedCache, platform):
    """``attend`` for padded prompts ``[batch, max_prompt, ...]``: causal flash attention, then all keys/values
    (padding too: later tokens overwrite it before it is ever visible) go into the pages."""
    from ejkernel.modules import flash_attention

    def attend(q, k, v, cache):
        batch, length = q.shape[:2]
        seq_ids = jnp.repeat(jnp.arange(batch), length)
        positions = jnp.tile(jnp.arange(length), batch)
        cache = paged.write(cache, k.reshape(batch * length, *k.shape[2:]), v.reshape(batch * length, *v.shape[2:]),
                            seq_ids, positions)
        return flash_attention(q, k, v, causal=True, platform=platform), cache

    return attend


def make_generate(model: GPT, paged: PagedCache, prompt_lens: np.ndarray, new_tokens: int, platform: str,
                  compiler_options: dict[str, Any] | None = None):
    """A jitted ``generate(state, prompt) -> (tokens [num_seqs, new_tokens], logits [num_seqs, new_tokens, V])``."""
    graph, _ = nnx.split(model)
    num_seqs = len(prompt_lens)
    lengths = jnp.asarray(prompt_lens, jnp.int32)
    starts = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def generate(state, prompt):
        model = nnx.merge(graph, state)
        caches = paged.empty(model.cfg)
        if paged.op == "page":  # prompt: [num_seqs, max_prompt], padded
            positions = jnp.broadcast_to(jnp.arange(prompt.shape[1]), prompt.shape)
            logits, caches = model(prompt, positions, attend_prefill_padded(paged, platform), caches)
            last = logits[jnp.arange(num_seqs), lengths - 1]
        else:  # prompt: [total_prompt_tokens], packed
            seq_ids = jnp.asarray(np.repeat(np.arange(num_seqs), prompt_lens))
            positions = jnp.asarray(np.concatenate([np.arange(n) for n in prompt_lens]))
            attend = attend_paged(paged, seq_ids, positions, lengths, jnp.asarray(starts), platform)
            logits, caches = model(prompt, positions, attend, caches)
            last = logits[starts[1:] - 1]

        def decode(carry, _):
            caches, token, positions = carry
            attend = attend_paged(paged, jnp.arange(num_seqs), positions, positions + 1,
                                  jnp.arange(num_seqs + 1, dtype=jnp.int32), platform)
            logits, caches = model(token, positions, attend, caches)
            return (caches, jnp.argmax(logits, -1).astype(jnp.int32), positions + 1), (token, logits)

        first = jnp.argmax(last, -1).astype(jnp.int32)
        (_, final, _), (tokens, logits) = jax.lax.scan(decode, (caches, first, lengths), length=new_tokens - 1)
        tokens = jnp.concatenate([tokens, final[None]]).T
        logits = jnp.concatenate([last[None], logits]).transpose(1, 0, 2)
        return tokens, logits

    return generate


def full_recompute_error(model: GPT, prompts: list[np.ndarray], tokens: np.ndarray, logits: np.ndarray,
                         compiler_options: dict[str, Any] | None = None) -> float:
    """Largest relative difference between the cached logits and a cache-free rerun of each whole sequence."""
    from ejkernel.modules import flash_attention

    sequences = [np.concatenate([p, t[:-1]]) for p, t in zip(prompts, tokens)]
    length = max(map(len, sequences))
    padded = np.zeros((len(sequences), length), np.int32)
    for i, s in enumerate(sequences):
        padded[i, : len(s)] = s
    graph, state = nnx.split(model)

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def forward(state, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        attend = lambda q, k, v, cache: (flash_attention(q, k, v, causal=True), cache)  # noqa: E731
        return nnx.merge(graph, state)(tokens, positions, attend)[0]

    full = forward(state, jnp.asarray(padded))
    new = tokens.shape[1]
    expected = np.stack([np.asarray(full[i, len(p) - 1 : len(p) - 1 + new]) for i, p in enumerate(prompts)])
    return float(np.max(np.abs(expected - logits)) / np.max(np.abs(expected)))


def run(config: str, op: str, *, platform: str = "auto", seed: int = 0) -> dict[str, Any]:
    gen = CONFIGS[config]
    cfg = gen.model
    model = GPT(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(gen.min_prompt, gen.max_prompt + 1, gen.num_seqs)
    text = training_text(int(prompt_lens.sum()) + 1)
    starts = np.concatenate([[0], np.cumsum(prompt_lens)])
    prompts = [text[a:b].astype(np.int32) for a, b in zip(starts[:-1], starts[1:])]

    pages_per_seq = math.ceil((gen.max_prompt + gen.new_tokens) / gen.page_size)
    block_tables = rng.permutation(gen.num_seqs * pages_per_seq).reshape(gen.num_seqs, pages_per_seq)
    paged = PagedCache(op, gen.page_size, jnp.asarray(block_tables, jnp.int32))
    if op == "page":
        prompt = np.zeros((gen.num_seqs, int(prompt_lens.max())), np.int32)
        for i, p in enumerate(prompts):
            prompt[i, : len(p)] = p
    else:
        prompt = np.concatenate(prompts)
    generate = make_generate(model, paged, prompt_lens, gen.new_tokens, platform, gen.compiler_options)
    state, prompt = nnx.state(model), jnp.asarray(prompt)

    t0 = time.perf_counter()
    jax.block_until_ready(generate(state, prompt))  # compiles
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens, logits = jax.block_until_ready(generate(state, prompt))
    elapsed = time.perf_counter() - t0
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    generated = gen.num_seqs * gen.new_tokens
    return {
        "op": op,
        "attention": {"page": "flash_attention (prefill) + page_attention (decode)",
                      "ragged": "ragged_page_attention (prefill and decode)"}[op],
        "num_seqs": gen.num_seqs,
        "prompt_tokens": int(prompt_lens.sum()),
        "new_tokens_per_seq": gen.new_tokens,
        "page_size": gen.page_size,
        "first_call_s": compile_s,
        "generate_s": elapsed,
        "tokens_per_s": generated / elapsed,
        "max_relative_logits_error_vs_full_recompute": full_recompute_error(model, prompts, tokens, logits,
                                                                                    gen.compiler_options),
        "sample": bytes(tokens[0].astype(np.uint8)).decode("latin-1"),
        "params": num_params(model),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--op", choices=("page", "ragged", "both"), default="both")
    parser.add_argument("--platform", default="auto", help="ejkernel platform (auto, xla, pallas, ...)")
    parser.add_argument("--out", type=pathlib.Path, help="write paged_generation-<config>.json here")
    args = parser.parse_args(argv)
    ops = ("page", "ragged") if args.op == "both" else (args.op,)
    device = jax.devices()[0]
    result = {
        "config": args.config,
        "device": getattr(device, "device_kind", str(device)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "runs": {op: run(args.config, op, platform=args.platform) for op in ops},
    }
    for r in result["runs"].values():
        print(f"{r['attention']:<52} {r['num_seqs']} seqs x {r['new_tokens_per_seq']} new tokens: "
              f"{r['tokens_per_s']:,.0f} tokens/s ({r['generate_s']:.3f} s, prefill included); logits vs full "
              f"recompute {r['max_relative_logits_error_vs_full_recompute']:.1e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"paged_generation-{args.config}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
