"""The README's examples table from the JSON the examples wrote (scripts/device/run_examples.sh's $OUT).

    python examples/report.py OUT/train_gpt-gpu-100m.json OUT/paged_generation-gpu-100m.json          # print
    python examples/report.py OUT/*.json --readme README.md     # replace the block between the markers
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

START, END = "<!-- examples-results:start -->", "<!-- examples-results:end -->"


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        if "batch_size" in result:  # train_gpt
            lines += [
                f"Training, `{result['config']}` ({result['params'] / 1e6:.0f}M parameters, sequence "
                f"{result['seq_len']}, batch {result['batch_size']}) on one **{result['device']}**, {result['date']}, "
                f"jax {result['jax']}:",
                "",
                "| attention | tokens/s | step (median) | first step (compile) | loss first -> last | steps |",
                "|---|---|---|---|---|---|",
            ]
            for run in result["runs"].values():
                lines.append(f"| {run['attention']} | {run['tokens_per_s']:,.0f} | {run['step_time_s_median'] * 1e3:.1f} ms "
                             f"| {run['first_step_s']:.1f} s | {run['loss'][0]:.2f} -> {run['loss'][-1]:.2f} "
                             f"| {run['steps']}{' (time budget)' if run['stopped_early'] else ''} |")
            if "speedup_ejkernel_vs_jax" in result:
                lines += ["", f"ejkernel / jax tokens/s: {result['speedup_ejkernel_vs_jax']:.2f}; largest loss difference "
                              f"between the two curves: {result['max_loss_difference']:.3g}."]
        else:  # paged_generation
            lines += [
                "",
                f"Generation, `{result['config']}` on one **{result['device']}**, {result['date']}:",
                "",
                "| attention | sequences x new tokens | tokens/s (prefill included) | logits vs. cache-free rerun |",
                "|---|---|---|---|",
            ]
            for run in result["runs"].values():
                lines.append(f"| {run['attention']} | {run['num_seqs']} x {run['new_tokens_per_seq']} "
                             f"| {run['tokens_per_s']:,.0f} | {run['max_relative_logits_error_vs_full_recompute']:.1e} |")
        lines.append("")
    return "\n".join(lines).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=pathlib.Path)
    parser.add_argument("--readme", type=pathlib.Path, help=f"replace what stands between {START} and {END}")
    args = parser.parse_args(argv)
    text = table([json.loads(p.read_text()) for p in args.json])
    if args.readme is None:
        print(text)
        return
    readme = args.readme.read_text()
    if START not in readme or END not in readme:
        raise SystemExit(f"{args.readme} has no {START} ... {END} block")
    args.readme.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{text}\n{END}",
                                  readme, flags=re.S))


if __name__ == "__main__":
    main()
