"""Validated autotuning: wrong or failing candidates never win, budgets, logging, inputs, jit."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_toy_kernels import SpecVjpKernel, ToyConfig, ToyMatmul, random_inputs

from ejkernel.ops import (
    AutotunePolicy,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Tuner,
    autotune,
    benchmark,
)
from ejkernel.ops.execution.tuning import tuning_inputs

FAST = Tuner(warmup=1, iters=3, progress=False)


def by_cfg(result):
    return {c.cfg: c for c in result.candidates}


def test_fast_but_wrong_candidate_never_wins():
    kernel = ToyMatmul(space=(ToyConfig(block=64), ToyConfig(wrong=True)))
    x, w = random_inputs(m=128, k=256, n=256)
    result = FAST.tune(Invocation(kernel, (x, w)), kernel.space)
    outcome = by_cfg(result)
    wrong = outcome[ToyConfig(wrong=True)]
    assert wrong.status == "rejected" and "relative max error" in wrong.reason
    assert result.best in (ToyConfig(block=8), ToyConfig(block=64))
    assert wrong.time_ms < result.best_time_ms  # it really was faster, and still lost


def test_failing_candidates_are_skipped_with_their_reason_logged(caplog):
    caplog.set_level(logging.INFO, logger="ejkernel.ops.autotune")
    kernel = ToyMatmul()
    x, w = random_inputs()
    result = FAST.tune(Invocation(kernel, (x, w)), kernel.config_space(None))
    outcome = by_cfg(result)
    assert outcome[ToyConfig(fail="compile")].status == "failed"
    assert "compile: ValueError: block 8 does not fit" in outcome[ToyConfig(fail="compile")].reason
    assert outcome[ToyConfig(block=32, fail="run")].status == "failed"
    assert "run:" in outcome[ToyConfig(block=32, fail="run")].reason
    assert result.best in (ToyConfig(block=8), ToyConfig(block=4), ToyConfig(block=16))
    logged = caplog.text
    assert "does not fit" in logged and "out of memory" in logged


def test_wrong_gradient_is_rejected():
    kernel = SpecVjpKernel()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    result = FAST.tune(Invocation(kernel, (x, x + 1)), kernel.config_space(None))
    outcome = by_cfg(result)
    assert outcome[ToyConfig(block=4)].status == "ok"
    rejected = outcome[ToyConfig(block=4, wrong=True)]
    assert rejected.status == "rejected" and rejected.reason.startswith("gradient")
    assert result.best != ToyConfig(block=4, wrong=True)


def test_budgets_prune_and_stop():
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(block=16)))
    inv = Invocation(kernel, random_inputs())
    pruned = by_cfg(FAST.tune(inv, kernel.space, policy=AutotunePolicy(max_candidates=2)))
    assert pruned[ToyConfig(block=16)].status == "skipped" and "max_candidates" in pruned[ToyConfig(block=16)].reason
    timed_out = FAST.tune(inv, kernel.space, policy=AutotunePolicy(time_budget_s=1e-9))
    statuses = [c.status for c in timed_out.candidates]
    assert statuses == ["ok", "skipped", "skipped"] and timed_out.best == ToyConfig(block=8)


def test_tuning_inputs_are_fresh_random_concrete_values():
    kernel = ToyMatmul()
    lengths = jnp.array([3, 1], jnp.int32)
    inv = Invocation(
        kernel,
        (jax.ShapeDtypeStruct((4, 3), jnp.bfloat16), jnp.zeros((3, 2), jnp.float32)),
        {"lengths": lengths, "count": jax.ShapeDtypeStruct((2,), jnp.int32), "scale": 0.5},
    )
    (a, b), kwargs = tuning_inputs(inv)
    for array, dtype in ((a, jnp.bfloat16), (b, jnp.float32)):
        assert isinstance(array, jax.Array) and array.dtype == dtype and not isinstance(array, jax.core.Tracer)
        assert np.all(np.asarray(array, np.float32) != 0) or np.std(np.asarray(array, np.float32)) > 0.1
    assert np.any(np.asarray(b) != 0)  # a zeros input is replaced
    assert kwargs["lengths"] is lengths and kwargs["scale"] == 0.5  # concrete ints keep their meaning
    assert kwargs["count"].shape == (2,) and np.all(np.asarray(kwargs["count"]) > 0)


def test_autotune_under_jit_stores_the_winner_and_traces_once():
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(wrong=True)))
    chain = ConfigSelectorChain(
        cache=ConfigCache(), policy=AutotunePolicy(allow_autotune=True), tuner=FAST, shipped=False
    )
    executor = Executor(chain)
    x, w = random_inputs()
    out = jax.jit(lambda x, w: executor(kernel, x, w))(x, w)
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-5)
    key = executor.invocation(kernel, x, w).cache_key
    assert chain.cache.get(key) in (ToyConfig(block=4), ToyConfig(block=8))


def test_autotune_log_env_reports_every_candidate(monkeypatch, capsys):
    monkeypatch.setenv("EJKERNEL_LOG_AUTOTUNE", "1")
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(wrong=True)))
    FAST.tune(Invocation(kernel, random_inputs()), kernel.space)
    err = capsys.readouterr().err
    assert err.count("[ejkernel autotune] toy_matmul: ToyConfig(") >= 3
    assert "ms" in err and "rejected" in err


def test_progress_line_only_when_asked_or_on_a_terminal(capsys):
    kernel = ToyMatmul(space=(ToyConfig(block=4),))
    inv = Invocation(kernel, random_inputs())
    FAST.tune(inv, kernel.space)  # stderr is not a terminal under pytest: quiet
    assert "autotuning" not in capsys.readouterr().err
    Tuner(warmup=0, iters=1, progress=True).tune(inv, kernel.space)
    assert "[ejkernel] autotuning toy_matmul: 1/2 candidates" in capsys.readouterr().err


def test_autotune_and_benchmark_functions():
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(wrong=True)))
    x, w = random_inputs()
    inv = Invocation(kernel, (x, w))
    best = autotune(kernel, x, w, configs=kernel.config_space(inv), num_warmup=1, num_iters=2)
    assert best in (ToyConfig(block=4), ToyConfig(block=8))
    time_ms = benchmark(lambda: kernel(x, w), num_iters=3)
    assert isinstance(time_ms, float) and time_ms > 0
    with pytest.raises(ValueError, match="num_iters"):
        benchmark(lambda: None, num_iters=0)


def test_bfloat16_candidates_are_compared_as_floats_and_get_gradients():
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(block=16), ToyConfig(wrong=True)))
    x, w = random_inputs(m=32, k=64, n=16, dtype=jnp.bfloat16)
    outcome = by_cfg(FAST.tune(Invocation(kernel, (x, w)), kernel.space))
    assert outcome[ToyConfig(block=4)].status == outcome[ToyConfig(block=16)].status == "ok"  # rounding differs
    assert outcome[ToyConfig(wrong=True)].status == "rejected"
    vjp_kernel = SpecVjpKernel()
    a = jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.bfloat16)
    grads = jax.grad(lambda a: jnp.sum(vjp_kernel(a, a * 2).astype(jnp.float32)))(a)
    assert grads.dtype == jnp.bfloat16 and np.allclose(
        np.asarray(grads, np.float32), np.asarray(a * 4, np.float32), rtol=2e-2
    )
    rejected = by_cfg(FAST.tune(Invocation(vjp_kernel, (a, a)), vjp_kernel.config_space(None)))
    assert rejected[ToyConfig(block=4, wrong=True)].status == "rejected"
