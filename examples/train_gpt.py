"""Train the small GPT of ``gpt_model.py`` with ejkernel's flash attention and with JAX's own attention,
and compare: tokens/s, step time and the loss curves, written to JSON and one PNG.

    python examples/train_gpt.py --config tiny --out /tmp/gpt-tiny          # CPU, seconds
    python examples/train_gpt.py --config gpu-100m --out $OUT/gpt           # one H100, < 4 minutes

``--attention ejkernel`` runs ``ejkernel.modules.flash_attention`` (whatever backend it picks: Triton or
Pallas on a GPU, XLA on a CPU); ``--attention jax`` runs ``jax.nn.dot_product_attention`` with
``implementation="cudnn"`` on a GPU and ``implementation="xla"`` elsewhere (cuDNN needs a GPU and 16-bit
inputs; ``--jax-implementation`` overrides);
``--attention both`` (the default) trains twice from the same initial weights on the same batches.
Both are causal grouped-query attention, with an optional sliding window (``--sliding-window W``: each
token sees itself and the ``W`` tokens before it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpt_model import GPT, GPTConfig, num_params, training_text  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: GPTConfig
    seq_len: int
    batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int
    sliding_window: int | None = None
    time_budget_s: float | None = None  # per attention choice; stops early (and says so) past it
    compiler_options: dict[str, Any] | None = None  # for jax.jit of the training step


CONFIGS: dict[str, RunConfig] = {
    # CI on the CPU: float32, a few seconds per attention choice, most of it compiling (XLA's backend
    # optimizations off: they would double the compile and save nothing at this size).
    "tiny": RunConfig(
        model=GPTConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=128),
        seq_len=64, batch_size=8, steps=20, learning_rate=3e-3, warmup_steps=3,
        compiler_options={"xla_backend_optimization_level": 0},
    ),
    # ~103M parameters, bf16 compute, sequence 4096, 32k tokens per step; both choices < 4 min on one H100.
    "gpu-100m": RunConfig(
        model=GPTConfig(d_model=1024, num_layers=8, num_heads=8, num_kv_heads=2, mlp_hidden=3328, dtype="bfloat16"),
        seq_len=4096, batch_size=8, steps=300, learning_rate=6e-4, warmup_steps=30, time_budget_s=95.0,
    ),
}


def jax_implementation(dtype: str) -> str:
    """cuDNN where it can run (an NVIDIA GPU, 16-bit inputs); JAX's XLA formula elsewhere."""
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2 else "xla"


def make_attend(choice: str, sliding_window: int | None, platform: str = "auto", jax_impl: str = "xla"):
    """``attend(q, k, v, cache)`` for training: causal GQA over ``[batch, seq, heads, head_dim]``."""
    window = None if sliding_window is None else (sliding_window, 0)
    if choice == "ejkernel":
        from ejkernel.modules import flash_attention

        def attend(q, k, v, cache):
            return flash_attention(q, k, v, causal=True, sliding_window=window, platform=platform), cache
    elif choice == "jax":

        def attend(q, k, v, cache):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                               implementation=jax_impl)
            return out, cache
    else:
        raise ValueError(f"attention choice {choice!r}: expected 'ejkernel' or 'jax'")
    return attend


def describe_attention(choice: str, run: RunConfig, jax_impl: str) -> str:
    if choice == "jax":
        return f'jax.nn.dot_product_attention(implementation="{jax_impl}")'
    from ejkernel.modules import FlashAttention

    cfg = run.model
    q = jax.ShapeDtypeStruct((run.batch_size, run.seq_len, cfg.num_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    kv = jax.ShapeDtypeStruct((run.batch_size, run.seq_len, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    window = None if run.sliding_window is None else (run.sliding_window, 0)
    resolved = FlashAttention().explain(q, kv, kv, causal=True, sliding_window=window)
    return f"ejkernel.modules.flash_attention (platform {resolved.platform})"


def batches(run: RunConfig, seed: int = 0):
    """Random windows of the training text: ``(inputs, targets)`` int32 ``[batch, seq]`` (same every run)."""
    text = training_text(min(1 << 25, max(1 << 20, run.steps * run.seq_len * run.batch_size)))
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(text) - run.seq_len - 1, run.batch_size)
        window = np.stack([text[s:s + run.seq_len + 1] for s in starts]).astype(np.int32)
        yield window[:, :-1], window[:, 1:]


def build(run: RunConfig, attend, seed: int = 0):
    """The model and optimizer as (graph, state), and a jitted ``step(state, inputs, targets) -> (state, loss)``."""
    model = GPT(run.model, rngs=nnx.Rngs(seed))
    warmup = min(run.warmup_steps, run.steps // 2)  # short runs (--steps) keep a decay phase
    schedule = optax.warmup_cosine_decay_schedule(0.0, run.learning_rate, warmup, max(run.steps, warmup + 1))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, 0.9, 0.95,
                                                                                              weight_decay=0.1)),
                              wrt=nnx.Param)
    graph, state = nnx.split((model, optimizer))
    positions = jnp.arange(run.seq_len, dtype=jnp.int32)[None, :]

    def loss_fn(model, inputs, targets):
        logits, _ = model(inputs, positions, attend)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=0, compiler_options=run.compiler_options)
    def step(state, inputs, targets):
        model, optimizer = nnx.merge(graph, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return model, state, step


def train(run: RunConfig, choice: str, *, progress: bool = True, platform: str = "auto",
          jax_impl: str | None = None) -> dict[str, Any]:
    """Train once with one attention choice; the first step (compilation) is timed apart from the rest."""
    from tqdm.auto import tqdm

    jax_impl = jax_impl or jax_implementation(run.model.dtype)
    model, state, step = build(run, make_attend(choice, run.sliding_window, platform, jax_impl))
    data = batches(run)
    losses, step_times, compile_s = [], [], 0.0
    tokens_per_step = run.batch_size * run.seq_len
    started = time.perf_counter()
    bar = tqdm(range(run.steps), desc=f"{choice:>8}", disable=not progress, dynamic_ncols=True)
    for i in bar:
        inputs, targets = next(data)
        t0 = time.perf_counter()
        state, loss = step(state, inputs, targets)
        loss = float(loss)  # waits for the step: times are per finished step
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if i == 0:
            compile_s = elapsed
        else:
            step_times.append(elapsed)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}")
        if run.time_budget_s is not None and time.perf_counter() - started > run.time_budget_s:
            break
    bar.close()
    median = statistics.median(step_times) if step_times else float("nan")
    return {
        "attention": describe_attention(choice, run, jax_impl),
        "steps": len(losses),
        "stopped_early": len(losses) < run.steps,
        "first_step_s": compile_s,
        "step_time_s_median": median,
        "step_time_s_mean": statistics.fmean(step_times) if step_times else float("nan"),
        "tokens_per_s": tokens_per_step / median,
        "loss": losses,
        "params": num_params(model),
    }


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, speed) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    names = list(result["runs"])
    for name in names:
        curves.plot(range(1, len(result["runs"][name]["loss"]) + 1), result["runs"][name]["loss"],
                    label=result["runs"][name]["attention"])
    curves.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"{result['config']}: loss")
    curves.legend(fontsize=8)
    rates = [result["runs"][n]["tokens_per_s"] for n in names]
    bars = speed.bar(names, rates, color=["tab:blue", "tab:orange"][: len(names)])
    speed.bar_label(bars, labels=[f"{r:,.0f}" for r in rates], fontsize=8)
    speed.set(ylabel="tokens/s (median step)", title=result["device"])
    fig.suptitle(f"GPT {result['params'] / 1e6:.1f}M params, seq {result['seq_len']}, batch {result['batch_size']}"
                 f" ({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--attention", choices=("both", "ejkernel", "jax"), default="both")
    parser.add_argument("--steps", type=int, help="override the config's step count")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--sliding-window", type=int, help="each token sees itself and W tokens before it")
    parser.add_argument("--time-budget-s", type=float, help="per attention choice (0: none)")
    parser.add_argument("--platform", default="auto", help="ejkernel platform (auto, triton, pallas, xla)")
    parser.add_argument("--jax-implementation", choices=("cudnn", "xla"),
                        help="of jax.nn.dot_product_attention (default: cudnn on a GPU with 16-bit inputs, else xla)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpt-results"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    run = CONFIGS[args.config]
    overrides = {"steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size,
                 "sliding_window": args.sliding_window}
    run = dataclasses.replace(run, **{k: v for k, v in overrides.items() if v is not None})
    if args.time_budget_s is not None:
        run = dataclasses.replace(run, time_budget_s=args.time_budget_s or None)
    choices = ("ejkernel", "jax") if args.attention == "both" else (args.attention,)

    device = jax.devices()[0]
    result: dict[str, Any] = {
        "config": args.config,
        "device": getattr(device, "device_kind", str(device)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "seq_len": run.seq_len,
        "batch_size": run.batch_size,
        "sliding_window": run.sliding_window,
        "model": dataclasses.asdict(run.model),
        "runs": {},
    }
    for choice in choices:
        result["runs"][choice] = train(run, choice, progress=not args.no_progress, platform=args.platform,
                                       jax_impl=args.jax_implementation)
    result["params"] = next(iter(result["runs"].values()))["params"]
    if len(choices) == 2:
        a, b = (result["runs"][c]["loss"] for c in choices)
        n = min(len(a), len(b))
        result["max_loss_difference"] = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
        result["speedup_ejkernel_vs_jax"] = result["runs"]["ejkernel"]["tokens_per_s"] / result["runs"]["jax"]["tokens_per_s"]

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"train_gpt-{args.config}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{stem}.png")
    for choice, r in result["runs"].items():
        print(f"{r['attention']:<60} {r['tokens_per_s']:>12,.0f} tokens/s  step {r['step_time_s_median'] * 1e3:8.1f} ms"
              f"  loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f} ({r['steps']} steps{', stopped early' if r['stopped_early'] else ''})")
    print(f"wrote {args.out / stem}.json and .png")
    return result


if __name__ == "__main__":
    main()
