"""``native_sparse_attention`` on the GPU: the selected branch as Triton kernels.

The compressed branch, the selection, varlen and the gates are core's (``operations._nsa_branches``,
plain jnp: the compressed branch is ``block_size`` times smaller than full attention); the window branch
is flash attention with a causal ``(window_size - 1, 0)`` window through the dispatcher (cuDNN or the
Triton flash kernels). The selected branch, where the time goes, is three kernels whose work is
proportional to the selected blocks:

- forward: one program per (token, kv head) holds the ``G`` query heads of the group as one
  ``[BLOCK_G, D]`` tile (GQA packed: the group shares its selection) and walks only that token's selected
  key blocks with an online softmax; it writes the output (float32) and the log-sum-exp;
- dQ: the same programs, recomputing the probabilities from the log-sum-exp;
- dK/dV: one program per (key block, kv head) walks the tokens that selected that block (an inverted index
  built in JAX: the selections sorted by block), ``BLOCK_T`` tokens at a time, one query head of the
  group after the other; every key block belongs to one program, so nothing is added atomically.

Slots are cleaned in JAX before the kernels (``usable_slots``: counts, bounds, duplicates once); a
cleaned-away slot holds -1 and is skipped. Rows that see no key (only with user-given indices that select
nothing usable) output zeros. Refused (``UnsupportedFeature``; the XLA implementation takes them): head
dims above 256 or below 16, block sizes above 128. Config: :class:`TritonNsaConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations._nsa_branches import native_sparse_attention_from_branches, usable_slots
from ejkernel.modules.operations._precision import matmul_precision
from ejkernel.modules.operations.native_sparse_attention import NativeSparseAttentionCall
from ejkernel_triton.batching import fold_batch_rule
from ejkernel_triton.interpret import interpreting
from ejkernel_triton.launch import launch

__all__ = ["IMPLEMENTATION", "TritonNativeSparseAttention", "TritonNsaConfig"]

MIN_HEAD_DIM, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 128


@dataclasses.dataclass(frozen=True)
class TritonNsaConfig:
    """``block_tokens``: tokens per step of the dK/dV kernel (a power of two, at least 16: a tensor-core
    tile); ``num_warps`` / ``num_stages`` of the three kernels."""

    block_tokens: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        value = self.block_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"TritonNsaConfig.block_tokens must be a power of two >= 16, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"TritonNsaConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps!r}")
        if self.num_stages not in (1, 2, 3, 4):
            raise ValueError(f"TritonNsaConfig.num_stages must be 1 to 4, got {self.num_stages!r}")


# ---- kernels -----------------------------------------------------------------------------------------


@triton.jit
def _group_rows(X, b, t, kh, T, H: tl.constexpr, G: tl.constexpr, DX: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_DX: tl.constexpr):
    """Pointers and mask of the ``[BLOCK_G, BLOCK_DX]`` tile of token ``t``'s group heads in ``X`` [B, T, H, DX]."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_x = tl.arange(0, BLOCK_DX)
    row = (b.to(tl.int64) * T + t) * H + kh * G + offs_g
    return X + row[:, None] * DX + offs_x[None, :], (offs_g[:, None] < G) & (offs_x[None, :] < DX)


@triton.jit
def _key_block(K, b, kh, c, T, HK: tl.constexpr, DX: tl.constexpr, BS: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_DX: tl.constexpr):
    """Columns, column mask and the ``[BLOCK_K, BLOCK_DX]`` tile of key block ``c`` of kv head ``kh`` in ``K``."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_x = tl.arange(0, BLOCK_DX)
    cols = c * BS + offs_k
    in_block = (offs_k < BS) & (cols < T)
    rows = (b.to(tl.int64) * T + cols) * HK + kh
    tile = tl.load(K + rows[:, None] * DX + offs_x[None, :], mask=in_block[:, None] & (offs_x[None, :] < DX),
                   other=0.0)
    return cols, in_block, tile


@triton.jit
def _selected_block(K, V, b, kh, c, t, T, HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Key block ``c`` as token ``t`` sees it: (visible columns ``[BLOCK_K]``, keys, values)."""
    cols, in_block, k = _key_block(K, b, kh, c, T, HK, D, BS, BLOCK_K, BLOCK_D)
    _, _, v = _key_block(V, b, kh, c, T, HK, DV, BS, BLOCK_K, BLOCK_DV)
    return in_block & (cols <= t), k, v


@triton.jit
def _forward_kernel(Q, K, V, Slots, T, O, LSE, SCALE: tl.constexpr, H: tl.constexpr, HK: tl.constexpr,
                    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, N: tl.constexpr, BS: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1) // HK
    kh = tl.program_id(1) % HK
    q_ptrs, q_mask = _group_rows(Q, b, t, kh, T, H, G, D, BLOCK_G, BLOCK_D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    qk_scale = SCALE * 1.4426950408889634  # log2(e): the softmax runs in base 2
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    slots = Slots + ((b.to(tl.int64) * T + t) * HK + kh) * N
    for i in range(N):
        c = tl.load(slots + i)
        if c >= 0:
            visible, k, v = _selected_block(K, V, b, kh, c, t, T, HK, D, DV, BS, BLOCK_K, BLOCK_D, BLOCK_DV)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    o_ptrs, o_mask = _group_rows(O, b, t, kh, T, H, G, DV, BLOCK_G, BLOCK_DV)
    tl.store(o_ptrs, out, mask=o_mask)
    offs_g = tl.arange(0, BLOCK_G)
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + (b.to(tl.int64) * T + t) * H + kh * G + offs_g, lse, mask=offs_g < G)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, Delta, Slots, T, DQ, SCALE: tl.constexpr, H: tl.constexpr, HK: tl.constexpr,
               G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, N: tl.constexpr, BS: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1) // HK
    kh = tl.program_id(1) % HK
    q_ptrs, q_mask = _group_rows(Q, b, t, kh, T, H, G, D, BLOCK_G, BLOCK_D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    do_ptrs, do_mask = _group_rows(DO, b, t, kh, T, H, G, DV, BLOCK_G, BLOCK_DV)
    do = tl.load(do_ptrs, mask=do_mask, other=0.0)
    offs_g = tl.arange(0, BLOCK_G)
    head_rows = (b.to(tl.int64) * T + t) * H + kh * G + offs_g
    lse = tl.load(LSE + head_rows, mask=offs_g < G, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that saw nothing has no gradient
    delta = tl.load(Delta + head_rows, mask=offs_g < G, other=0.0)
    dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slots = Slots + ((b.to(tl.int64) * T + t) * HK + kh) * N
    for i in range(N):
        c = tl.load(slots + i)
        if c >= 0:
            visible, k, v = _selected_block(K, V, b, kh, c, t, T, HK, D, DV, BS, BLOCK_K, BLOCK_D, BLOCK_DV)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE
            p = tl.where(visible[None, :], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq_ptrs, dq_mask = _group_rows(DQ, b, t, kh, T, H, G, D, BLOCK_G, BLOCK_D)
    tl.store(dq_ptrs, dq * SCALE, mask=dq_mask)


@triton.jit
def _dkv_kernel(Q, K, V, DO, LSE, Delta, Tokens, Starts, T, DK, DV_OUT, SCALE: tl.constexpr, H: tl.constexpr,
                HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, N: tl.constexpr,
                NUM_BLOCKS: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1) // HK
    kh = tl.program_id(1) % HK
    cols, in_block, k = _key_block(K, b, kh, c, T, HK, D, BS, BLOCK_K, BLOCK_D)
    _, _, v = _key_block(V, b, kh, c, T, HK, DV, BS, BLOCK_K, BLOCK_DV)
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_DV], tl.float32)
    row = tl.program_id(1).to(tl.int64)
    first = tl.load(Starts + row * (NUM_BLOCKS + 1) + c)
    end = tl.load(Starts + row * (NUM_BLOCKS + 1) + c + 1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for e in range(first, end, BLOCK_T):
        live = e + offs_t < end
        tokens = tl.load(Tokens + row * T * N + e + offs_t, mask=live, other=0)
        visible = live[:, None] & in_block[None, :] & (cols[None, :] <= tokens[:, None])
        for g in range(G):
            head_rows = (b.to(tl.int64) * T + tokens) * H + kh * G + g
            q = tl.load(Q + head_rows[:, None] * D + offs_d[None, :], mask=live[:, None] & (offs_d[None, :] < D),
                        other=0.0)
            do = tl.load(DO + head_rows[:, None] * DV + offs_dv[None, :],
                         mask=live[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(LSE + head_rows, mask=live, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
            delta = tl.load(Delta + head_rows, mask=live, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    rows = (b.to(tl.int64) * T + cols) * HK + kh
    tl.store(DK + rows[:, None] * D + offs_d[None, :], dk * SCALE, mask=in_block[:, None] & (offs_d[None, :] < D))
    tl.store(DV_OUT + rows[:, None] * DV + offs_dv[None, :], dv, mask=in_block[:, None] & (offs_dv[None, :] < DV))


# ---- launches, inverted index, custom VJP ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    config: TritonNsaConfig
    softmax_scale: float
    block_size: int
    interpret: bool


def _meta(q, k, v, slots, st: _Static) -> dict:
    _, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    pow2 = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731 -- tensor-core tiles are 16 wide at least
    return dict(SCALE=st.softmax_scale, H=h, HK=hk, G=h // hk, D=d, DV=dv, N=slots.shape[-1], BS=st.block_size,
                BLOCK_D=pow2(d), BLOCK_DV=pow2(dv), BLOCK_K=pow2(st.block_size),
                DOT_PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def _launch_params(st: _Static) -> dict:
    return dict(num_warps=st.config.num_warps, num_stages=st.config.num_stages, interpret=st.interpret)


def _forward(q, k, v, slots, st: _Static):
    b, t, h, _ = q.shape
    meta = _meta(q, k, v, slots, st)
    out_shapes = (jax.ShapeDtypeStruct((b, t, h, v.shape[3]), jnp.float32), jax.ShapeDtypeStruct((b, t, h), jnp.float32))
    return launch(_forward_kernel, (q, k, v, slots, t), out_shapes, (t, b * meta["HK"]), **_launch_params(st),
                  BLOCK_G=max(16, triton.next_power_of_2(meta["G"])), **meta)


def _inverted_index(slots, num_blocks: int):
    """(tokens [B * HK, T * N] int32: the tokens of each (batch, kv head) sorted by the block they selected;
    starts [B * HK, num_blocks + 1] int32: where each block's tokens begin). Cleaned-away slots sort last."""
    b, t, hk, n = slots.shape
    keys = jnp.where(slots >= 0, slots, num_blocks).transpose(0, 2, 1, 3).reshape(b * hk, t * n)
    order = jnp.argsort(keys, axis=-1, stable=True)
    sorted_keys = jnp.take_along_axis(keys, order, axis=-1)
    starts = jax.vmap(lambda row: jnp.searchsorted(row, jnp.arange(num_blocks + 1), side="left"))(sorted_keys)
    return (order // n).astype(jnp.int32), starts.astype(jnp.int32)


def _backward(q, k, v, slots, out, lse, d_out, st: _Static):
    b, t, h, _ = q.shape
    meta = _meta(q, k, v, slots, st)
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)  # [B, T, H]
    (dq,) = launch(_dq_kernel, (q, k, v, d_out, lse, delta, slots, t), (jax.ShapeDtypeStruct(q.shape, q.dtype),),
                   (t, b * meta["HK"]), **_launch_params(st), BLOCK_G=max(16, triton.next_power_of_2(meta["G"])),
                   **meta)
    num_blocks = math.ceil(t / st.block_size)
    tokens, starts = _inverted_index(slots, num_blocks)
    dk, dv = launch(_dkv_kernel, (q, k, v, d_out, lse, delta, tokens, starts, t),
                    (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                    (num_blocks, b * meta["HK"]), **_launch_params(st), NUM_BLOCKS=num_blocks,
                    BLOCK_T=st.config.block_tokens, **meta)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _batched_calls(st: _Static):
    """The forward and backward launches with vmap rules (the vmapped axis folds into the batch)."""

    @jax.custom_batching.custom_vmap
    def forward(q, k, v, slots):
        return _forward(q, k, v, slots, st)

    forward.def_vmap(fold_batch_rule(forward, 4, 2, varlen_args=0))

    @jax.custom_batching.custom_vmap
    def backward(q, k, v, slots, out, lse, d_out):
        return _backward(q, k, v, slots, out, lse, d_out, st)

    backward.def_vmap(fold_batch_rule(backward, 7, 3, varlen_args=0))
    return forward, backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _selected(q, k, v, slots, st: _Static):
    return _batched_calls(st)[0](q, k, v, slots)[0]


def _selected_fwd(q, k, v, slots, st: _Static):
    out, lse = _batched_calls(st)[0](q, k, v, slots)
    return out, (q, k, v, slots, out, lse)


def _selected_bwd(st: _Static, residuals, d_out):
    q, k, v, slots, out, lse = residuals
    dq, dk, dv = _batched_calls(st)[1](q, k, v, slots, out, lse, d_out)
    return dq, dk, dv, None


_selected.defvjp(_selected_fwd, _selected_bwd)


def selected_branch(q, k, v, block_indices, block_counts, softmax_scale, block_size, config: TritonNsaConfig):
    """``o_slc`` [B, T, H, Dv] float32 of the selected branch through the kernels (see the module docstring)."""
    rows = jnp.arange(q.shape[1], dtype=jnp.int32)
    usable = usable_slots(block_indices, block_counts, rows, block_size)
    slots = jax.lax.stop_gradient(jnp.where(usable, block_indices, -1).astype(jnp.int32))
    st = _Static(config=config, softmax_scale=float(softmax_scale), block_size=int(block_size),
                 interpret=interpreting())
    return _selected(q, k, v, slots, st)


def _window_branch(q, k, v, softmax_scale, window_size, precision):
    from ejkernel.modules import flash_attention

    out = flash_attention(q, k, v, softmax_scale=softmax_scale, causal=True, sliding_window=(window_size - 1, 0),
                          precision=precision)
    return out.astype(jnp.float32)


class TritonNativeSparseAttention(Implementation[NativeSparseAttentionCall, TritonNsaConfig]):
    """The selected branch on Triton kernels, the rest shared (see the module docstring)."""

    config_type = TritonNsaConfig

    def supports(self, call: NativeSparseAttentionCall) -> None:
        d, dv = call.query.shape[-1], call.value.shape[-1]
        if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM):
            raise UnsupportedFeature(f"triton native_sparse_attention: head dims {d}/{dv} outside "
                                     f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (the XLA implementation takes them)")
        if call.block_size > MAX_BLOCK_SIZE:
            raise UnsupportedFeature(f"triton native_sparse_attention: block_size {call.block_size} > "
                                     f"{MAX_BLOCK_SIZE} (the XLA implementation takes it)")

    def heuristic_config(self, call: NativeSparseAttentionCall) -> TritonNsaConfig:
        return TritonNsaConfig()

    def candidate_configs(self, call: NativeSparseAttentionCall):
        return [TritonNsaConfig(), TritonNsaConfig(block_tokens=64, num_warps=8), TritonNsaConfig(num_stages=3)]

    def __call__(self, call: NativeSparseAttentionCall, config: TritonNsaConfig) -> jax.Array:
        def selected(q, k, v, block_indices, block_counts, scale, block_size):
            return selected_branch(q, k, v, block_indices, block_counts, scale, block_size, config)

        with matmul_precision(call.precision):  # the shared jnp branches (their autodiff keeps it)
            return native_sparse_attention_from_branches(call, selected, _window_branch)


IMPLEMENTATION = TritonNativeSparseAttention()
