"""The CUDA backend's own Hopper flash attention kernels (``ejkernel_cuda.native_flash``) and how
``flash_attention`` dispatches between them and cuDNN.

CPU: the library the workspace install built (sm_90a SASS with wgmma and TMA instructions), its loading and
FFI registration, every refusal, the config and the dispatcher's choices, the lowering to the custom calls
(jit, vmap folded into the batch, jax.export). GPU (``-m gpu``, on an sm_90 device): the shared
flash-attention conformance suite forced onto the native kernels (bf16 and fp16), and explicit cases (odd
lengths, fully masked rows, GQA/MQA, head dims 64/128) with every gradient against a float64 reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import UnsupportedFeature
from ejkernel.modules import flash_attention
from ejkernel.modules.operations.flash_attention import FlashAttention
from ejkernel.testing.flash_attention import FlashAttentionConformance, reference_flash_attention_numpy
from ejkernel.testing.numerics import assert_close, normal_array
from ejkernel_cuda import _native, native_flash, plugin
from ejkernel_cuda.flash_attention import IMPLEMENTATION as FLASH
from ejkernel_cuda.flash_attention import NATIVE_PRIORITY, CudaFlashConfig
from native_tools import cuobjdump, mnemonics, needs_nvcc, ptxas_kernels, ptxas_report

ON_GPU = jax.default_backend() == "gpu"


def _call(dtype=jnp.bfloat16, q_len=128, kv_len=128, head_dim=64, v_head_dim=None, heads=4, kv_heads=2, **kw):
    q = jnp.zeros((1, q_len, heads, head_dim), dtype)
    k = jnp.zeros((1, kv_len, kv_heads, head_dim), dtype)
    v = jnp.zeros((1, kv_len, kv_heads, v_head_dim or head_dim), dtype)
    return FlashAttention().validate(q, k, v, **kw)


# ---- the library ------------------------------------------------------------------------------------


@needs_nvcc
def test_workspace_install_built_the_library_with_wgmma_and_tma():
    """`uv sync` (scripts/setup.sh) compiles csrc/ with nvcc where nvcc is found: a missing library here is a
    build failure, not a skip. Its sm_90a SASS holds warpgroup MMAs (HGMMA) and TMA loads (UTMALDG)."""
    assert _native.library_missing() is None, _native.library_missing()
    found = mnemonics(cuobjdump("-sass", str(_native.LIBRARY_PATH)))
    assert {"HGMMA", "UTMALDG"} <= found, sorted(found)[:80]
    assert "sm_90a" in cuobjdump("-lelf", str(_native.LIBRARY_PATH))


def test_ptxas_reports_no_spills_for_the_persistent_forward():
    """ptxas's report of forward.cu (the library build's): its 8 kernels (bf16, fp16; D = 64, 128; soft-capped or
    not) at 168 registers with no stack and no spill, and no "Potential Performance Loss": at the one-tile CTA's
    24 producer registers the persistent tile loop spilled 104-152 bytes, hence 40 / 232 (NOTES.md)."""
    report = ptxas_report("flash_attention/forward.cu")
    entries = ptxas_kernels(report, "flash_forward_kernel")
    assert len(entries) == 8, report[-4000:]
    for name, *usage in entries:
        assert usage == [0, 0, 0, 168], (name, usage)
    assert "Potential Performance Loss" not in report, report


def test_ptxas_reports_the_backward_spills_no_more_than_measured():
    """The backward's known spills (NOTES.md: none since dS^T leaves by stmatrix and the steps are counted rather
    than divided; the soft-capped kernels spill in FlashAttention-3's product order, less since the dQ warp issues
    the reduce-adds) as a ceiling per kernel (spill-store bytes: D = 128 0, soft-capped 100; D = 64 0,
    soft-capped 4), and no "Potential Performance Loss": a change that spills more, or makes ptxas serialize the
    wgmma, shows here."""
    ceilings = {(128, False): 0, (128, True): 100, (64, False): 0, (64, True): 4}
    report = ptxas_report("flash_attention/backward.cu")
    entries = ptxas_kernels(report, "flash_backward_kernel")
    assert len(entries) == 4 * 2, report[-4000:]
    for name, stack, stores, loads, registers in entries:
        dim, capped = int(re.search(r"Li(\d+)ELb", name).group(1)), "ELb1E" in name
        assert stores <= ceilings[dim, capped] and registers == 168, (name, stack, stores, loads, registers)
    assert "Potential Performance Loss" not in report, report


def test_library_loads_and_exports_the_ffi_handlers():
    library = ctypes.CDLL(str(_native.LIBRARY_PATH))
    for name in ("EjkFlashForward", "EjkFlashBackward", "EjkPagedForward"):
        assert hasattr(library, name), name
    # with no GPU, the CUDA plugin's handler table takes the registration (or keeps it waiting): no error
    assert _native.registration_failed() is None


def test_a_missing_library_is_reported_with_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(_native, "LIBRARY_PATH", tmp_path / "libejkernel_cuda.so")
    _native._opened.cache_clear()
    try:
        reason = _native.library_missing()
        assert "not built" in reason and "uv sync" in reason and "nvidia-cuda-nvcc" in reason
        (tmp_path / "libejkernel_cuda.so").write_bytes(b"not an ELF file")
        _native._opened.cache_clear()
        assert "fails to load" in _native.library_missing()
    finally:
        _native._opened.cache_clear()


def test_importing_the_package_loads_nothing():
    """The plugin and the binding modules import without opening the library (lazy, side-effect free)."""
    code = ("import sys, ejkernel_cuda.plugin, ejkernel_cuda.flash_attention, ejkernel_cuda.native_flash as n; "
            "assert n._native._opened.cache_info().currsize == 0; "
            "assert 'libejkernel_cuda' not in open('/proc/self/maps').read()")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))


# ---- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,feature", [
    (dict(bias=jnp.zeros((1, 4, 128, 128), jnp.bfloat16)), "bias"),
    (dict(attention_mask=jnp.ones((1, 1, 128, 128), bool)), "attention_mask"),
    (dict(cum_seqlens_q=jnp.array([0, 128], jnp.int32), cum_seqlens_k=jnp.array([0, 128], jnp.int32)),
     "cum_seqlens"),
    (dict(dropout_prob=0.1, dropout_seed=1), "dropout"),
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(head_dim=96), r"head dims \(query, value\) \(96, 96\)"),
    (dict(head_dim=256), r"\(256, 256\)"),
    (dict(head_dim=128, v_head_dim=64), r"\(128, 64\)"),
    (dict(q_len=1, kv_len=1), "one query and one key"),
    (dict(softmax_scale=-0.125), "softmax_scale=-0.125"),
])
def test_refuses_each_feature_it_does_not_implement(kw, feature):
    call = _call(**kw)
    assert re.search(feature, native_flash.refusal(call, check_device=False))
    with pytest.raises(UnsupportedFeature, match=f"cuda native flash attention: .*{feature}"):
        native_flash.check_supported(call, check_device=False)


PACKED = jnp.array([0, 50, 100, 128], jnp.int32)


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True, q_len=77, kv_len=300), dict(sliding_window=(16, 4)), dict(logits_soft_cap=30.0),
    dict(dtype=jnp.float16, head_dim=128, heads=16, kv_heads=1), dict(q_len=1, kv_len=130),
    dict(softmax_aux=jnp.zeros((4,))), dict(softmax_aux=jnp.zeros((4, 2))),
    dict(q_segment_ids=jnp.zeros((1, 128), jnp.int32), kv_segment_ids=jnp.zeros((1, 128), jnp.int32)),
    dict(cum_seqlens_q=PACKED, cum_seqlens_k=PACKED, causal=True),  # one array: packed self-attention
])
def test_takes_the_calls_of_its_contract(kw):
    assert native_flash.refusal(_call(**kw), check_device=False) is None


def test_packed_sequences_run_as_segment_ids():
    """cum_seqlens [0, 3, 3, 7] over 9 tokens: sequences 0 and 2 (1 is empty); the two padding tokens get
    different ids on the query and key side, so they see nothing."""
    cum = jnp.array([0, 3, 3, 7], jnp.int32)
    np.testing.assert_array_equal(native_flash._sequence_ids(cum, 9, outside=-1), [[0, 0, 0, 2, 2, 2, 2, -1, -1]])
    np.testing.assert_array_equal(native_flash._sequence_ids(cum, 9, outside=-2)[0, -2:], [-2, -2])


@pytest.mark.skipif(ON_GPU, reason="the refusals of a machine without a GPU")
def test_without_a_gpu_native_is_refused_with_the_reason():
    soft_capped = _call(logits_soft_cap=30.0)  # cuDNN refuses it: only the native kernels could take it
    assert native_flash.refusal(soft_capped).startswith("no GPU visible")
    with pytest.raises(UnsupportedFeature, match="logits_soft_cap.*cuda native flash attention: no GPU visible"):
        FLASH.supports(soft_capped)
    with pytest.raises(UnsupportedFeature, match="cuda native flash attention: no GPU visible"):
        FLASH(_call(), CudaFlashConfig(kernel="native"))
    assert FLASH.candidate_configs(_call()) == [CudaFlashConfig("cudnn")]
    assert FLASH.priority_for(soft_capped) is None
    # the public function: the backend is unusable here, so "auto" never picks it (XLA runs)
    q = normal_array(0, (1, 64, 2, 64), jnp.bfloat16)
    assert FlashAttention().explain(q, q, q, logits_soft_cap=30.0).platform != "cuda"
    assert flash_attention(q, q, q, logits_soft_cap=30.0).shape == q.shape


@pytest.mark.skipif(ON_GPU, reason="the status of a machine without a GPU")
def test_list_backends_says_why_the_native_kernels_cannot_run(capsys):
    import json

    from ejkernel.cli import main

    assert main(["list-backends", "--json"]) == 0
    cuda = {row["name"]: row for row in json.loads(capsys.readouterr().out)}["cuda"]
    assert cuda["parts"][plugin.NATIVE_PART].startswith("unavailable: no GPU visible")
    assert main(["list-backends"]) == 0
    assert f"cuda: {plugin.NATIVE_PART}: unavailable: no GPU visible" in " ".join(capsys.readouterr().out.split())


def test_unverified_until_a_gpu_run_passes(monkeypatch):
    """The project's rule for kernels no GPU has checked: off unless EJKERNEL_UNVERIFIED_KERNELS=1."""
    monkeypatch.setattr(native_flash, "VERIFIED_ON_GPU", False)
    monkeypatch.delenv("EJKERNEL_UNVERIFIED_KERNELS", raising=False)
    assert "not yet verified on a GPU" in native_flash.usable_here()
    monkeypatch.setenv("EJKERNEL_UNVERIFIED_KERNELS", "1")
    assert "not yet verified" not in (native_flash.usable_here() or "")


# ---- config and dispatch ----------------------------------------------------------------------------


def test_config_validation():
    assert CudaFlashConfig() == CudaFlashConfig("cudnn")
    with pytest.raises(ValueError, match=r"CudaFlashConfig.kernel must be one of \('cudnn', 'native'\), got 'triton'"):
        CudaFlashConfig(kernel="triton")
    with pytest.raises(dataclasses.FrozenInstanceError):
        CudaFlashConfig().kernel = "native"  # frozen: the executor stores configs as-is


def test_dispatch_between_cudnn_and_native(monkeypatch):
    """With the native kernels usable (as on an H100): cuDNN where it takes the call (its rank) unless the native
    kernels measured faster there (head_dim 128), the native kernels, ranked NATIVE_PRIORITY, where only they
    take it; a call neither takes names both reasons."""
    monkeypatch.setattr(native_flash, "usable_here", lambda: None)
    plain, soft_capped = _call(causal=True), _call(logits_soft_cap=30.0)
    assert FLASH.heuristic_config(plain) == CudaFlashConfig("cudnn")  # head_dim 64
    assert FLASH.heuristic_config(_call(causal=True, head_dim=128)) == CudaFlashConfig("native")
    assert FLASH.heuristic_config(_call(head_dim=128)) == CudaFlashConfig("native")
    assert FLASH.candidate_configs(plain) == [CudaFlashConfig("cudnn"), CudaFlashConfig("native")]
    assert FLASH.priority_for(plain) is None  # the backend's 20
    FLASH.supports(soft_capped)
    assert FLASH.heuristic_config(soft_capped) == CudaFlashConfig("native")
    assert FLASH.candidate_configs(soft_capped) == [CudaFlashConfig("native")]
    assert FLASH.priority_for(soft_capped) == NATIVE_PRIORITY
    with pytest.raises(UnsupportedFeature, match="logits_soft_cap is not supported by cuDNN"):
        FLASH(soft_capped, CudaFlashConfig("cudnn"))
    with pytest.raises(UnsupportedFeature, match="cuDNN.*; cuda native flash attention: bias is not supported"):
        FLASH.supports(_call(bias=jnp.zeros((1, 4, 128, 128), jnp.bfloat16)))


# ---- lowering (CPU: the custom calls and their attributes, without running them) --------------------


def _lowered_text(fn, *shapes, export=False):
    if export:
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=native_flash.export_disabled_checks())(*shapes)
        restored = jax.export.deserialize(exported.serialize())
        assert restored.in_avals == exported.in_avals
        return exported.mlir_module()
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("export", [False, True], ids=["jit", "export"])
def test_gradient_lowers_to_the_two_custom_calls(monkeypatch, export):
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)  # lowering needs no registered target
    q = jax.ShapeDtypeStruct((2, 77, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        return native_flash.attention(q, k, v, 0.125, True, (64, 0), 30.0).astype(jnp.float32).sum()

    text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, export=export)
    forward = [line for line in text.splitlines() if "custom_call @EjkFlashForward" in line]
    backward = [line for line in text.splitlines() if "custom_call @EjkFlashBackward" in line]
    assert len(forward) == len(backward) == 1, text[:3000]
    for attribute in ("causal = true", "window_left = 64 : i64", "window_right = 0 : i64",
                      "softcap = 3.000000e+01 : f32", "softmax_scale = 1.250000e-01 : f32"):
        assert attribute in forward[0] and attribute in backward[0], attribute
    assert "-> (tensor<2x77x8x128xbf16>, tensor<2x8x77xf32>, tensor<1xi32>)" in forward[0]  # + the tile counter
    assert ("tensor<2x8x77xf32>, tensor<2x8x77xf32>, tensor<2x8x0xf32>, tensor<2x0xi32>, tensor<2x0xi32>) -> "
            "(tensor<2x77x8x128xbf16>, tensor<2x300x2x128xbf16>" in backward[0])  # no sinks, no segment ids
    assert "tensor<2x8x128x128xf32>)" in backward[0]  # the dQ workspace: 77 queries rounded up to 64-row chunks


def test_sinks_and_segment_ids_reach_both_kernels(monkeypatch):
    """Sinks go to the kernels broadcast over the batch (float32 [B, Hq, n]) and get a gradient (formed in
    JAX from lse and delta); segment ids go as int32 [B, S] and get none."""
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    q = jax.ShapeDtypeStruct((2, 77, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 77, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    segments = jax.ShapeDtypeStruct((2, 77), jnp.int32)

    def loss(q, k, v, sinks, segments):
        out = native_flash.attention(q, k, v, 0.125, True, None, None, sinks=sinks, q_segment_ids=segments,
                                     kv_segment_ids=segments)
        return out.astype(jnp.float32).sum()

    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, sinks, segments)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape, sinks.shape]
    text = _lowered_text(jax.grad(loss, argnums=(0, 3)), q, kv, kv, sinks, segments)
    forward = [line for line in text.splitlines() if "custom_call @EjkFlashForward" in line]
    backward = [line for line in text.splitlines() if "custom_call @EjkFlashBackward" in line]
    assert "tensor<2x8x3xf32>, tensor<2x77xi32>, tensor<2x77xi32>) -> (tensor<2x77x8x64xbf16>" in forward[0]
    assert "tensor<2x8x3xf32>, tensor<2x77xi32>, tensor<2x77xi32>) -> (tensor<2x77x8x64xbf16>" in backward[0]


def test_vmap_folds_into_the_batch_axis(monkeypatch):
    """Two nested vmaps (one over an unmapped key/value) run one launch of batch 3 x 2 x 1, no loop."""
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    q = jax.ShapeDtypeStruct((3, 2, 1, 40, 4, 64), jnp.float16)
    kv = jax.ShapeDtypeStruct((2, 1, 50, 4, 64), jnp.float16)

    def loss(q, k, v):
        return native_flash.attention(q, k, v, 0.1, False, None, None).astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = _lowered_text(jax.vmap(jax.vmap(grad, in_axes=(0, 0, 0)), in_axes=(0, None, None)), q, kv, kv)
    assert "custom_call @EjkFlashForward" in text and "tensor<6x40x4x64xf16>" in text
    assert "stablehlo.while" not in text
    assert "window_left = -1 : i64" in text and "softcap = 0.000000e+00 : f32" in text


def test_batches_past_the_grid_limit_run_in_chunks(monkeypatch):
    """The kernels' grids hold at most 65535 batch rows: a larger (here vmap-folded) batch runs in launches of
    that many, forward and backward."""
    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    q = jax.ShapeDtypeStruct((3, 30000, 2, 1, 64), jnp.bfloat16)  # 90,000 once folded

    def loss(q):
        return native_flash.attention(q, q, q, 0.125, True, None, None).astype(jnp.float32).sum()

    text = _lowered_text(jax.vmap(jax.grad(loss)), q)
    forward = [line for line in text.splitlines() if "custom_call @EjkFlashForward" in line]
    backward = [line for line in text.splitlines() if "custom_call @EjkFlashBackward" in line]
    assert len(forward) == len(backward) == 2, (len(forward), len(backward))
    assert "tensor<65535x2x1x64xbf16>" in forward[0] and "tensor<24465x2x1x64xbf16>" in forward[1]


def test_gradient_inside_shard_map_lowers(monkeypatch):
    """Per-shard arrays vary over the mesh axis: the FFI results must too (the custom VJP checks the types)."""
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(_native, "ensure_registered", lambda: None)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(q, k, v):
        return native_flash.attention(q, k, v, 0.125, True, None, None).astype(jnp.float32).sum()

    grad = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    text = _lowered_text(grad, q, q, q)
    assert "custom_call @EjkFlashForward" in text and "custom_call @EjkFlashBackward" in text


# ---- GPU --------------------------------------------------------------------------------------------


def _native_or_skip():
    """On an sm_90 GPU: run (a missing library fails the tests); elsewhere: skip naming the GPU."""
    reason = native_flash.device_refusal()
    if reason is not None:
        pytest.skip(reason)


gpu = pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU"))


@pytest.fixture
def native_gpu():
    _native_or_skip()
    assert native_flash.usable_here() is None, native_flash.usable_here()


@gpu
@pytest.mark.usefixtures("native_gpu")
class TestNativeFlashAttentionConformance(FlashAttentionConformance):
    """The shared suite forced onto the native kernels, in bfloat16. The suite's head_dim-32 inputs are
    widened to 64 (the kernels' smallest; the reference sees the same widened arrays), so its length, GQA,
    window and scale cases run here instead of being refused; what the kernels refuse (bias, masks, varlen,
    dropout, unequal head dims) is reported as skips naming the reason."""

    platform = "cuda"
    cfg = CudaFlashConfig(kernel="native")
    input_dtype = jnp.bfloat16
    allow_unsupported = True
    verify_reference = False

    def in_input_dtype(self, inputs):
        inputs = super().in_input_dtype(inputs)
        if inputs["query"].shape[-1] == inputs["value"].shape[-1] == 32:
            for name in ("query", "key", "value"):
                x = inputs[name]
                inputs[name] = jnp.concatenate([x, -x[..., ::-1]], axis=-1)  # new columns, not copies
        return inputs


@gpu
class TestNativeFlashAttentionConformanceFloat16(TestNativeFlashAttentionConformance):
    input_dtype = jnp.float16


SINKS_8x2 = np.linspace(-1.0, 2.0, 16, dtype=np.float32).reshape(8, 2)
SINKS_4 = np.float32([0.5, -1.0, 3.0, 0.0])
SEGMENTS_300 = np.repeat(np.int32([0, 1, 2]), [100, 150, 50])[None].repeat(2, axis=0)  # three packed sequences
CUM_300 = np.int32([0, 100, 250, 280])  # one array for queries and keys: packed self-attention


def _inputs(seed, b, sq, sk, h, hkv, d, dtype):
    shapes = [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)]
    return [normal_array((seed, i), shape, dtype) for i, shape in enumerate(shapes)]


@gpu
@pytest.mark.usefixtures("native_gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("b,sq,sk,h,hkv,d,kw", [
    (1, 1000, 1000, 4, 4, 128, dict()),
    (2, 77, 300, 4, 2, 64, dict(causal=True)),
    (1, 1000, 1000, 16, 4, 128, dict(causal=True, sliding_window=(100, 0))),  # GQA 16/4
    (2, 257, 257, 8, 1, 64, dict(logits_soft_cap=20.0)),  # MQA
    (1, 300, 77, 4, 2, 128, dict(causal=True)),  # the first 223 rows see no key: out 0, gradients 0
    (1, 256, 64, 4, 2, 64, dict(sliding_window=(0, 10))),  # the window leaves rows 0..181 empty
    (1, 200, 200, 4, 2, 64, dict(sliding_window=(3, 5))),  # windows reaching right
    (2, 1, 130, 4, 2, 128, dict(causal=True)),  # one query row (decoding); Sq = Sk = 1 has dq = dk = 0 exactly
    (1, 300, 300, 8, 2, 128, dict(causal=True, softmax_aux=SINKS_8x2)),  # two sinks per head, GQA
    (1, 256, 64, 4, 2, 64, dict(sliding_window=(0, 10), softmax_aux=SINKS_4)),  # empty rows see the sinks only
    (2, 300, 300, 4, 2, 64, dict(causal=True, q_segment_ids=SEGMENTS_300, kv_segment_ids=SEGMENTS_300)),
    (1, 300, 300, 8, 2, 128, dict(causal=True, cum_seqlens_q=CUM_300, cum_seqlens_k=CUM_300)),  # 20 padding tokens
    # causal tile orders in sections of 3 of the 4 (head, batch) pairs and one of 1 (tile_at): the forward's over
    # 10240 keys (5 MB of K/V per pair), the backward's over 5120 query rows (Q, dO and dQ: 5 MB per pair)
    (2, 300, 10240, 2, 2, 128, dict(causal=True)),
    (2, 5120, 300, 2, 2, 128, dict(causal=True)),
])
def test_explicit_cases_against_float64(dtype, b, sq, sk, h, hkv, d, kw):
    q, k, v, do = _inputs(sq * 7 + sk, b, sq, sk, h, hkv, d, dtype)
    converted = {}  # one device array per numpy constant: the varlen case passes one array as both cum_seqlens
    arrays = {name: converted.setdefault(id(x), jnp.asarray(x)) if isinstance(x, np.ndarray) else x
              for name, x in kw.items()}

    def run(q, k, v, do):
        out, pullback = jax.vjp(
            lambda q, k, v: flash_attention(q, k, v, cfg=CudaFlashConfig("native"), **arrays), q, k, v)
        return (out, *pullback(do))

    got = jax.jit(run)(q, k, v, do)
    out, _, grads = reference_flash_attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                                    d_out=np.asarray(do, np.float64), **kw)
    want = (out, grads["query"], grads["key"], grads["value"])
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.dtype(dtype), name
        assert_close(g, w, dtype=dtype, gradient=name != "out", name=name)
    empty = {(300, 77): 223, (256, 64): 182}.get((sq, sk), 0)
    if empty:
        assert float(jnp.max(jnp.abs(got[0][:, :empty].astype(jnp.float32)))) == 0.0
        assert float(jnp.max(jnp.abs(got[1][:, :empty].astype(jnp.float32)))) == 0.0


@gpu
@pytest.mark.usefixtures("native_gpu")
def test_rows_a_window_leaves_empty_have_infinite_lse_and_zero_output():
    """256 queries over 64 keys: query i sits at key i - 192; the window (0, 10) shows it keys [i - 192,
    i - 182], so rows 0..181 see no key."""
    q, k, v, _ = _inputs(5, 1, 256, 64, 2, 1, 64, "bfloat16")
    out, lse = jax.jit(lambda q, k, v: native_flash.forward(q, k, v, scale=0.125, causal=False, window=(0, 10)))(
        q, k, v)
    assert bool(jnp.all(jnp.isposinf(lse[:, :, :182]))) and bool(jnp.all(jnp.isfinite(lse[:, :, 182:])))
    assert float(jnp.max(jnp.abs(out[:, :182].astype(jnp.float32)))) == 0.0


def _attention_float32(q, k, v, causal):
    """Attention in float32 with ejkernel's causal alignment (query i at key position i + Sk - Sq); rows that see
    no key give zeros (their gradients too)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    sq, sk = q.shape[1], k.shape[1]
    visible = jnp.ones((sq, sk), bool)
    if causal:
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + sk - sq
    logits = jnp.where(visible, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probabilities = weights / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probabilities, v)


def _assert_native_matches_float32(q, k, v, do, causal):
    """The native kernels' output and every gradient (bf16 inputs) against _attention_float32's."""

    def run(q, k, v, do, attend):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(do))

    got = jax.jit(run, static_argnums=4)(
        q, k, v, do, lambda q, k, v: flash_attention(q, k, v, causal=causal, cfg=CudaFlashConfig("native")))
    want = jax.jit(run, static_argnums=4)(q, k, v, do.astype(jnp.float32),
                                          lambda q, k, v: _attention_float32(q, k, v, causal))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, w.astype(jnp.float32), dtype=jnp.bfloat16, gradient=name != "out", name=name)


@gpu
@pytest.mark.usefixtures("native_gpu")
@pytest.mark.parametrize("sq,sk,causal", [(2048, 2048, True), (2048, 600, True), (2048, 2048, False)])
def test_persistent_ctas_over_many_tiles_match_float32(sq, sk, causal):
    """512 query tiles on one CTA per SM: each CTA runs several tiles through one K/V ring, tiles of 1 to 16
    key blocks in turn (the ring's stages change parity between tiles), and with Sk < Sq causal tiles whose rows
    see no key (no blocks, no Q load) between them. Forward and every gradient against float32 attention."""
    q, k, v, do = _inputs(sq + sk + causal, 4, sq, sk, 8, 2, 128, "bfloat16")
    _assert_native_matches_float32(q, k, v, do, causal)


@gpu
@pytest.mark.usefixtures("native_gpu")
@pytest.mark.parametrize("causal", [False, True])
def test_row_maxima_that_climb_past_the_lag_or_within_it_match_float32(causal):
    """The forward keeps a row's running maximum until a block's exceeds it by more than 8 (log2 units), and a
    warp skips rescaling its output rows while none of them moved (forward_pipeline.cuh, kMaxLagLog2). Random
    scores rarely climb, so here each 128-key block gets its own offset, uniform in [0, 24] log2 units: in any
    visiting order some blocks climb past the lag (the row rescales) and others within it (probabilities up to
    2^8 against the stale maximum). Output, lse and every gradient against float32."""
    q, k, v, do = _inputs(31 + causal, 1, 2048, 2048, 4, 2, 128, "bfloat16")
    unit = 128 ** -0.5 * np.log2(np.e)  # a raw score times unit: log2 units
    offsets = np.random.default_rng(causal).uniform(0, 24, 2048 // 128).repeat(128) / unit
    q = q.at[..., 0].set(4.0)
    k = k.at[..., 0].set(jnp.asarray(offsets / 4.0, jnp.bfloat16)[None, :, None])
    _assert_native_matches_float32(q, k, v, do, causal)
    _, lse = jax.jit(lambda q, k, v: native_flash.forward(q, k, v, scale=128 ** -0.5, causal=causal))(q, k, v)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), jnp.repeat(k.astype(jnp.float32), 2, axis=2))
    logits = logits * 128 ** -0.5
    if causal:
        logits = jnp.where(jnp.arange(2048)[None, :] <= jnp.arange(2048)[:, None], logits, -jnp.inf)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(logits, axis=-1)), rtol=0, atol=1e-2)


@gpu
@pytest.mark.usefixtures("native_gpu")
@pytest.mark.parametrize("causal", [False, True])
def test_many_forward_launches_in_one_executable_give_the_single_launch_results(causal):
    """16 forward calls in one executable (a model's layers), each on its own queries, against the same calls
    made one by one, bit for bit (the forward is deterministic; the backward's dQ sums in a float32 reduce-add
    of arbitrary order, so it is not compared): back-to-back launches catch races between the warpgroups that
    single launches rarely show (docs/DEVELOPING.md)."""
    q, k, v, _ = _inputs(9, 2, 1000, 1000, 8, 2, 128, "bfloat16")
    calls = [q * (1 + i / 64) for i in range(16)]

    def attend(q):
        return native_flash.attention(q, k, v, 128 ** -0.5, causal, None, None)

    together = jax.jit(lambda qs: [attend(q) for q in qs])(calls)
    one_by_one = [jax.jit(attend)(q) for q in calls]
    for i, (a, b) in enumerate(zip(together, one_by_one)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"call {i}")


@gpu
@pytest.mark.usefixtures("native_gpu")
def test_vmap_matches_a_loop():
    """The suite's vmap test runs at head_dim 32 (refused): the same check at 64, gradients included."""
    q, k, v, _ = _inputs(7, 3, 100, 140, 4, 2, 64, "bfloat16")
    q, k, v = (x[:, None] for x in (q, k, v))  # [3, 1, S, H, D]: vmapped over the leading axis

    def fn(q, k, v):
        return flash_attention(q, k, v, causal=True, cfg=CudaFlashConfig("native"))

    grad = jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    mapped = jax.jit(jax.vmap(fn))(q, k, v), *jax.jit(jax.vmap(grad))(q, k, v)
    one, one_grad = jax.jit(fn), jax.jit(grad)
    looped = [jnp.stack(parts) for parts in zip(*[(one(q[i], k[i], v[i]), *one_grad(q[i], k[i], v[i]))
                                                    for i in range(3)])]
    for name, got, want in zip(("out", "dq", "dk", "dv"), mapped, looped):
        assert_close(got, np.asarray(want, np.float64), dtype="bfloat16", gradient=name != "out", name=name)


@gpu
@pytest.mark.usefixtures("native_gpu")
def test_runs_under_shard_map_and_from_an_exported_program():
    from jax.sharding import PartitionSpec as P

    q, k, v, _ = _inputs(6, 2, 256, 256, 4, 2, 128, "bfloat16")
    want = flash_attention(q, k, v, causal=True, cfg=CudaFlashConfig("native"))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    local = jax.shard_map(lambda q, k, v: flash_attention(q, k, v, causal=True, cfg=CudaFlashConfig("native")),
                          mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    np.testing.assert_array_equal(np.asarray(jax.jit(local)(q, k, v)), np.asarray(want))
    exported = jax.export.export(
        jax.jit(lambda q, k, v: native_flash.attention(q, k, v, 128 ** -0.5, True, None, None)),
        disabled_checks=native_flash.export_disabled_checks())(q, k, v)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(q, k, v)), np.asarray(want))
