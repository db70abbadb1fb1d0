"""Reference and conformance suite of ``flash_attention`` (``docs/flash_attention.md``).

A backend's test module subclasses :class:`FlashAttentionConformance` and names its platform::

    from ejkernel.testing.flash_attention import FlashAttentionConformance

    class TestMyFlashAttention(FlashAttentionConformance):
        platform = "triton"          # any registered platform name; third-party plugins too
        cfg = None                   # optional config of that implementation, used for every call
                                     # (small blocks make short sequences span several blocks)

Every test compares the forward output and the gradients of query, key, value (and bias / sinks when
given) with :func:`reference_flash_attention` run in float64 on the exact (rounded) inputs, by relative
L2 error with the dtype's tolerance (``ejkernel.testing.numerics``). Inputs are fresh normal draws,
query/key/value/cotangent each from its own key. Nothing here is specific to a device: shapes are small
enough for CPU and valid everywhere.

Class attributes a backend may set: ``platform``, ``cfg``, ``tolerances``,
``allow_unsupported`` (report calls the backend refuses with ``UnsupportedFeature`` as skips naming the
reason, instead of failures; for partial backends), ``supports_gradients`` (False: forward-only backend,
gradients must raise rather than be wrong), ``compiler_options`` (for every compiled check; interpret-mode
backends use ``numerics.INTERPRET_COMPILER_OPTIONS``), ``verify_reference`` (False: leave the
backend-independent check of the suite's own reference to the XLA suite).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.errors import UnsupportedFeature
from ejkernel.testing._attention_reference import (
    reference_attention_weights,
    reference_dropout_keep,
    reference_flash_attention,
    reference_flash_attention_numpy,
    reference_visibility,
)
from ejkernel.testing.numerics import (
    TOLERANCES,
    Tolerance,
    assert_close,
    assert_finite,
    jax_float64,
    normal_array,
)

__all__ = [
    "AttentionSuiteBase",
    "FlashAttentionConformance",
    "reference_attention_weights",
    "reference_dropout_keep",
    "reference_flash_attention",
    "reference_flash_attention_numpy",
    "reference_visibility",
]

DIFFERENTIABLE = ("query", "key", "value", "bias", "softmax_aux")


def attention_inputs(
    seed: int,
    *,
    batch: int = 2,
    q_len: int = 16,
    kv_len: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int = 32,
    v_head_dim: int | None = None,
    dtype: Any = jnp.float32,
    bias_shape: Sequence[int] | None = None,
    num_sinks: int | None = None,
    scale: float = 1.0,
) -> dict[str, jax.Array]:
    """Fresh q, k, v (each from its own key; never zero), optional bias / sinks, in ``dtype``.
    ``num_sinks=0`` gives sinks of shape ``[num_heads]``."""
    kv_len = q_len if kv_len is None else kv_len
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    # one numpy stream per tensor, (seed, index): independent draws, no XLA compile per shape
    inputs = {
        "query": normal_array((seed, 0), (batch, q_len, num_heads, head_dim), dtype, scale),
        "key": normal_array((seed, 1), (batch, kv_len, num_kv_heads, head_dim), dtype, scale),
        "value": normal_array((seed, 2), (batch, kv_len, num_kv_heads, v_head_dim), dtype),
    }
    if bias_shape is not None:
        inputs["bias"] = normal_array((seed, 3), bias_shape, dtype)
    if num_sinks is not None:
        inputs["softmax_aux"] = normal_array((seed, 4), (num_heads,) if num_sinks == 0 else (num_heads, num_sinks), dtype)
    return inputs


class AttentionSuiteBase:
    """Forward + VJP against a float64 reference, shared by the attention suites."""

    platform: ClassVar[str] = "xla"
    cfg: ClassVar[Any] = None
    tolerances: ClassVar[Mapping[str, Tolerance]] = TOLERANCES
    allow_unsupported: ClassVar[bool] = False
    supports_gradients: ClassVar[bool] = True
    compiler_options: ClassVar[Mapping[str, Any] | None] = None
    """XLA options for the compiled checks (``numerics.INTERPRET_COMPILER_OPTIONS`` for interpret-mode kernels)."""
    verify_reference: ClassVar[bool] = True
    """Run the suite's check of its own reference (backend-independent: one backend's suite running it is
    enough; the XLA backend's does)."""
    input_dtype: ClassVar[Any] = None
    """Half-precision-only backends (cuDNN) set ``jnp.bfloat16``: every float32 input the suite makes is cast
    to it before the call (the reference sees the rounded values, tolerances follow the dtype), so each
    test exercises the backend instead of being refused."""

    # ---- to define in each suite ------------------------------------------------------------------
    public_name: ClassVar[str]
    """The operation's public function in ``ejkernel.modules``."""

    def operation(self, **kwargs) -> jax.Array:
        import ejkernel.modules

        return getattr(ejkernel.modules, self.public_name)(**kwargs, platform=self.platform, cfg=self.cfg)

    def reference(self, **kwargs) -> jax.Array:
        raise NotImplementedError

    def reference_outputs(self, inputs, kwargs, wrt, cotangent) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Float64 output and gradients (w.r.t. ``wrt``) of ``self.reference``: ``jax.vjp`` under x64.
        Suites with a numpy reference override this (no compilation: fast on CPU)."""
        with jax.enable_x64(True):
            inputs64 = jax_float64(dict(inputs))
            # integer/boolean inputs stay concrete (closed over): the reference builds its mask in numpy
            fixed64 = {k: v for k, v in inputs64.items() if k not in wrt}

            def ref(*diff):
                return self.reference(**fixed64, **dict(zip(wrt, diff)), **kwargs)

            diff64 = tuple(inputs64[n] for n in wrt)
            if not wrt:
                return np.asarray(jax.jit(ref)(*diff64)), {}

            @jax.jit
            def ref_forward_backward(diff, cotangent):
                out, vjp = jax.vjp(ref, *diff)
                return out, vjp(cotangent)

            ref_out, ref_grad_list = ref_forward_backward(diff64, jax_float64(cotangent))
            return np.asarray(ref_out), {name: np.asarray(g) for name, g in zip(wrt, ref_grad_list)}

    def numpy_reference_outputs(self, inputs, kwargs, wrt, cotangent) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``reference_outputs`` from the float64 numpy flash_attention reference (for suites whose
        operation is flash_attention or a restriction of it without a second output)."""
        out, _, grads = reference_flash_attention_numpy(**inputs, **kwargs, d_out=cotangent if wrt else None)
        return out, {name: grads[name] for name in wrt}

    # ---- tests every attention suite runs -----------------------------------------------------------
    def test_jit_matches_eager(self):
        inputs = self.in_input_dtype(attention_inputs(21, batch=1, q_len=37, num_heads=2, head_dim=32))
        with self.maybe_unsupported():
            eager = self.operation(**inputs, causal=True)
            jitted = self.jit(lambda q, k, v: self.operation(query=q, key=k, value=v, causal=True))(
                inputs["query"], inputs["key"], inputs["value"]
            )
        np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-6)

    # ---- helpers ----------------------------------------------------------------------------------
    def in_input_dtype(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``inputs`` with float32 arrays cast to :attr:`input_dtype` (unchanged when it is None)."""
        if self.input_dtype is None:
            return dict(inputs)
        return {k: v.astype(self.input_dtype) if getattr(v, "dtype", None) == jnp.float32 else v
                for k, v in inputs.items()}

    def jit(self, fn: Callable, **kwargs: Any) -> Callable:
        """``jax.jit`` with the suite's ``compiler_options`` (every compiled check goes through it)."""
        return jax.jit(fn, compiler_options=dict(self.compiler_options or {}) or None, **kwargs)

    @contextlib.contextmanager
    def maybe_unsupported(self):
        try:
            yield
        except UnsupportedFeature as exc:
            if not self.allow_unsupported:
                raise
            pytest.skip(f"{self.platform} refuses this call (UnsupportedFeature): {exc}")

    def run_and_compare(
        self,
        inputs: Mapping[str, Any],
        *,
        dtype: Any = None,
        gradients: bool = True,
        tolerance_scale: float = 1.0,
        cotangent_seed: int = 1234,
        **kwargs: Any,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Run the operation and the reference on ``inputs`` (+ static ``kwargs``); compare the output
        and (with ``gradients``) every differentiable input's gradient. Returns (out, grads)."""
        inputs = self.in_input_dtype(inputs)
        dtype = inputs["query"].dtype if dtype is None else dtype
        wrt = [name for name in DIFFERENTIABLE if inputs.get(name) is not None]
        fixed = {k: v for k, v in inputs.items() if k not in wrt}
        gradients = gradients and self.supports_gradients

        def fn(*diff):
            return self.operation(**fixed, **dict(zip(wrt, diff)), **kwargs)

        diff_inputs = tuple(inputs[n] for n in wrt)
        with self.maybe_unsupported():
            if gradients:
                out_shape = jax.eval_shape(fn, *diff_inputs)
                cotangent = normal_array(cotangent_seed, out_shape.shape, out_shape.dtype)

                def forward_backward(diff, cotangent):  # one program: one compilation per check
                    out, vjp = jax.vjp(fn, *diff)
                    return out, vjp(cotangent)

                out, grad_list = self.jit(forward_backward)(diff_inputs, cotangent)
                grads = dict(zip(wrt, grad_list))
            else:
                out, grads, cotangent = self.jit(fn)(*diff_inputs), {}, None
        assert out.dtype == inputs["query"].dtype, f"output dtype {out.dtype}, expected {inputs['query'].dtype}"

        ref_out, ref_grads = self.reference_outputs(inputs, kwargs, wrt if gradients else [], cotangent)

        assert out.shape == ref_out.shape, f"output shape {out.shape}, expected {ref_out.shape}"
        assert_close(out, ref_out, dtype=dtype, name="output", tolerances=self.tolerances, scale=tolerance_scale)
        failures = []
        for name in ref_grads:
            assert grads[name].shape == ref_grads[name].shape, f"d{name} shape {grads[name].shape}"
            try:
                assert_close(
                    grads[name], ref_grads[name], dtype=dtype, gradient=True, name=f"d{name}",
                    tolerances=self.tolerances, scale=tolerance_scale,
                )
            except AssertionError as exc:
                failures.append(str(exc))
        if failures:
            raise AssertionError("; ".join(failures))
        return out, grads


DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
DTYPE_IDS = ("float32", "bfloat16", "float16")


class FlashAttentionConformance(AttentionSuiteBase):
    """Conformance tests of ``flash_attention`` for the backend named by ``platform`` (module docstring)."""

    public_name = "flash_attention"
    reference = staticmethod(reference_flash_attention)
    reference_outputs = AttentionSuiteBase.numpy_reference_outputs

    def test_numpy_reference_matches_autodiff(self):
        """The fast numpy reference (hand-written gradients) equals autodiff of the jnp reference."""
        if not self.verify_reference:
            pytest.skip("backend-independent check of the suite's reference: the XLA backend's suite runs it")
        inputs = attention_inputs(99, batch=2, q_len=9, kv_len=13, num_heads=4, num_kv_heads=2, head_dim=8,
                                  bias_shape=(1, 4, 9, 13), num_sinks=2)
        inputs["attention_mask"] = jnp.asarray(np.random.default_rng(99).random((2, 1, 9, 13)) > 0.2)
        kwargs = dict(causal=True, sliding_window=(6, 1), logits_soft_cap=4.0, dropout_prob=0.3, dropout_seed=5)
        wrt = [n for n in DIFFERENTIABLE if n in inputs]
        cotangent = normal_array(98, (2, 9, 4, 8))
        autodiff_out, autodiff_grads = AttentionSuiteBase.reference_outputs(self, inputs, kwargs, wrt, cotangent)
        out, grads = self.reference_outputs(inputs, kwargs, wrt, cotangent)
        np.testing.assert_allclose(out, autodiff_out, rtol=1e-10, atol=1e-12)
        for name in wrt:
            np.testing.assert_allclose(grads[name], autodiff_grads[name], rtol=1e-9, atol=1e-11, err_msg=name)

    # ---- dtypes, GQA, lengths ---------------------------------------------------------------------
    @pytest.mark.parametrize(
        "dtype,causal",
        [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True), (jnp.float16, True)],
        ids=["float32-full", "float32-causal", "bfloat16-causal", "float16-causal"],
    )
    def test_dtypes(self, dtype, causal):
        inputs = attention_inputs(0, batch=2, q_len=48, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
        self.run_and_compare(inputs, causal=causal)

    @pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
    def test_gqa(self, num_heads, num_kv_heads):
        inputs = attention_inputs(1, q_len=40, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32)
        self.run_and_compare(inputs, causal=True)

    @pytest.mark.parametrize(
        "q_len,kv_len",
        [(1, 1), (17, 17), (127, 127), (1000, 1000), (17, 127), (127, 17), (1, 1000)],
        ids=lambda v: str(v),
    )
    def test_lengths(self, q_len, kv_len):
        inputs = attention_inputs(2, batch=1, q_len=q_len, kv_len=kv_len, num_heads=2, num_kv_heads=1, head_dim=32)
        self.run_and_compare(inputs, causal=True)

    def test_unequal_lengths_not_causal(self):
        inputs = attention_inputs(3, batch=1, q_len=127, kv_len=17, num_heads=2, head_dim=32)
        self.run_and_compare(inputs)

    @pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
    def test_head_dims(self, head_dim):
        inputs = attention_inputs(4, batch=1, q_len=33, num_heads=2, num_kv_heads=1, head_dim=head_dim, dtype=jnp.bfloat16)
        self.run_and_compare(inputs, causal=True, gradients=head_dim in (64, 256))

    def test_value_head_dim_differs(self):
        inputs = attention_inputs(5, batch=1, q_len=24, num_heads=2, head_dim=32, v_head_dim=16)
        self.run_and_compare(inputs, causal=True)

    # ---- masking features -------------------------------------------------------------------------
    @pytest.mark.parametrize(
        "causal,window",
        [(False, 5), (False, (3, 9)), (True, (6, 0)), (False, (0, 1))],
        ids=["w5", "w3-9", "causal-w6", "w0-1"],
    )
    def test_sliding_window(self, causal, window):
        inputs = attention_inputs(6, batch=1, q_len=45, kv_len=61, num_heads=2, head_dim=32)
        self.run_and_compare(inputs, causal=causal, sliding_window=window)

    @pytest.mark.parametrize("mask_heads", [1, 4], ids=["mask-shared", "mask-per-head"])
    def test_attention_mask_with_fully_masked_rows(self, mask_heads):
        batch, q_len, kv_len, num_heads = 2, 29, 37, 4
        rng = np.random.default_rng(7)
        mask = rng.random((batch, mask_heads, q_len, kv_len)) > 0.5
        empty_rows = [0, 5, 28]
        mask[:, :, empty_rows] = False
        inputs = attention_inputs(7, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=num_heads, num_kv_heads=2, head_dim=32)
        inputs["attention_mask"] = jnp.asarray(mask)
        out, grads = self.run_and_compare(inputs)
        np.testing.assert_array_equal(np.asarray(out[:, empty_rows], np.float32), 0.0)
        for name, g in grads.items():
            assert_finite(g, f"d{name}")
        np.testing.assert_array_equal(np.asarray(grads["query"][:, empty_rows], np.float32), 0.0)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=["bfloat16"])
    def test_segment_ids(self, dtype):
        batch, q_len, kv_len = 2, 30, 30
        rng = np.random.default_rng(8)
        q_seg = np.sort(rng.integers(0, 4, (batch, q_len)), axis=1)
        kv_seg = np.sort(rng.integers(0, 4, (batch, kv_len)), axis=1)
        q_seg[0, -3:] = 9  # a segment no key has: fully masked rows
        inputs = attention_inputs(8, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=2, head_dim=32, dtype=dtype)
        inputs["q_segment_ids"] = jnp.asarray(q_seg, jnp.int32)
        inputs["kv_segment_ids"] = jnp.asarray(kv_seg, jnp.int32)
        out, grads = self.run_and_compare(inputs, causal=True)
        np.testing.assert_array_equal(np.asarray(out[0, -3:], np.float32), 0.0)

    def test_segment_ids_self_attention_one_side(self):
        inputs = attention_inputs(9, batch=2, q_len=20, num_heads=2, head_dim=32)
        inputs["q_segment_ids"] = jnp.asarray(np.repeat(np.arange(4), 5)[None].repeat(2, 0), jnp.int32)
        out_one, _ = self.run_and_compare(inputs, gradients=False)
        both = dict(inputs, kv_segment_ids=inputs["q_segment_ids"])
        out_both, _ = self.run_and_compare(both, gradients=False)
        np.testing.assert_array_equal(np.asarray(out_one), np.asarray(out_both))

    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    def test_varlen(self, causal):
        # unequal q/kv lengths per sequence, an empty query sequence, and padding past the last one
        cu_q = np.array([0, 7, 7, 30, 41], np.int32)
        cu_k = np.array([0, 12, 15, 38, 50], np.int32)
        inputs = attention_inputs(10, batch=1, q_len=45, kv_len=53, num_heads=4, num_kv_heads=2, head_dim=32)
        inputs["cum_seqlens_q"] = jnp.asarray(cu_q)
        inputs["cum_seqlens_k"] = jnp.asarray(cu_k)
        out, grads = self.run_and_compare(inputs, causal=causal, sliding_window=(9, 9) if not causal else None)
        np.testing.assert_array_equal(np.asarray(out[:, 41:]), 0.0)  # padding rows
        np.testing.assert_array_equal(np.asarray(grads["key"][:, 50:]), 0.0)  # padding keys

    # ---- logits features --------------------------------------------------------------------------
    @pytest.mark.parametrize(
        "bias_shape", [(2, 4, 19, 23), (2, 1, 19, 23)], ids=["BH", "B1"]
    )
    def test_bias_gradient(self, bias_shape):
        inputs = attention_inputs(11, batch=2, q_len=19, kv_len=23, num_heads=4, num_kv_heads=2, head_dim=32, bias_shape=bias_shape)
        self.run_and_compare(inputs, causal=True)

    @pytest.mark.parametrize("num_sinks", [0, 3], ids=["sinks-H", "sinks-HK"])
    def test_sinks_gradient(self, num_sinks):
        inputs = attention_inputs(12, batch=2, q_len=21, kv_len=21, num_heads=4, num_kv_heads=1, head_dim=32, num_sinks=num_sinks)
        self.run_and_compare(inputs, causal=True, sliding_window=(4, 0))

    def test_sinks_with_fully_masked_rows(self):
        inputs = attention_inputs(13, batch=1, q_len=12, num_heads=2, head_dim=32, num_sinks=2)
        mask = np.ones((1, 1, 12, 12), bool)
        mask[:, :, 3] = False
        inputs["attention_mask"] = jnp.asarray(mask)
        out, grads = self.run_and_compare(inputs)
        np.testing.assert_array_equal(np.asarray(out[:, 3]), 0.0)

    def test_soft_cap(self):
        inputs = attention_inputs(14, batch=2, q_len=26, num_heads=2, head_dim=32, scale=3.0, bias_shape=(1, 2, 26, 26))
        self.run_and_compare(inputs, causal=True, logits_soft_cap=5.0)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
    def test_large_logits(self, dtype):
        # logits of a few hundred: the online softmax must rescale exactly, nothing may overflow
        inputs = attention_inputs(15, batch=1, q_len=50, num_heads=2, head_dim=64, dtype=dtype, scale=6.0)
        out, grads = self.run_and_compare(inputs, causal=True, tolerance_scale=8.0)
        for name, g in grads.items():
            assert_finite(g, f"d{name}")

    def test_softmax_scale(self):
        inputs = attention_inputs(16, batch=1, q_len=20, num_heads=2, head_dim=32)
        self.run_and_compare(inputs, softmax_scale=0.37)

    def test_everything_at_once(self):
        inputs = attention_inputs(17, batch=2, q_len=27, kv_len=35, num_heads=4, num_kv_heads=2, head_dim=32,
                                  bias_shape=(2, 1, 27, 35), num_sinks=2)
        rng = np.random.default_rng(17)
        inputs["attention_mask"] = jnp.asarray(rng.random((2, 1, 27, 35)) > 0.2)
        inputs["q_segment_ids"] = jnp.asarray(np.repeat([[0, 1, 2]], 9, axis=1).repeat(2, 0), jnp.int32)
        inputs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, 35)), axis=1), jnp.int32)
        self.run_and_compare(
            inputs, causal=True, sliding_window=(10, 2), logits_soft_cap=8.0, dropout_prob=0.2, dropout_seed=3
        )

    # ---- dropout ------------------------------------------------------------------------------------
    def test_dropout_matches_reference_mask(self):
        # the reference applies the index-hash mask in forward and backward: matching every gradient
        # shows the backend draws the same mask in both passes
        inputs = attention_inputs(18, batch=2, q_len=33, kv_len=41, num_heads=4, num_kv_heads=2, head_dim=32)
        self.run_and_compare(inputs, causal=True, dropout_prob=0.3, dropout_seed=1234)

    def test_dropout_deterministic_per_seed(self):
        inputs = attention_inputs(19, batch=1, q_len=30, num_heads=2, head_dim=32)
        with self.maybe_unsupported():
            call = lambda seed: self.operation(**inputs, dropout_prob=0.25, dropout_seed=seed)  # noqa: E731
            first, again, other = call(7), call(7), call(8)
            no_dropout = self.operation(**inputs)
            default_seed = self.operation(**inputs, dropout_prob=0.25)
            seed_zero = call(0)
        np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
        assert not np.array_equal(np.asarray(first), np.asarray(other)), "a different seed gave the same output"
        assert not np.array_equal(np.asarray(first), np.asarray(no_dropout)), "dropout changed nothing"
        np.testing.assert_array_equal(np.asarray(default_seed), np.asarray(seed_zero))

    def test_dropout_traced_seed(self):
        inputs = attention_inputs(20, batch=1, q_len=16, num_heads=2, head_dim=32)
        with self.maybe_unsupported():
            jitted = self.jit(lambda seed: self.operation(**inputs, dropout_prob=0.5, dropout_seed=seed))
            traced = jitted(jnp.int32(11))
            static = self.operation(**inputs, dropout_prob=0.5, dropout_seed=11)
        np.testing.assert_allclose(np.asarray(traced), np.asarray(static), rtol=1e-5, atol=1e-6)

    # ---- transformations (jit: AttentionSuiteBase.test_jit_matches_eager) -----------------------------
    def test_vmap(self):
        q = normal_array((22, 0), (3, 1, 19, 2, 32))
        k = normal_array((22, 1), (3, 1, 23, 1, 32))
        v = normal_array((22, 2), (3, 1, 23, 1, 32))
        with self.maybe_unsupported():
            fn = lambda q, k, v: self.operation(query=q, key=k, value=v, causal=True)  # noqa: E731
            grad = jax.grad(lambda q, k, v: fn(q, k, v).sum())
            # jitted (eager is test_jit_matches_eager's business): one compile per variant, not per op
            one, one_grad = self.jit(fn), self.jit(grad)
            mapped = self.jit(jax.vmap(fn))(q, k, v)
            looped = jnp.stack([one(q[i], k[i], v[i]) for i in range(3)])
            grad_mapped = self.jit(jax.vmap(grad))(q, k, v)
            grad_looped = jnp.stack([one_grad(q[i], k[i], v[i]) for i in range(3)])
        np.testing.assert_allclose(np.asarray(mapped), np.asarray(looped), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(grad_mapped), np.asarray(grad_looped), rtol=1e-4, atol=1e-5)

    # ---- bad inputs: ValueError naming the argument, before anything compiles ---------------------
    BAD_CALLS: ClassVar[list[tuple[str, Callable[[dict], dict], str]]] = [
        ("kv heads not dividing", lambda x: dict(x, key=x["key"][:, :, :3], value=x["value"][:, :, :3]), "key"),
        ("head_dim mismatch", lambda x: dict(x, key=x["key"][..., :16]), "key"),
        ("batch mismatch", lambda x: dict(x, key=x["key"][:1], value=x["value"][:1]), "key"),
        ("value length", lambda x: dict(x, value=x["value"][:, :5]), "value"),
        ("dtype mix", lambda x: dict(x, key=x["key"].astype(jnp.bfloat16)), "key"),
        ("window negative", lambda x: dict(x, sliding_window=(-1, 3)), "sliding_window"),
        ("window triple", lambda x: dict(x, sliding_window=(1, 2, 3)), "sliding_window"),
        ("dropout_prob 1", lambda x: dict(x, dropout_prob=1.0), "dropout_prob"),
        ("soft cap negative", lambda x: dict(x, logits_soft_cap=-1.0), "logits_soft_cap"),
        ("bias shape", lambda x: dict(x, bias=jnp.ones((2, 3, 16, 16))), "bias"),
        ("mask dtype", lambda x: dict(x, attention_mask=jnp.ones((2, 1, 16, 16), jnp.float32)), "attention_mask"),
        ("cu_seqlens alone", lambda x: dict(x, cum_seqlens_q=jnp.array([0, 16], jnp.int32)), "cum_seqlens"),
        (
            "cu_seqlens not monotone",
            lambda x: {**{k: v[:1] for k, v in x.items()}, "cum_seqlens_q": jnp.array([0, 9, 4], jnp.int32),
                       "cum_seqlens_k": jnp.array([0, 4, 9], jnp.int32)},
            "cum_seqlens_q",
        ),
        ("cu_seqlens batch 2", lambda x: dict(x, cum_seqlens_q=jnp.array([0, 16], jnp.int32),
                                              cum_seqlens_k=jnp.array([0, 16], jnp.int32)), "batch"),
        ("sinks shape", lambda x: dict(x, softmax_aux=jnp.ones((3,))), "softmax_aux"),
        ("query rank", lambda x: dict(x, query=x["query"][0]), "query"),
    ]

    @pytest.mark.parametrize("case", range(len(BAD_CALLS)), ids=[c[0] for c in BAD_CALLS])
    def test_bad_inputs_raise_value_error(self, case):
        from ejkernel.modules import FlashAttention
        from ejkernel.ops import get_default_executor

        _, mutate, argument = self.BAD_CALLS[case]
        inputs = mutate(attention_inputs(23, batch=2, q_len=16, num_heads=4, num_kv_heads=4, head_dim=32))
        args = [inputs.pop(name) for name in ("query", "key", "value")]
        bias = inputs.pop("bias", None)
        with pytest.raises(ValueError, match=argument):
            get_default_executor()(FlashAttention(), *args, bias, platform=self.platform, **inputs)
        # the public function raises too (type annotations are checked first: TypeError, naming it)
        with pytest.raises((ValueError, TypeError), match=argument if argument != "cum_seqlens" else "cum_seqlens"):
            self.operation(query=args[0], key=args[1], value=args[2], bias=bias, **inputs)
