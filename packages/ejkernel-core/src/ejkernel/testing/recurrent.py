"""Reference and conformance suite of ``recurrent_attention`` (see
``ejkernel.modules.operations.recurrent``); the ``gla`` and ``lightning_attention`` suites build on it.

The reference is the naive per-token recurrence (a ``lax.scan`` over tokens, float64 ready):
``S_t = diag(exp(a_t)) S_{t-1} diag(exp(b_t)) + k_t v_t^T``, ``o_t = scale * q_t^T S_t``.

A backend's test module subclasses :class:`RecurrentConformance`, sets ``platform`` and, when its config
takes a chunk size, ``chunk_config`` (overriding ``config`` for any other config shape). A partial backend
lists the inputs it refuses in ``refused`` (e.g. ``("cu_seqlens", "gv")``): a test using one then checks
that the call raises ``UnsupportedFeature`` (so the dispatcher can fall back) and is skipped, naming them::

    class TestXlaRecurrent(RecurrentConformance):
        platform = "xla"
        chunk_config = XlaLinearAttentionConfig
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.errors import UnsupportedFeature
from ejkernel.testing.numerics import (
    exact_matmuls,
    Tolerance,
    assert_close,
    assert_tree_close,
    forward_and_vjp,
    normal_array,
    reference_forward_and_vjp,
)


def _token_layout(total: int, cu_seqlens):
    """Per token: sequence id, is-first, is-last, exists; and the order running sequences backwards."""
    tokens = jnp.arange(total)
    if cu_seqlens is None:
        cu_seqlens = jnp.asarray([0, total])
    cu = jnp.asarray(cu_seqlens)
    sequence = jnp.clip(jnp.searchsorted(cu[1:], tokens, side="right"), 0, cu.shape[0] - 2)
    exists = tokens < cu[-1]
    first = exists & (tokens == cu[sequence])
    last = exists & (tokens == cu[sequence + 1] - 1)
    backwards = jnp.where(exists, cu[sequence] + cu[sequence + 1] - 1 - tokens, tokens)
    return sequence, first, last, exists, backwards


@exact_matmuls
def reference_recurrent(
    query,
    key,
    value,
    g=None,
    g_gamma=None,
    gk=None,
    gv=None,
    initial_state=None,
    cu_seqlens=None,
    *,
    softmax_scale=None,
    reverse=False,
):
    """Naive recurrence, one token at a time. Returns ``(o [B, T, H, V], final_state [B|N, H, K, V])``.

    ``g`` [B, T, H] or [B, T, H, K], ``gk`` [B, T, H, K], ``g_gamma`` [H] or [B, H] add up to the
    key-dimension log decay; ``gv`` [B, T, H, V] is the value-dimension log decay.
    """
    batch, total, heads, dk = query.shape
    dv = value.shape[-1]
    group = heads // key.shape[2]
    key = jnp.repeat(key, group, axis=2)
    value = jnp.repeat(value, group, axis=2)
    scale = dk**-0.5 if softmax_scale is None else softmax_scale
    a = jnp.zeros((batch, total, heads, dk), query.dtype)
    if g is not None:
        a = a + (g[..., None] if g.ndim == 3 else g)
    if gk is not None:
        a = a + gk
    if g_gamma is not None:
        gamma = g_gamma[None] if g_gamma.ndim == 1 else g_gamma
        a = a + gamma[:, None, :, None]
    b = jnp.zeros((batch, total, heads, dv), query.dtype) if gv is None else gv
    sequence, first, last, exists, backwards = _token_layout(total, cu_seqlens)
    if reverse:
        query, key, value, a, b = (x[:, backwards] for x in (query, key, value, a, b))
    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    zeros = jnp.zeros((num_states, heads, dk, dv), query.dtype)
    h0 = zeros if initial_state is None else initial_state.astype(query.dtype)

    def step(carry, xs):
        state, finals = carry
        q_t, k_t, v_t, a_t, b_t, seq_t, first_t, last_t, exists_t = xs
        if cu_seqlens is not None:  # batch is 1: the state restarts at each sequence's first token
            state = jnp.where(first_t, h0[seq_t][None], state)
        new = jnp.exp(a_t)[..., :, None] * state * jnp.exp(b_t)[..., None, :] + k_t[..., :, None] * v_t[..., None, :]
        state = jnp.where(exists_t, new, state)
        out = jnp.where(exists_t, scale * jnp.einsum("bhk,bhkv->bhv", q_t, state), 0.0)
        if cu_seqlens is not None:
            finals = jnp.where(last_t, finals.at[seq_t].set(state[0]), finals)
        return (state, finals), out

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (query, key, value, a, b)) + (sequence, first, last, exists)
    start = h0 if cu_seqlens is None else zeros[:1]
    (state, finals), out = jax.lax.scan(step, (start, h0), xs)
    out = jnp.moveaxis(out, 0, 1)
    if reverse:
        out = out[:, backwards]
    return out.astype(query.dtype), state if cu_seqlens is None else finals


# ---- inputs -----------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16")


def log_sigmoid_gate(seed: int, shape, strength: float = 1.0):
    """Log-space gates as models produce them: ``log(sigmoid(x))`` (always < 0), float32 (numpy-drawn)."""
    x = np.random.default_rng(seed).standard_normal(tuple(shape)) * strength + 2.0
    return jnp.asarray(-np.logaddexp(0.0, -x) / 4.0, jnp.float32)


def check_outputs(fn, reference, inputs, wrt, dtype, tolerances, scale=1.0, seed=777):
    """Forward (output and final state) and every gradient in ``wrt`` against the float64 reference;
    one random cotangent covers both outputs. Kernel and reference each compile once (jit)."""
    out_shape, final_shape = jax.eval_shape(lambda: fn(**inputs))
    assert out_shape.dtype == inputs["query"].dtype, f"output dtype {out_shape.dtype}, expected {inputs['query'].dtype}"
    assert final_shape.dtype == jnp.float32, f"final_state dtype {final_shape.dtype}, expected float32"
    size = int(np.prod(out_shape.shape))

    def joined(fn, **kwargs):
        out, final = fn(**kwargs)
        return jnp.concatenate([out.astype(final.dtype).ravel(), final.ravel()])

    got, grads, cotangent = forward_and_vjp(functools.partial(joined, fn), inputs, wrt, seed)
    expected, expected_grads = reference_forward_and_vjp(functools.partial(joined, reference), inputs, wrt, cotangent)
    for name, lo, hi, shape in (("output", 0, size, out_shape.shape), ("final_state", size, None, final_shape.shape)):
        assert_close(got[lo:hi].reshape(shape), expected[lo:hi].reshape(shape), dtype=dtype, tolerances=tolerances,
                     scale=scale, name=name)
    if wrt:
        assert_tree_close(grads, expected_grads, dtype=dtype, tolerances=tolerances, scale=scale)


# name -> (batch, T, H, Hkv, K, V, cu_seqlens or None)
SHAPES = {
    "mha_17": (2, 17, 2, 2, 16, 8, None),
    "gqa_odd": (1, 37, 4, 2, 8, 12, None),
    "one_token": (2, 1, 2, 1, 8, 8, None),
    "varlen": (1, 45, 2, 2, 8, 8, (0, 5, 5, 21, 40)),
}


class RecurrentSuite:
    """What the suites of ``recurrent`` and of the operations built on it (``gla_attention``,
    ``lightning_attention``) share: inputs, chunk configs, and the check against ``reference``."""

    operation: ClassVar[str]
    """The public function of ``ejkernel.modules`` under test."""
    reference: ClassVar[Callable[..., Any]]
    """Its float64-ready reference (a ``staticmethod``)."""
    platform: ClassVar[str]
    tolerances: ClassVar[Mapping[str, Tolerance] | None] = None
    chunk_config: ClassVar[type | None] = None
    """The backend's config type when it takes ``chunk_size=`` (tokens per chunk): the suite then also runs
    chunks shorter than the sequences. None: every call gets ``cfg=None``."""

    refused: ClassVar[tuple[str, ...]] = ()
    """Inputs (``cu_seqlens``, ``gv``, ...) the backend refuses with ``UnsupportedFeature``."""

    def skip_if_refused(self, inputs, **static):
        """For an input in ``refused``: the call must raise ``UnsupportedFeature``; then skip the test."""
        used = [name for name in self.refused if inputs.get(name) is not None]
        if not used:
            return
        with pytest.raises(UnsupportedFeature):
            self.call(**inputs, **static)
        pytest.skip(f"{self.platform} refuses {', '.join(used)} (raised UnsupportedFeature, as it should)")

    def config(self, chunk_size: int | None):
        """The ``cfg`` of a test that names a chunk size (None: the backend's own choice)."""
        if chunk_size is None or self.chunk_config is None:
            return None
        return self.chunk_config(chunk_size=chunk_size)

    def call(self, **kwargs):
        import ejkernel.modules

        return getattr(ejkernel.modules, self.operation)(**kwargs, platform=self.platform)

    def make_inputs(self, seed, shape, dtype, *, gates=("g",), initial_state=False, scalar_g=False):
        batch, total, heads, kv_heads, dk, dv, bounds = SHAPES[shape]
        inputs = dict(
            query=normal_array(seed * 10 + 0, (batch, total, heads, dk), dtype),
            key=normal_array(seed * 10 + 1, (batch, total, kv_heads, dk), dtype),
            value=normal_array(seed * 10 + 2, (batch, total, kv_heads, dv), dtype),
        )
        if "g" in gates:
            inputs["g"] = log_sigmoid_gate(seed * 10 + 3, (batch, total, heads) if scalar_g else (batch, total, heads, dk))
        if "gk" in gates:
            inputs["gk"] = log_sigmoid_gate(seed * 10 + 4, (batch, total, heads, dk))
        if "gv" in gates:
            inputs["gv"] = log_sigmoid_gate(seed * 10 + 5, (batch, total, heads, dv))
        if "g_gamma" in gates:
            inputs["g_gamma"] = -jnp.linspace(0.05, 0.5, heads, dtype=jnp.float32)
        if bounds is not None:
            inputs["cu_seqlens"] = jnp.asarray(bounds, jnp.int32)
        if initial_state:
            rows = batch if bounds is None else len(bounds) - 1
            inputs["initial_state"] = normal_array(seed * 10 + 6, (rows, heads, dk, dv), jnp.float32)
        return inputs

    def check(self, inputs, dtype, *, cfg=None, scale=1.0, **static):
        self.skip_if_refused(inputs, cfg=cfg, **static)
        wrt = [name for name, x in inputs.items() if x is not None and jnp.issubdtype(x.dtype, jnp.floating)]
        fn = functools.partial(self.call, cfg=cfg, **static)
        reference = functools.partial(self.reference, **static)
        check_outputs(fn, reference, inputs, wrt, jnp.dtype(dtype), self.tolerances, scale=scale)


class RecurrentConformance(RecurrentSuite):
    """Test base: subclass and set ``platform`` (see the module docstring)."""

    operation: ClassVar[str] = "recurrent_attention"
    reference = staticmethod(reference_recurrent)

    # ---- numerics -----------------------------------------------------------------------------------

    @pytest.mark.parametrize("shape,chunk_size", [("gqa_odd", None), ("varlen", 4)])
    def test_per_dim_gates(self, shape, chunk_size):
        inputs = self.make_inputs(1, shape, "float32", gates=("g", "gk"), initial_state=True)
        self.check(inputs, "float32", cfg=self.config(chunk_size))

    @pytest.mark.parametrize("shape", ["varlen"])
    def test_scalar_and_value_gates(self, shape):
        inputs = self.make_inputs(2, shape, "float32", gates=("g", "gv", "g_gamma"), scalar_g=True)
        self.check(inputs, "float32", cfg=self.config(8))

    @pytest.mark.parametrize("shape", ["varlen"])
    def test_reverse(self, shape):
        inputs = self.make_inputs(3, shape, "float32", gates=("g", "gk", "gv"), initial_state=True)
        self.check(inputs, "float32", cfg=self.config(4), reverse=True)

    @pytest.mark.parametrize("shape", ["one_token", "varlen"])
    def test_bfloat16(self, shape):
        inputs = self.make_inputs(4, shape, "bfloat16", gates=("g",), initial_state=True)
        self.check(inputs, "bfloat16", cfg=self.config(8))

    def test_no_gates_with_scale(self):
        inputs = self.make_inputs(5, "mha_17", "float32", gates=())
        self.check(inputs, "float32", softmax_scale=0.3)

    def test_strong_gates_stay_finite(self):
        inputs = self.make_inputs(6, "gqa_odd", "float32", gates=())
        inputs["g"] = log_sigmoid_gate(60, (1, 37, 4, 8), strength=8.0) * 40.0
        self.check(inputs, "float32", cfg=self.config(32))

    def test_jit_grad_and_traced_cu_seqlens(self):
        inputs = self.make_inputs(7, "varlen", "float32", gates=("g",), initial_state=True)
        self.skip_if_refused(inputs)

        def loss(call, query, key, value, g, initial_state, cu_seqlens):
            out, final = call(query=query, key=key, value=value, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
            return jnp.sum(out**2) + jnp.sum(final**2)

        got_fn = jax.jit(jax.value_and_grad(functools.partial(loss, self.call), argnums=(0, 1, 2, 3, 4)))
        want_fn = jax.jit(jax.value_and_grad(functools.partial(loss, reference_recurrent), argnums=(0, 1, 2, 3, 4)))
        for bounds in ((0, 5, 5, 21, 40), (0, 1, 30, 31, 45)):
            args = [inputs[n] for n in ("query", "key", "value", "g", "initial_state")]
            cu = jnp.asarray(bounds, jnp.int32)
            (value, grads), (want_value, want_grads) = got_fn(*args, cu), want_fn(*args, cu)
            np.testing.assert_allclose(value, want_value, rtol=1e-4)
            for got, want in zip(grads, want_grads):
                assert_close(got, want, dtype=jnp.float32, gradient=True)

    def test_vmap_matches_per_example_calls(self):
        items = [self.make_inputs(seed, "mha_17", "float32", gates=("g",)) for seed in (10, 11)]
        names = ("query", "key", "value", "g")
        stacked = [jnp.stack([item[n] for item in items]) for n in names]
        batched = jax.jit(jax.vmap(lambda *xs: self.call(**dict(zip(names, xs)))))(*stacked)
        single = jax.jit(lambda kwargs: self.call(**kwargs))
        for i, item in enumerate(items):
            for got, want, name in zip(batched, single(item), ("output", "final_state")):
                assert_close(got[i], want, dtype=jnp.float32, name=name)

    def test_chunked_state_continues_across_calls(self):
        """Two halves with the first's final state as the second's initial state == one call."""
        inputs = self.make_inputs(8, "mha_17", "float32", gates=("g",), initial_state=True)
        call = jax.jit(lambda kwargs: self.call(**kwargs))
        whole, final = call(inputs)
        cut = 9
        first = {k: (v[:, :cut] if k in ("query", "key", "value", "g") else v) for k, v in inputs.items()}
        second = {k: (v[:, cut:] if k in ("query", "key", "value", "g") else v) for k, v in inputs.items()}
        out_a, state = call(first)
        out_b, final_b = call({**second, "initial_state": state})
        assert_close(jnp.concatenate([out_a, out_b], axis=1), whole, dtype=jnp.float32)
        assert_close(final_b, final, dtype=jnp.float32)

    # ---- bad inputs ---------------------------------------------------------------------------------

    def test_bad_inputs_raise_value_errors(self):
        good = self.make_inputs(9, "gqa_odd", "float32", gates=("g",), initial_state=True)
        q, k, v = good["query"], good["key"], good["value"]
        cases = [
            (dict(query=q[0]), "query"),
            (dict(key=k[:, :5]), "key"),
            (dict(key=jnp.concatenate([k, k[:, :, :1]], axis=2), value=jnp.concatenate([v, v[:, :, :1]], axis=2)), "key"),
            (dict(value=v.astype(jnp.bfloat16)), "value"),
            (dict(g=good["g"][..., :3]), "g"),
            (dict(initial_state=good["initial_state"][:, :, :3]), "initial_state"),
            (dict(cu_seqlens=jnp.asarray([0, 20, 10, 37], jnp.int32)), "cu_seqlens"),
            (dict(query=jnp.concatenate([q, q]), key=jnp.concatenate([k, k]), value=jnp.concatenate([v, v]),
                  g=None, initial_state=None, cu_seqlens=jnp.asarray([0, 37], jnp.int32)), "cu_seqlens"),
            (dict(precision="fast"), "precision"),
        ]
        for change, name in cases:
            with pytest.raises((ValueError, TypeError), match=name):
                self.call(**{**good, **change})
