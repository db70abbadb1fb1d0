"""HLO stamps and labels, invocation recording and batch autotuning of recorded calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from ops_toy_kernels import ToyConfig, ToyMatmul, random_inputs

from ejkernel.ops import (
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    PersistentCache,
    Tuner,
    autotune_recorded,
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    get_invocations,
    label,
    labels_to_configs,
    record_invocation,
)


def executor(tmp_path=None):
    return Executor(
        ConfigSelectorChain(
            cache=ConfigCache(),
            persistent=PersistentCache(tmp_path) if tmp_path else None,
            tuner=Tuner(warmup=0, iters=1, progress=False),
            shipped=False,
        )
    )


def test_user_label_in_lowered_and_compiled():
    @label("my_attention")
    def attention(x):
        return jnp.sin(x) * 2

    lowered = jax.jit(attention).lower(jnp.ones(3))
    assert [l.name for l in find_labels_in_lowered(lowered)] == ["my_attention"]
    assert [l.name for l in find_labels_in_lowered(lowered.compile())] == ["my_attention"]
    assert labels_to_configs(find_labels_in_lowered(lowered)) == {}


def test_no_stamp_by_default_or_with_none(monkeypatch):
    ex, kernel = executor(), ToyMatmul()
    lowered = jax.jit(lambda x, w: ex(kernel, x, w)).lower(*random_inputs())
    assert find_labels_in_lowered(lowered) == []
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "none")
    lowered = jax.jit(lambda x, w: ex(kernel, x, w, scale=2.0)).lower(*random_inputs())
    assert find_labels_in_lowered(lowered) == []


def test_hash_stamp_names_kernel_platform_config(monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    ex, kernel = executor(), ToyMatmul()
    x, w = random_inputs()
    lowered = jax.jit(lambda x, w: ex(kernel, x, w, cfg=ToyConfig(block=4))).lower(x, w)
    (stamp,) = find_labels_in_lowered(lowered)
    assert (stamp.name, stamp.platform, stamp.mode) == ("toy_matmul", "xla", "hash")
    assert stamp.config == ToyConfig(block=4)
    assert stamp.cache_key == ex.invocation(kernel, x, w).cache_key
    assert labels_to_configs([stamp]) == {stamp.raw: ToyConfig(block=4)}
    # The compiled program carries it too (op metadata).
    assert find_labels_in_lowered(lowered.compile())[0].raw == stamp.raw


def test_json_stamp_is_self_contained(monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    ex, kernel = executor(), ToyMatmul()
    x, w = random_inputs()
    text = jax.jit(lambda x, w: ex(kernel, x, w, cfg=ToyConfig(block=16))).lower(x, w).as_text(debug_info=True)
    (stamp,) = extract_labels_from_hlo_text(text)
    assert stamp.mode == "json" and stamp.config == ToyConfig(block=16)
    assert stamp.cache_key == ex.invocation(kernel, x, w).cache_key
    assert list(labels_to_configs([text]).values()) == [ToyConfig(block=16)]


def test_recording_env_and_autotune_recorded(monkeypatch, tmp_path):
    monkeypatch.setenv("EJKERNEL_OPS_RECORD", "1")
    ex = executor(tmp_path)
    kernel = ToyMatmul(space=(ToyConfig(block=4), ToyConfig(wrong=True)))
    x, w = random_inputs()
    ex(kernel, x, w)
    ex(kernel, x + 1, w)  # same key: recorded once
    jax.jit(lambda x, w: ex(kernel, x, w))(*random_inputs(m=32))
    recorded = get_invocations()
    assert len(recorded) == 2 and all(isinstance(a, jax.ShapeDtypeStruct) for a in recorded[0].args)
    results = autotune_recorded(executor=ex)
    assert set(results) == {inv.cache_key for inv in recorded}
    assert all(cfg in (ToyConfig(block=4), ToyConfig(block=8)) for cfg in results.values())
    stored = PersistentCache(tmp_path)
    assert all(stored.get(key) == cfg for key, cfg in results.items())


def test_manual_recording_and_autotune_from_hash_labels(monkeypatch):
    ex = executor()
    kernel = ToyMatmul(space=(ToyConfig(block=4),))
    x, w = random_inputs()
    inv = ex.invocation(kernel, x, w)
    record_invocation(kernel, inv)
    assert [i.cache_key for i in get_invocations(kernel)] == [inv.cache_key]
    assert get_invocations("other") == []

    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    labels = find_labels_in_lowered(jax.jit(lambda x, w: ex(kernel, x, w)).lower(x, w))
    results = autotune_recorded(labels, executor=ex)
    assert list(results) == [inv.cache_key]
    assert ex.chooser.cache.get(inv.cache_key) == results[inv.cache_key]
    np.testing.assert_allclose(ex(kernel, x, w), np.asarray(x) @ np.asarray(w), rtol=1e-5)


def test_stamps_never_break_a_call_with_an_unserializable_config(monkeypatch):
    ex, kernel = executor(), ToyMatmul()
    x, w = random_inputs()

    class Opaque:
        block = 8
        wrong = False
        fail = None

    for mode in ("hash", "json"):
        monkeypatch.setenv("EJKERNEL_OPS_STAMP", mode)
        lowered = jax.jit(lambda x, w: ex(kernel, x, w, cfg=Opaque())).lower(x, w)
        (stamp,) = find_labels_in_lowered(lowered)
        assert stamp.name == "toy_matmul" and stamp.mode == mode
