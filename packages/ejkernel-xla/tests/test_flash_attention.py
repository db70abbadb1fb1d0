"""XLA ``flash_attention`` against the shared conformance suite on both of its paths (dense and blockwise,
each forced), plus XLA-specific checks: the switch between the paths, the precision reaching the compiled
program, every feature across block borders (small, non-dividing blocks), block-size invariance, the
reusable block steps of ``_blockwise`` (ring attention composes them), and the blockwise path's memory
growing with S, not S²."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import flash_attention
from ejkernel_xla import flash_attention as xla_flash
from ejkernel_xla.flash_attention import XlaFlashConfig
from ejkernel.testing.flash_attention import (
    FlashAttentionConformance,
    attention_inputs,
    reference_flash_attention_numpy,
)
from ejkernel.testing.numerics import assert_close
from ejkernel_xla import _blockwise

# Blocks smaller than the test sequences and not dividing them: every case crosses block borders.
SMALL_BLOCKS = XlaFlashConfig(block_q=16, block_kv=24, bwd_block_q=24, bwd_block_kv=16)


class TestXlaFlashAttentionDense(FlashAttentionConformance):
    """The whole suite on the dense path (what the rule picks on a GPU for these shapes)."""

    platform = "xla"
    cfg = XlaFlashConfig(dense=True)


class TestXlaFlashAttentionBlockwise(FlashAttentionConformance):
    """The whole suite on the blockwise path with the heuristic blocks (512: short sequences are one block,
    1000 is two; what the rule picks on CPU)."""

    platform = "xla"
    cfg = XlaFlashConfig(dense=False)
    verify_reference = False  # backend-independent: the dense class runs it


class _SmallBlocks(FlashAttentionConformance):
    __test__ = False
    platform = "xla"
    cfg = SMALL_BLOCKS


def _varlen(inputs):
    inputs["cum_seqlens_q"] = jnp.asarray([0, 7, 7, 30, 41], jnp.int32)
    inputs["cum_seqlens_k"] = jnp.asarray([0, 12, 15, 38, 50], jnp.int32)
    return inputs


def _mask_and_segments(inputs):
    rng = np.random.default_rng(3)
    mask = rng.random((2, 1, 45, 61)) > 0.3
    mask[:, :, [0, 20]] = False
    inputs["attention_mask"] = jnp.asarray(mask)
    inputs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, 45)), axis=1), jnp.int32)
    inputs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, 61)), axis=1), jnp.int32)
    return inputs


MULTI_BLOCK_CASES = {
    "causal-gqa-bf16": (dict(batch=2, q_len=45, kv_len=61, num_heads=4, num_kv_heads=2, dtype=jnp.bfloat16),
                        dict(causal=True), None),
    "window-bias-sinks-softcap": (dict(batch=2, q_len=45, kv_len=61, num_heads=4, num_kv_heads=1,
                                       bias_shape=(1, 4, 45, 61), num_sinks=2),
                                  dict(sliding_window=(7, 3), logits_soft_cap=5.0), None),
    "mask-segments-dropout": (dict(batch=2, q_len=45, kv_len=61, num_heads=2),
                              dict(causal=True, dropout_prob=0.2, dropout_seed=4), _mask_and_segments),
    "varlen": (dict(batch=1, q_len=45, kv_len=53, num_heads=4, num_kv_heads=2), dict(causal=True), _varlen),
    "one-query": (dict(batch=1, q_len=1, kv_len=100, num_heads=2), dict(causal=True), None),
}


@pytest.mark.parametrize("case", list(MULTI_BLOCK_CASES))
def test_features_across_block_borders(case):
    shapes, kwargs, extra = MULTI_BLOCK_CASES[case]
    inputs = attention_inputs(hash(case) % 1000, head_dim=32, **shapes)
    if extra is not None:
        inputs = extra(inputs)
    _SmallBlocks().run_and_compare(inputs, **kwargs)


def test_block_sizes_do_not_change_the_result():
    inputs = attention_inputs(0, batch=1, q_len=70, kv_len=90, num_heads=2, head_dim=32)
    expected, _, _ = reference_flash_attention_numpy(**inputs, causal=True, sliding_window=(40, 3))
    for blocks in [(None, None), (16, 24), (1, 7), (70, 90), (64, 128)]:
        cfg = XlaFlashConfig(block_q=blocks[0], block_kv=blocks[1])
        out = flash_attention(**inputs, causal=True, sliding_window=(40, 3), cfg=cfg, platform="xla")
        assert_close(out, expected, dtype=jnp.float32, name=f"blocks={blocks}")


def test_block_steps_compose_like_ring_attention():
    """forward_block over two kv shards + combine == the whole; backward_block sums to the full grads."""
    inputs = attention_inputs(1, batch=2, q_len=12, kv_len=20, num_heads=4, num_kv_heads=2, head_dim=16)
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    # float32 at full precision (the blocks run at the precision their params carry; GPUs default to TF32)
    params = _blockwise.AttentionParams(softmax_scale=0.25, causal=True, precision=jax.lax.Precision.HIGHEST)
    q_tok = _blockwise.query_tokens(2, 12, 20)
    kv_tok = _blockwise.key_tokens(2, 20)
    with params.matmuls():  # the blocks run inside their caller's precision scope (ring_attention's)
        shards = [(0, 9), (9, 11)]
        out, lse = None, None
        for start, size in shards:
            part = _blockwise.forward_block(
                q, k[:, start : start + size], v[:, start : start + size], q_tok,
                _blockwise.slice_tokens(kv_tok, start, size), params,
            )
            out, lse = part if out is None else _blockwise.combine(out, lse, *part)
        d_out = jax.random.normal(jax.random.key(5), out.shape)
        expected, _, grads = reference_flash_attention_numpy(q, k, v, causal=True, softmax_scale=0.25, d_out=d_out)
        assert_close(out, expected, dtype=jnp.float32)

        delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out)
        dq, dks, dvs = jnp.zeros(q.shape), [], []
        for start, size in shards:
            dq_part, dk, dv, _ = _blockwise.backward_block(
                q, k[:, start : start + size], v[:, start : start + size], d_out, lse, delta, q_tok,
                _blockwise.slice_tokens(kv_tok, start, size), params,
            )
            dq, dks, dvs = dq + dq_part, dks + [dk], dvs + [dv]
        for got, name in zip((dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)), ("query", "key", "value")):
            assert_close(got, grads[name], dtype=jnp.float32, gradient=True, name=f"d{name}")


def _compiled_temp_bytes(seq_len: int, *, backward: bool, heads=1, head_dim=64) -> int:
    shape = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), jnp.float32)

    def forward(q, k, v):  # the O(S) path, whatever the rule would pick on this device
        return flash_attention(q, k, v, causal=True, cfg=XlaFlashConfig(dense=False))

    fn = jax.grad(lambda q, k, v: forward(q, k, v).sum(), argnums=(0, 1, 2)) if backward else forward
    return jax.jit(fn).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_memory_grows_with_s_not_s_squared(backward):
    """Blockwise path: compiled temp memory at S=32k (CPU) is a tiny fraction of one S x S float32 logits matrix (4 GiB)
    and grows linearly: 4x the length costs at most ~4x the memory (numbers: docs/xla_memory.md)."""
    seq_len = 32768
    temp_32k = _compiled_temp_bytes(seq_len, backward=backward)
    temp_8k = _compiled_temp_bytes(seq_len // 4, backward=backward)
    naive_logits = seq_len * seq_len * 4
    print(f"temp bytes: S=8k {temp_8k:,}  S=32k {temp_32k:,}  one naive S x S float32 matrix {naive_logits:,}")
    assert temp_32k < naive_logits / 50
    assert temp_32k <= 4.5 * temp_8k


def test_spec_example_runs_unchanged():
    """The project overview's usage example: no dropout_seed given, so the documented default seed 0."""
    import warnings

    from ejkernel.modules import FlashAttention, create_default_executor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        executor = create_default_executor()
    attention = FlashAttention()
    batch, seq_len, num_heads, head_dim = 2, 1024, 8, 64
    key = jax.random.PRNGKey(0)
    q = k = v = jax.random.normal(key, (batch, seq_len, num_heads, head_dim))
    output = executor(attention, q, k, v, causal=True, dropout_prob=0.1, logits_soft_cap=30.0)
    assert output.shape == (batch, seq_len, num_heads, head_dim)
    again = flash_attention(q, k, v, causal=True, dropout_prob=0.1, logits_soft_cap=30.0, dropout_seed=0)
    np.testing.assert_array_equal(np.asarray(output), np.asarray(again))


# ---- the switch between the paths -------------------------------------------------------------------

GiB = 2**30


def _abstract_call(batch, seq, heads=16, head_dim=128, dtype=jnp.bfloat16):
    from ejkernel.modules.operations.flash_attention import FlashAttentionCall

    x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
    return FlashAttentionCall(query=x, key=x, value=x)


def _budget(monkeypatch, budget):
    """Pretend the device lets the dense path's S² buffers take ``budget`` bytes (None: a CPU), with a fresh
    default executor (rebuilt lazily, the previous one restored after the test): the heuristic config,
    resolved by the rule, is kept per call by the executor, so one made under another budget must not serve."""
    from ejkernel.ops.execution import executor

    monkeypatch.setattr(xla_flash, "dense_budget_bytes", lambda platform=None: budget)
    monkeypatch.setattr(executor, "_default", None)


def test_rule_on_the_logits_bytes():
    """Standard benchmark shapes (bf16, 16 heads, batch * seq = 16384) with an H200's budget (half of the
    ~105 GiB JAX may allocate): dense up to S=16k (12 bytes per logit as one call; 28 GiB at S=16k in two
    query chunks); S=64k
    (768 GiB) stays blockwise; float32 counts 16 bytes per logit; no budget (CPU): never dense."""
    budget = int(0.5 * 105 * GiB)
    for seq in (1024, 2048, 4096, 8192, 16384):
        call = _abstract_call(16384 // seq, seq)
        chunks = -(-seq // 8192)  # query chunks of <= 8192 rows (_dense.FULL_CHUNK_QUERIES): one chunk's transients
        assert xla_flash.dense_peak_bytes(call) == (16384 // seq) * 16 * seq * seq * (2 + 10 // chunks)
        assert xla_flash.dense_fits(call, budget), seq
    assert not xla_flash.dense_fits(_abstract_call(1, 65536), budget)
    assert xla_flash.dense_peak_bytes(_abstract_call(1, 4096, dtype=jnp.float32)) == 16 * 4096 * 4096 * 16
    assert not xla_flash.dense_fits(_abstract_call(1, 128), None)
    assert xla_flash.dense_budget_bytes("cpu") is None


def test_config_decides_before_the_rule(monkeypatch):
    call = _abstract_call(1, 1024)
    _budget(monkeypatch, 1 << 40)
    assert xla_flash.takes_dense_path(call, XlaFlashConfig())
    assert not xla_flash.takes_dense_path(call, XlaFlashConfig(dense=False))
    assert not xla_flash.takes_dense_path(call, XlaFlashConfig(block_q=256))  # block sizes select blockwise
    _budget(monkeypatch, None)
    assert not xla_flash.takes_dense_path(call, XlaFlashConfig())
    assert xla_flash.takes_dense_path(call, XlaFlashConfig(dense=True))


@pytest.mark.parametrize("budget,program", [(1 << 40, "_dense_primal"), (None, "_flash_primal")], ids=["gpu", "cpu"])
def test_default_config_traces_the_path_of_the_rule(monkeypatch, budget, program):
    _budget(monkeypatch, budget)
    x = jax.ShapeDtypeStruct((1, 72, 2, 16), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: flash_attention(q, k, v, causal=True, platform="xla"))(x, x, x))
    assert f"name={program}" in jaxpr


def test_forward_only_rule(monkeypatch):
    """Where the dense forward fits (``B*H*Sq*Skv * (4 + itemsize)``) but its forward+backward does not, a
    forward that is not differentiated runs dense and a differentiated one blockwise (forward and backward:
    the residuals come from the blockwise forward); ``dense=False`` still forces blockwise throughout."""
    call = _abstract_call(1, 72, heads=2, head_dim=16, dtype=jnp.float32)
    assert xla_flash.dense_forward_peak_bytes(call) == 2 * 72 * 72 * 8
    _budget(monkeypatch, xla_flash.dense_forward_peak_bytes(call))  # the forward fits, forward+backward not
    assert xla_flash.takes_dense_path(call, XlaFlashConfig(), differentiated=False)
    assert not xla_flash.takes_dense_path(call, XlaFlashConfig())
    assert not xla_flash.takes_dense_path(call, XlaFlashConfig(dense=False), differentiated=False)

    x = jax.ShapeDtypeStruct((1, 72, 2, 16), jnp.float32)
    forward = lambda q, k, v, cfg=None: flash_attention(q, k, v, causal=True, platform="xla", cfg=cfg)  # noqa: E731
    assert "name=_dense_primal_blockwise_vjp" in str(jax.make_jaxpr(forward)(x, x, x))
    assert "name=_flash_primal" in str(jax.make_jaxpr(lambda *a: forward(*a, cfg=XlaFlashConfig(dense=False)))(x, x, x))
    # not differentiated: exactly the dense path's program; differentiated: exactly the blockwise path's
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 72, 2, 16), jnp.float32) for key in keys)
    dense = jax.jit(lambda *a: forward(*a, cfg=XlaFlashConfig(dense=True)))(q, k, v)
    np.testing.assert_array_equal(jax.jit(forward)(q, k, v), dense)
    loss = lambda cfg: lambda *a: (forward(*a, cfg=cfg) * a[0]).sum()  # noqa: E731
    grads = jax.jit(jax.value_and_grad(loss(None), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.value_and_grad(loss(XlaFlashConfig(dense=False)), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)


def test_candidate_configs_offer_both_paths_where_dense_fits(monkeypatch):
    call = _abstract_call(1, 1024)
    _budget(monkeypatch, 1 << 40)
    assert xla_flash.IMPLEMENTATION.candidate_configs(call) == [
        XlaFlashConfig(dense=True, forward_dense=True),
        XlaFlashConfig(block_q=512, block_kv=512, bwd_block_q=512, bwd_block_kv=512, dense=False, forward_dense=False),
    ]
    _budget(monkeypatch, None)
    assert xla_flash.IMPLEMENTATION.candidate_configs(call) == []


def _unresolved(config) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(config) if getattr(config, f.name) is None]


def test_heuristic_config_is_the_path_and_blocks_that_run(monkeypatch):
    """The heuristic config says what runs: the rule's path (differentiated and not) and, where a blockwise
    loop runs, every block size (a dense config runs none); a partial user config resolves the same way."""
    blockwise = dict(block_q=512, block_kv=512, bwd_block_q=512, bwd_block_kv=512)
    wide = _abstract_call(1, 1000, heads=2, head_dim=192, dtype=jnp.float32)  # 256-blocks for head_dim > 128
    short = _abstract_call(1, 72, heads=2, head_dim=16, dtype=jnp.float32)
    heuristic = xla_flash.IMPLEMENTATION.heuristic_config
    _budget(monkeypatch, None)  # a CPU: blockwise throughout
    assert heuristic(_abstract_call(1, 1024)) == XlaFlashConfig(**blockwise, dense=False, forward_dense=False)
    assert heuristic(wide) == XlaFlashConfig(256, 256, 256, 256, dense=False, forward_dense=False)
    assert heuristic(short) == XlaFlashConfig(72, 72, 72, 72, dense=False, forward_dense=False)
    _budget(monkeypatch, 1 << 40)  # dense fits: dense throughout, no blocks run
    assert heuristic(short) == XlaFlashConfig(dense=True, forward_dense=True)
    _budget(monkeypatch, xla_flash.dense_forward_peak_bytes(short))  # only the forward fits
    assert heuristic(short) == XlaFlashConfig(72, 72, 72, 72, dense=False, forward_dense=True)
    for budget in (None, 1 << 40, xla_flash.dense_forward_peak_bytes(short)):
        _budget(monkeypatch, budget)
        for call in (short, wide, _abstract_call(2, 4096)):
            config = heuristic(call)
            assert _unresolved(config) == ([] if not config.dense else list(blockwise)), config
            assert config.resolved(call) == config  # resolved configs are their own
            for candidate in xla_flash.IMPLEMENTATION.candidate_configs(call):
                assert candidate.resolved(call) == candidate
                assert _unresolved(candidate) == ([] if not candidate.dense else list(blockwise))
    # partial user configs: the missing fields as the heuristic's, the given ones kept
    _budget(monkeypatch, None)
    assert XlaFlashConfig(block_q=16).resolved(wide) == XlaFlashConfig(16, 256, 16, 256, False, False)
    assert XlaFlashConfig(dense=False).resolved(wide) == heuristic(wide)
    assert XlaFlashConfig(dense=False, forward_dense=True).resolved(short) == XlaFlashConfig(
        72, 72, 72, 72, dense=False, forward_dense=True)
    _budget(monkeypatch, 1 << 40)
    assert XlaFlashConfig().resolved(short) == heuristic(short)
    assert XlaFlashConfig(block_kv=24).resolved(short) == XlaFlashConfig(72, 24, 72, 24, False, False)
    with pytest.raises(ValueError, match="pass dense too"):
        XlaFlashConfig(forward_dense=True)
    with pytest.raises(ValueError, match="drop forward_dense=False"):
        XlaFlashConfig(dense=True, forward_dense=False)


def test_executor_stores_the_resolved_config(monkeypatch):
    """What the executor keeps for a call is the resolved config it ran (here: blockwise, CPU's rule)."""
    from ejkernel.modules.operations.flash_attention import FlashAttention
    from ejkernel.ops import get_default_executor

    _budget(monkeypatch, None)
    q = jnp.ones((1, 40, 2, 16), jnp.float32)
    flash_attention(q, q, q, causal=True, platform="xla")
    chosen = get_default_executor().choose(FlashAttention(), q, q, q, causal=True, platform="xla")
    assert chosen == XlaFlashConfig(40, 40, 40, 40, dense=False, forward_dense=False)


def test_config_rejects_blocks_with_dense():
    with pytest.raises(ValueError, match="block_q=64"):
        XlaFlashConfig(dense=True, block_q=64)
    with pytest.raises(ValueError, match="dense must be"):
        XlaFlashConfig(dense="yes")


# ---- precision in the compiled program --------------------------------------------------------------


def _dot_precisions(fn, *args) -> list[str]:
    """The operand precision of every ``dot_general`` of ``fn``'s lowered StableHLO (DEFAULT if unset)."""
    import re

    text = jax.jit(fn).lower(*args).as_text()
    found = []
    for dot in re.findall(r"stablehlo\.dot_general[^\n]*", text):
        match = re.search(r"precision = \[(\w+), (\w+)\]", dot)
        found.append(match.groups() if match else ("DEFAULT", "DEFAULT"))
    return found


@pytest.mark.parametrize("cfg", [XlaFlashConfig(dense=True), SMALL_BLOCKS], ids=["dense", "blockwise"])
@pytest.mark.parametrize(
    "dtype,precision,expected",
    [(jnp.float32, None, "HIGHEST"), (jnp.float32, "default", "DEFAULT"), (jnp.float32, "high", "HIGH"),
     (jnp.bfloat16, None, "DEFAULT")],
    ids=["float32", "float32-default", "float32-high", "bfloat16"],
)
def test_precision_reaches_the_lowered_program(cfg, dtype, precision, expected):
    """Every matmul of the lowered program, forward and gradient (the custom VJPs' backward included),
    carries the call's precision: float32 inputs HIGHEST unless asked otherwise (so no TF32 on a GPU)."""
    x = jax.ShapeDtypeStruct((1, 40, 2, 16), dtype)

    def forward(q, k, v):
        return flash_attention(q, k, v, causal=True, precision=precision, cfg=cfg)

    gradient = jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for name, fn, matmuls in (("forward", forward, 2), ("gradient", gradient, 7)):
        found = _dot_precisions(fn, x, x, x)
        assert len(found) >= matmuls, f"{name}: {len(found)} dot_general ops"
        assert set(found) == {(expected, expected)}, f"{name}: {found}"
