"""``multi_head_latent_attention`` (alias ``flash_mla``, ``mla_attention``): DeepSeek multi-head latent
attention, keys and values given as a shared low-rank latent plus per-head up-projections.

Core validates the public call into one frozen :class:`MultiHeadLatentAttentionCall`, all a backend
sees (``softmax_scale=None`` -> ``1/sqrt(head_dim + rope_dim)``, ``cu_seqlens`` -> int32, ``precision``):

- ``query`` ``[batch, seq_len, num_heads, head_dim]``; ``key_value`` ``[batch, seq_len, kv_lora_rank]``
  (the latent); ``w_kc`` ``[kv_lora_rank, num_kv_heads, head_dim]`` and ``w_vc``
  ``[kv_lora_rank, num_kv_heads, v_head_dim]`` (the up-projections); ``b_q`` ``[batch, seq_len, rope_dim]``
  or ``[batch, seq_len, num_heads, rope_dim]`` and ``b_k`` ``[batch, seq_len, rope_dim]`` (the decoupled
  RoPE parts; both or neither); ``cu_seqlens`` int32 ``[num_seqs + 1]`` or None (varlen: ``batch == 1``).
  Every float input has one dtype. ``num_heads % num_kv_heads == 0``; query head ``h`` uses kv head
  ``g(h) = h // (num_heads // num_kv_heads)``.
- ``key[b, j, k] = sum_r key_value[b, j, r] * w_kc[r, k]``, ``value[b, j, k] = sum_r key_value[b, j, r] * w_vc[r, k]``.
- Logits in float32: ``softmax_scale * (<query[b,i,h], key[b,j,g(h)]> + <b_q[b,i,(h)], b_k[b,j]>)``
  (default scale ``1/sqrt(head_dim + rope_dim)``, ``rope_dim = 0`` without RoPE parts).
- Visible: ``causal``: ``j <= i``; varlen: ``i`` and ``j`` in the same sequence of ``cu_seqlens``; tokens
  past ``cu_seqlens[-1]`` belong to none and output zeros. Softmax over visible keys;
  ``out[b,i,h] = sum_j P[i,j] value[b,j,g(h)]`` in ``query``'s dtype, ``[batch, seq_len, num_heads, v_head_dim]``.

Gradients: ``query``, ``key_value``, ``w_kc``, ``w_vc``, ``b_q`` and ``b_k`` (all required of every backend).
"""

from __future__ import annotations

from typing import Any

import jax
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    check_array,
    check_bool,
    check_dim,
    check_gqa,
    check_same_dtype,
    describe,
    normalize_packed_seqlens,
    resolve_softmax_scale,
)


@canonical_call
class MultiHeadLatentAttentionCall:
    """A validated ``multi_head_latent_attention`` call: what every backend receives (see above)."""

    query: Float[jax.Array, "batch seq_len num_heads head_dim"] = array_field()
    key_value: Float[jax.Array, "batch seq_len kv_lora_rank"] = array_field()
    w_kc: Float[jax.Array, "kv_lora_rank num_kv_heads head_dim"] = array_field()
    w_vc: Float[jax.Array, "kv_lora_rank num_kv_heads v_head_dim"] = array_field()
    b_q: Float[jax.Array, "batch seq_len rope_dim"] | Float[jax.Array, "batch seq_len num_heads rope_dim"] | None = (
        array_field()
    )
    """Given together with ``b_k`` or not at all."""
    b_k: Float[jax.Array, "batch seq_len rope_dim"] | None = array_field()
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = array_field()
    """int32; then batch is 1."""
    softmax_scale: float = 1.0
    causal: bool = False
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


class MultiHeadLatentAttention(RegistryOperation):
    """DeepSeek multi-head latent attention (see the module docstring)."""

    algorithm = "multi_head_latent_attention"

    def canonicalize(self, args: Arguments) -> MultiHeadLatentAttentionCall:
        query, key_value, w_kc, w_vc, b_q, b_k = args.query, args.key_value, args.w_kc, args.w_vc, args.b_q, args.b_k
        check_array("query", query, rank=4, dtypes=FLOAT_DTYPES, what="[batch, seq_len, num_heads, head_dim]")
        check_array("key_value", key_value, rank=3, dtypes=FLOAT_DTYPES, what="[batch, seq_len, kv_lora_rank]")
        check_array("w_kc", w_kc, rank=3, dtypes=FLOAT_DTYPES, what="[kv_lora_rank, num_kv_heads, head_dim]")
        check_array("w_vc", w_vc, rank=3, dtypes=FLOAT_DTYPES, what="[kv_lora_rank, num_kv_heads, v_head_dim]")
        check_same_dtype("query", query, key_value=key_value, w_kc=w_kc, w_vc=w_vc, b_q=b_q, b_k=b_k)
        batch, seq_len, num_heads, head_dim = query.shape
        rank = key_value.shape[2]
        check_dim("key_value", key_value, 0, batch, "batch of query")
        check_dim("key_value", key_value, 1, seq_len, "seq_len of query (self-attention)")
        check_dim("w_kc", w_kc, 0, rank, "kv_lora_rank of key_value")
        check_dim("w_kc", w_kc, 2, head_dim, "head_dim of query")
        check_dim("w_vc", w_vc, 0, rank, "kv_lora_rank of key_value")
        check_dim("w_vc", w_vc, 1, w_kc.shape[1], "num_kv_heads of w_kc")
        check_gqa("query", num_heads, "w_kc", w_kc.shape[1], w_kc)
        rope_dim = 0
        if (b_q is None) != (b_k is None):
            raise ValueError(
                f"b_q and b_k come together (the RoPE parts of queries and keys), got b_q={describe(b_q)}, b_k={describe(b_k)}"
            )
        if b_q is not None:
            check_array("b_k", b_k, rank=3, dtypes=FLOAT_DTYPES, what="[batch, seq_len, rope_dim]")
            check_dim("b_k", b_k, 0, batch, "batch of query")
            check_dim("b_k", b_k, 1, seq_len, "seq_len of query")
            rope_dim = b_k.shape[2]
            check_array(
                "b_q",
                b_q,
                dtypes=FLOAT_DTYPES,
                what="[batch, seq_len, rope_dim] or [batch, seq_len, num_heads, rope_dim]",
            )
            expected = [(batch, seq_len, rope_dim), (batch, seq_len, num_heads, rope_dim)]
            if tuple(b_q.shape) not in expected:
                raise ValueError(
                    f"b_q must have shape {list(expected[0])} or {list(expected[1])} (from query and b_k), got {describe(b_q)}"
                )
        return args.build(
            MultiHeadLatentAttentionCall,
            cu_seqlens=normalize_packed_seqlens(args.cu_seqlens, query),
            softmax_scale=resolve_softmax_scale(args.softmax_scale, head_dim + rope_dim),
            causal=check_bool("causal", args.causal),
            precision=resolve_precision(args.precision, query.dtype),
        )


@public_function(MultiHeadLatentAttention)
def multi_head_latent_attention(
    query: Float[jax.Array, "batch seq_len num_heads head_dim"],
    key_value: Float[jax.Array, "batch seq_len kv_lora_rank"],
    w_kc: Float[jax.Array, "kv_lora_rank num_kv_heads head_dim"],
    w_vc: Float[jax.Array, "kv_lora_rank num_kv_heads v_head_dim"],
    b_q: Float[jax.Array, "batch seq_len rope_dim"]
    | Float[jax.Array, "batch seq_len num_heads rope_dim"]
    | None = None,
    b_k: Float[jax.Array, "batch seq_len rope_dim"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    cu_seqlens: Int[jax.Array, "num_seqs_plus_one"] | None = None,
    platform: str = "auto",
    *,
    precision: str | jax.lax.Precision | None = None,
    cfg: Any = None,
) -> Float[jax.Array, "batch seq_len num_heads v_head_dim"]:
    """Multi-head latent attention (see the module docstring for the exact semantics).

    Args:
        query: ``[batch, seq_len, num_heads, head_dim]``.
        key_value: the compressed KV latent ``[batch, seq_len, kv_lora_rank]``.
        w_kc, w_vc: key/value up-projections ``[kv_lora_rank, num_kv_heads, head_dim | v_head_dim]``.
        b_q, b_k: decoupled RoPE parts of queries (``[batch, seq_len, (num_heads,) rope_dim]``) and keys.
        softmax_scale: logit scale (default ``1/sqrt(head_dim + rope_dim)``).
        causal: key ``j`` visible to query ``i`` only when ``j <= i``.
        cu_seqlens: int ``[num_seqs + 1]`` packed sequences (``batch == 1``).
        platform: ``"auto"`` or a platform name.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs, see
            ``docs/precision.md``); ``"default"`` allows TF32 on NVIDIA GPUs.
        cfg: one implementation's config (e.g. ``ejkernel_xla.multi_head_latent_attention.XlaMlaConfig``);
            it selects that implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[batch, seq_len, num_heads, v_head_dim]`` in ``query``'s dtype.
    """
    return execute(MultiHeadLatentAttention(), **locals())


flash_mla = multi_head_latent_attention
mla_attention = multi_head_latent_attention
FlashMLA = MultiHeadLatentAttention
