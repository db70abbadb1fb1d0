"""TPU flash attention (Mosaic TPU kernels) run on CPU in interpret mode, against the dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from pallas_test_helpers import abstract_device, equations, flash_call, flash_reference, normal, out_and_grads, rel_err

from ejkernel_pallas import tpu_flash_attention as tpu
from ejkernel_pallas.tpu_flash_attention import TpuFlashBlocks
from ejkernel_pallas.tpu_tiling import TpuTilingError, check_block, sublane_multiple

FWD_TOL, BWD_TOL = 2e-6, 1e-5  # float32 inputs: only summation order differs from the reference


def _kernel(blocks=None, interpret=True):
    """The TPU kernels on the validated call of the public keywords (the heuristic's blocks by default)."""

    def run(q, k, v, bias=None, **kw):
        call = flash_call(q, k, v, bias, **kw)
        return tpu.flash_attention(call, blocks or tpu.IMPLEMENTATION.heuristic_config(call), interpret=interpret)

    return run


def _compare(args, grad_argnums, blocks=None, **kw):
    kernel = _kernel(blocks)

    def call(fn, *arrays):
        full = list(args)
        for i, a in zip(grad_argnums, arrays):
            full[i] = a
        q, k, v, bias, aux = full
        return fn(q, k, v, bias, softmax_aux=aux, **kw)

    picked = [args[i] for i in grad_argnums]
    argnums = tuple(range(len(picked)))
    out, got = out_and_grads(lambda *a: call(kernel, *a), argnums)(*picked)
    expected, want = out_and_grads(lambda *a: call(flash_reference, *a), argnums)(*picked)
    assert rel_err(out, expected) < FWD_TOL
    for index, g, w in zip(grad_argnums, got, want):
        assert g.shape == w.shape
        assert bool(jnp.all(jnp.isfinite(g))), index
        assert rel_err(g, w) < BWD_TOL, (index, rel_err(g, w))


def test_every_feature_in_one_block():
    """Causal + window + soft cap + bias + segments + sinks + dropout + GQA, Sq != Skv, odd lengths."""
    b, sq, skv, h, hkv, d = 2, 40, 56, 4, 2, 32
    ks = jax.random.split(jax.random.key(11), 6)
    q, k, v = normal(ks[0], (b, sq, h, d)), normal(ks[1], (b, skv, hkv, d)), normal(ks[2], (b, skv, hkv, d))
    bias = normal(ks[3], (1, h, sq, skv))
    aux = normal(ks[4], (h, 2))
    q_seg = jnp.broadcast_to((jnp.arange(sq) >= 13).astype(jnp.int32), (b, sq))
    kv_seg = jnp.broadcast_to((jnp.arange(skv) >= 29).astype(jnp.int32), (b, skv))
    _compare(
        (q, k, v, bias, aux), (0, 1, 2, 3, 4),
        softmax_scale=d**-0.5, causal=True, sliding_window=(20, 3), logits_soft_cap=5.0,
        q_segment_ids=q_seg, kv_segment_ids=kv_seg, dropout_prob=0.25, dropout_seed=1234,
    )


def test_many_blocks_skip_hidden_blocks():
    """Several q/kv blocks (different fwd and bwd tilings): static causal/window block skipping."""
    b, sq, skv, h, hkv, d = 1, 200, 264, 4, 1, 64
    ks = jax.random.split(jax.random.key(12), 3)
    q, k, v = normal(ks[0], (b, sq, h, d)), normal(ks[1], (b, skv, hkv, d)), normal(ks[2], (b, skv, hkv, d))
    blocks = TpuFlashBlocks(fwd_q=64, fwd_kv=128, dkv_q=32, dkv_kv=128, dq_q=128, dq_kv=128)
    _compare((q, k, v, None, None), (0, 1, 2), blocks=blocks, softmax_scale=0.2, causal=True, sliding_window=(150, 0))


def test_varlen_and_attention_mask():
    """Packed sequences (cum_seqlens, bottom-right aligned per sequence, trailing padding) + a bool mask."""
    sq, skv, h, d = 30, 40, 2, 32
    ks = jax.random.split(jax.random.key(13), 5)
    q, k, v = normal(ks[0], (1, sq, h, d)), normal(ks[1], (1, skv, h, d)), normal(ks[2], (1, skv, h, d))
    mask = jax.random.bernoulli(ks[3], 0.8, (1, h, sq, skv))
    _compare(
        (q, k, v, None, None), (0, 1, 2), softmax_scale=0.3, causal=True,
        cum_seqlens_q=jnp.array([0, 7, 19, 27], jnp.int32), cum_seqlens_k=jnp.array([0, 12, 20, 38], jnp.int32),
        attention_mask=mask,
    )


def test_fully_masked_rows_are_zero_with_zero_gradients():
    b, s, h, d = 1, 24, 2, 16
    ks = jax.random.split(jax.random.key(14), 3)
    q, k, v = (normal(kk, (b, s, h, d)) for kk in ks)
    q_seg = jnp.full((b, s), 3, jnp.int32)
    kv_seg = jnp.where(jnp.arange(s) < 12, 3, 4)[None].astype(jnp.int32)
    q_seg = q_seg.at[:, 5:9].set(9)  # rows 5..8 see nothing
    fn = lambda q, k, v: _kernel()(  # noqa: E731
        q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_scale=0.25
    )
    out, (dq, dk, dv) = out_and_grads(fn, (0, 1, 2))(q, k, v)
    assert float(jnp.max(jnp.abs(out[:, 5:9]))) == 0.0
    assert bool(jnp.all(jnp.isfinite(dq))) and float(jnp.max(jnp.abs(dq[:, 5:9]))) == 0.0


def test_tpu_faithful_interpreter_finds_no_races():
    """The TPU interpreter with race detection: the fwd/bwd grids have no conflicting accesses."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    b, s, h, d = 1, 16, 2, 128
    ks = jax.random.split(jax.random.key(15), 3)
    q, k, v = (normal(kk, (b, s, h, d)) for kk in ks)
    params = pltpu.InterpretParams(detect_races=True)
    out = _kernel(interpret=params)(q, k, v, softmax_scale=0.1, causal=True)
    assert rel_err(out, flash_reference(q, k, v, softmax_scale=0.1, causal=True)) < FWD_TOL
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


def test_lowers_for_tpu_with_every_feature():
    """Mosaic lowering (jax side) for a v5e at TPU-sized shapes: catches ops Mosaic cannot lower."""
    b, s, h, d = 1, 256, 2, 128
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, h, s, s), jnp.float32)
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def loss(q, bias, seg):
        out = _kernel(interpret=False)(
            q, q, q, bias, q_segment_ids=seg, kv_segment_ids=seg, softmax_scale=0.1, causal=True,
            sliding_window=(64, 0), softmax_aux=jnp.ones((h,)), logits_soft_cap=3.0, dropout_prob=0.1, dropout_seed=1,
        )
        return out.astype(jnp.float32).sum()

    with abstract_device("TPU v5 lite", "tpu"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(q, bias, seg).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dK/dV, dQ


def test_tiling_rules():
    assert sublane_multiple(jnp.float32) == 8 and sublane_multiple(jnp.bfloat16) == 16 and sublane_multiple(jnp.int8) == 32
    check_block("ok", (None, None, 128, 64), (2, 4, 512, 64), jnp.float32)  # whole last dim
    check_block("whole", (None, 1, 40), (2, 1, 40), jnp.int32)  # whole dims are always fine
    with pytest.raises(TpuTilingError, match="multiple of 128"):
        check_block("kv_seg", (None, 1, 64), (2, 1, 256), jnp.int32)
    with pytest.raises(TpuTilingError, match="multiple of 16"):
        check_block("q", (None, None, 8, 128), (1, 1, 64, 128), jnp.bfloat16)
    with pytest.raises(TpuTilingError, match="does not divide"):
        check_block("q", (None, None, 48, 128), (1, 1, 64, 128), jnp.float32)


def test_bad_config_is_refused_before_lowering():
    q = jnp.ones((1, 256, 1, 128), jnp.bfloat16)
    with pytest.raises(TpuTilingError, match=r"TpuFlashBlocks\.fwd_kv=8: .*multiple of 16"):
        _kernel(TpuFlashBlocks(128, 8, 128, 128, 128, 128))(q, q, q)
    with pytest.raises(TpuTilingError, match=r"TpuFlashBlocks\.fwd_kv=64: .*multiple of 128"):
        seg = jnp.zeros((1, 256), jnp.int32)
        _kernel(TpuFlashBlocks(128, 64, 128, 128, 128, 128))(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
    with pytest.raises(ValueError, match="TpuFlashBlocks.dq_kv must be a positive int, got 0"):
        TpuFlashBlocks(128, 128, 128, 128, 128, 0)


def test_heuristic_blocks_tile():
    for sq, skv in ((1, 1), (40, 56), (1000, 3000), (8192, 8192)):
        chosen = tpu.heuristic_blocks(sq, skv)
        assert chosen.fwd_q % 16 == 0 and (chosen.fwd_kv % 128 == 0 or chosen.fwd_kv >= skv)


def test_float32_dots_take_the_calls_precision():
    """Mosaic lowers every precision (DEFAULT, HIGH: bf16x3, HIGHEST: fp32): a float32 call's dots carry
    the call's (HIGHEST by default); 16-bit dots carry none."""

    def dot_precisions(dtype, **kw):
        q = jnp.ones((1, 16, 1, 128), dtype)
        dots = equations(lambda q: _kernel()(q, q, q, **kw), q, primitive="dot_general")
        return {eqn.params["precision"] for eqn in dots}

    highest = (jax.lax.Precision.HIGHEST,) * 2
    assert dot_precisions(jnp.float32) == {highest}
    assert dot_precisions(jnp.float32, precision="high") == {(jax.lax.Precision.HIGH,) * 2}
    assert dot_precisions(jnp.bfloat16, precision="highest") == {None}
