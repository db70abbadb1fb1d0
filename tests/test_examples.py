"""The examples run on the CPU in their tiny configurations (examples/README.md): training the GPT with
ejkernel's flash attention and with jax.nn.dot_product_attention gives the same falling loss curve, and
generation through the paged KV cache gives the logits of a cache-free rerun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax  # noqa: F401  (read by the skipif condition below)
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("flax", reason="examples/ need the workspace's dev dependencies (uv sync)")

import paged_generation  # noqa: E402
import report  # noqa: E402
import train_gpt  # noqa: E402

# The tiny configurations compare float32 runs on the CPU; on a GPU (whose float32 matmuls may be TF32 and
# where cuDNN needs 16-bit inputs) scripts/device/run_examples.sh runs the gpu-100m ones instead.
cpu_only = pytest.mark.skipif("jax.default_backend() != 'cpu'", reason="tiny float32 configs are checked on the CPU")


@cpu_only
def test_train_gpt_tiny_both_attention_choices_agree_and_learn(tmp_path):
    result = train_gpt.main(["--config", "tiny", "--sliding-window", "24", "--no-progress", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "train_gpt-tiny.json").read_text())
    assert saved["runs"].keys() == {"ejkernel", "jax"} and saved == json.loads(json.dumps(result))
    assert (tmp_path / "train_gpt-tiny.png").read_bytes().startswith(b"\x89PNG")
    steps = train_gpt.CONFIGS["tiny"].steps
    for run in result["runs"].values():
        loss = run["loss"]
        assert run["steps"] == len(loss) == steps and not run["stopped_early"]
        assert sum(loss[-5:]) / 5 < loss[0] - 1.0, loss  # it learns (from ~6 nats/byte)
        assert run["tokens_per_s"] > 0 and run["step_time_s_median"] > 0
    assert "flash_attention" in result["runs"]["ejkernel"]["attention"]
    assert 'implementation="xla"' in result["runs"]["jax"]["attention"]
    # same weights, same batches, float32: the two attention implementations agree to rounding, every step
    assert result["max_loss_difference"] < 1e-4, result["max_loss_difference"]

    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{report.START}\nold\n{report.END}\nafter\n")
    report.main([str(tmp_path / "train_gpt-tiny.json"), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith(f"before\n{report.START}\nTraining, `tiny`") and text.endswith(f"{report.END}\nafter\n")
    assert "| ejkernel.modules.flash_attention (platform xla) |" in text and "old" not in text


def test_gpu_config_is_a_100m_model_at_long_sequence():
    run = train_gpt.CONFIGS["gpu-100m"]
    assert 4096 <= run.seq_len <= 8192 and 200 <= run.steps
    from flax import nnx

    abstract = nnx.eval_shape(lambda: train_gpt.GPT(run.model, rngs=nnx.Rngs(0)))
    assert 90e6 < train_gpt.num_params(abstract) < 110e6


@cpu_only
def test_paged_generation_tiny_matches_full_recompute(tmp_path):
    result = paged_generation.main(["--config", "tiny", "--op", "both", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "paged_generation-tiny.json").read_text())["runs"].keys() == {"page", "ragged"}
    page, ragged = result["runs"]["page"], result["runs"]["ragged"]
    for run in (page, ragged):
        assert run["max_relative_logits_error_vs_full_recompute"] < 1e-5
        assert run["tokens_per_s"] > 0
    assert page["sample"] == ragged["sample"]  # the same greedy tokens through either cache layout
    assert "| ragged_page_attention (prefill and decode) | 4 x 6 |" in report.table([result])
