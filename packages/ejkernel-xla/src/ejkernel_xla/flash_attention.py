"""XLA ``flash_attention``: two exact paths, one switch.

- **Dense** (``_dense``): the whole ``[B, H, Sq, Skv]`` float32 logits at once, one-shot softmax, a
  hand-written VJP that keeps the probabilities for the backward. A few large fused XLA kernels: the
  formula ``jax.nn.dot_product_attention(implementation="xla")`` runs. Memory O(S²).
- **Blockwise** (``_blockwise``): online softmax over [bq, bk] blocks in ``lax.scan`` loops, a custom VJP
  that saves only the output and the per-row log-sum-exp and recomputes the probabilities block by block;
  apart from a bias or an explicit mask (S² by themselves, read block by block) memory grows with S. With
  causal or a sliding window, block pairs that no rule lets meet are skipped.

Where the switch happens: ``XlaFlashConfig.dense`` (True/False force a path; None, the default, is this
rule, decided once per call by ``XlaFlashConfig.resolved``: the heuristic config the executor stores is the
resolved one, so it says which path ran). Dense when the call runs on a GPU or TPU, no block size is
configured, and the dense path's S² buffers fit in half of the memory JAX may allocate on the device::

    B*H*Sq*Skv * (4 + 4 + 2*itemsize)  <=  DENSE_MEMORY_SHARE * bytes_limit(device)    (H = query heads)

per element of the logits: the float32 logits and the float32 gradient of the probabilities, plus the
probabilities (kept for the backward) and the logits' gradient in the inputs' dtype -- the peak of a
forward+backward (bf16: 12 bytes, 3x the float32 logits; float32: 16; XLA's ``memory_analysis`` agrees,
docs/xla_memory.md). The other half stays for everything else. That is one call's count; a call that runs
in query chunks (below) counts the logits its chunks compute: the kept probabilities of all of them, the
transients of the largest one (``dense_peak_bytes``). S=16k (B=1, 16 heads, bf16) fits an H100 that way:
causal 15 GiB, non-causal 28, of 29.7 (one call: 48); the chunked causal forward+backward ran 3.8x faster
than the blockwise one there (117 vs 31 TFLOP/s).

A forward that is not differentiated has its own rule, the same with its own peak::

    B*H*Sq*Skv * (4 + itemsize)  <=  DENSE_MEMORY_SHARE * bytes_limit(device)

(the float32 logits and the probabilities in the inputs' dtype: ``jax.nn``'s forward holds the same; the
largest chunk's, for chunked calls). Where only this one holds the call runs through
a custom VJP whose primal -- what runs when nobody differentiates -- is the dense forward, and whose
forward and backward rules are the blockwise path's (the residuals come from the blockwise forward, so
the backward always matches the forward it belongs to): ``XlaFlashConfig(dense=False, forward_dense=True)``.
``dense=True/False`` alone forces both.

The dense forward is ``jax.nn``'s formula and no more where nothing is masked: float32 logits from the
matmul with keys as the minor axis (no S² transpose), row max, ``exp``, row sum, divide, cast, matmul;
causal adds one comparison of two iotas, and runs in query chunks over the key prefixes they can see
(``_dense.query_chunk_count``: 62.5 % of the logits at 4 chunks); calls without causality longer than
``_dense.FULL_CHUNK_QUERIES`` (8192) queries run in chunks of rows, which keeps a forward+backward's
transients to one chunk's (S=16k fits an H100 dense: 28 of 29.7 GiB). Masks, segments, varlen, sinks and
dropout add only their own work, and only when given.

Why: on a GPU the blockwise loops pay per-block kernel launches, loop overhead and small matmuls; the
dense program does not, and runs about twice as fast where it fits (H200, bf16, D=128: blockwise 35-83
TFLOP/s, the dense formula 43-163). TPUs: the same rule by the same argument (not measured here). Beyond
the budget only the blockwise path runs at all (S=64k, B=1, H=16: 256 GiB of float32 logits). CPU: the
rule never takes the dense path; there the blockwise loops are faster (cache-sized blocks, skipped causal
blocks: 1.4-7x at S=1k-4k, float32, 4 heads, 2 cores) and host memory is everyone's.

Between a differentiated forward and its backward the dense path keeps its probabilities (``B*H*Sq*Skv``
elements of the inputs' dtype) -- in a model, per layer; the rule sees one call. For training long
sequences through many layers pass ``XlaFlashConfig(dense=False)`` (or rematerialize the layer). Under
``jax.vmap`` the rule sees the per-example shapes. Every feature of ``docs/flash_attention.md`` is
implemented on both paths; nothing is refused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.flash_attention import FlashAttentionCall
from ejkernel.ops.utils.dropout import seed_bits
from ejkernel_xla._blockwise import (
    AttentionParams,
    BlockSizes,
    _flash_bwd,
    _flash_fwd,
    default_block_sizes,
    flash_attention_blockwise,
    key_tokens,
    query_tokens,
)
from ejkernel_xla._dense import dense_forward, flash_attention_dense, query_chunk_count, query_chunk_spans

DENSE_MEMORY_SHARE = 0.5
"""Share of the device memory JAX may allocate (``memory_stats()["bytes_limit"]``) that one call's dense
S² buffers may take."""


@dataclasses.dataclass(frozen=True)
class XlaBlockConfig:
    """Block sizes of the blockwise loops, forward and backward.

    The config of every XLA implementation built on the blockwise kernel alone (ring, MLA extends it). A
    user's config may leave sizes at None (512, or 256 for head_dim > 128; the backward's as the forward's;
    capped at the lengths): :meth:`with_blocks` fills them in, once per call, and the heuristic configs
    the executor stores are filled in the same way (every size the one that runs)."""

    block_q: int | None = None
    block_kv: int | None = None
    bwd_block_q: int | None = None
    bwd_block_kv: int | None = None

    @property
    def has_blocks(self) -> bool:
        return any(v is not None for v in (self.block_q, self.block_kv, self.bwd_block_q, self.bwd_block_kv))

    def block_fields(self) -> str:
        names = ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv")
        return ", ".join(f"{n}={getattr(self, n)}" for n in names if getattr(self, n) is not None)

    def blocks(self, q_len: int, kv_len: int, head_dim: int) -> BlockSizes:
        return default_block_sizes(
            q_len, kv_len, head_dim, q_block=self.block_q, kv_block=self.block_kv, bwd_q=self.bwd_block_q,
            bwd_kv=self.bwd_block_kv,
        )

    def check_path_fields(self, *names: str) -> None:
        """``ValueError`` naming the field unless each of ``names`` is True, False or None (the rule), and
        unless a ``dense=True`` config leaves the block sizes out (the dense path runs none)."""
        owner = type(self).__name__
        for name in names:
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{owner}: {name} must be True, False or None (the rule), got {getattr(self, name)!r}")
        if getattr(self, "dense", None) and self.has_blocks:
            raise ValueError(
                f"{owner}: dense=True runs no blocks, but block sizes were given ({self.block_fields()}); "
                "drop them or pass dense=False/None"
            )

    def with_blocks(self, q_len: int, kv_len: int, head_dim: int):
        """This config with every block size the loops over ``q_len`` x ``kv_len`` (heads of ``head_dim``)
        run: the given ones capped at the lengths, the rest the defaults (the class docstring)."""
        blocks = self.blocks(q_len, kv_len, head_dim)
        return dataclasses.replace(
            self, block_q=blocks.q, block_kv=blocks.kv, bwd_block_q=blocks.bwd_q, bwd_block_kv=blocks.bwd_kv
        )


@dataclasses.dataclass(frozen=True)
class XlaFlashConfig(XlaBlockConfig):
    """Which path runs (module docstring) and the blockwise path's block sizes.

    ``dense``: True = the dense path, False = the blockwise path, None = the rule of the module docstring.
    ``forward_dense`` (with ``dense=False``): True runs a forward nobody differentiates on the dense path
    (its gradient stays the blockwise path's), False keeps it blockwise; None = as ``dense``. Setting a
    block size selects the blockwise path under the rule, and together with ``dense=True`` is an error.

    A user's config may leave any of these at None; :meth:`resolved` decides them for the call, once, where
    the call runs. The heuristic and candidate configs are resolved ones: ``dense`` and ``forward_dense``
    are bools and, where a blockwise loop runs (``dense=False``), every block size is the one it runs; a
    ``dense=True`` config runs no blocks and keeps none (its block sizes stay None).
    """

    dense: bool | None = None
    forward_dense: bool | None = None

    def __post_init__(self):
        self.check_path_fields("dense", "forward_dense")
        if self.forward_dense is not None and self.dense is None:
            raise ValueError("XlaFlashConfig: forward_dense chooses the forward beside dense=False; pass dense too")
        if self.dense and self.forward_dense is False:
            raise ValueError("XlaFlashConfig: dense=True runs the dense forward too; drop forward_dense=False")

    def resolved(self, call: FlashAttentionCall) -> XlaFlashConfig:
        """This config with everything left at None decided for ``call`` (module docstring's rule, the
        block sizes as :meth:`XlaBlockConfig.with_blocks`): what runs. A resolved config is its own."""
        dense = self.dense
        if dense is None:
            dense = not self.has_blocks and dense_fits(call, dense_budget_bytes())
        if dense:
            return XlaFlashConfig(dense=True, forward_dense=True)
        forward_dense = self.forward_dense
        if forward_dense is None:
            forward_dense = (
                self.dense is None and not self.has_blocks
                and dense_fits(call, dense_budget_bytes(), differentiated=False)
            )
        q_len, kv_len, head_dim = call.query.shape[1], call.key.shape[1], call.query.shape[3]
        return dataclasses.replace(self, dense=False, forward_dense=forward_dense).with_blocks(q_len, kv_len, head_dim)


# ---- the switch --------------------------------------------------------------------------------------


def dense_peak_bytes(call: FlashAttentionCall) -> int:
    """Peak bytes of the dense path's S² buffers in a forward+backward: the probabilities every chunk keeps
    for the backward (``itemsize`` per logit computed) plus one chunk's transients at a time (float32
    logits and probability gradient, the logit gradient in the inputs' dtype: ``8 + itemsize`` per logit
    of the largest chunk). One call (no query chunks): ``B*H*Sq*Skv * (8 + 2*itemsize)``."""
    return dense_peak_bytes_of(*_logits_counts(call), call.query.dtype.itemsize)


def dense_peak_bytes_of(total: int, largest: int, itemsize: int) -> int:
    """:func:`dense_peak_bytes` from the logit counts (all chunks, the largest chunk) and the inputs' itemsize."""
    return total * itemsize + largest * (8 + itemsize)


def dense_forward_peak_bytes(call: FlashAttentionCall) -> int:
    """Peak bytes of the dense path's S² buffers in a forward that is not differentiated:
    ``(4 + itemsize)`` per logit of the largest chunk (float32 logits; probabilities in the inputs'
    dtype); the chunks' outputs are O(S)."""
    return _logits_counts(call)[1] * (4 + call.query.dtype.itemsize)


def _logits_counts(call: FlashAttentionCall) -> tuple[int, int]:
    """``(all chunks, the largest chunk)`` logits the dense path computes (``B*H*Sq*Skv`` twice for one call;
    causal query chunks compute only the key ranges their queries see; other chunks split the rows)."""
    batch, q_len, num_heads, _ = call.query.shape
    return logits_counts(AttentionParams.of(call), batch, num_heads, q_len, call.key.shape[1], call.bias,
                         call.attention_mask, call.cum_seqlens_q is not None)


def logits_counts(params: AttentionParams, batch: int, num_heads: int, q_len: int, kv_len: int, bias=None,
                  attention_mask=None, varlen: bool = False) -> tuple[int, int]:
    """:func:`_logits_counts` of an attention of these shapes (for operations built on this one)."""
    chunks = query_chunk_count(params, q_len, kv_len, bias, attention_mask, varlen)
    sizes = [(stop - start) * (last - first) for start, stop, first, last in
             query_chunk_spans(params, q_len, kv_len, chunks)]
    return batch * num_heads * sum(sizes), batch * num_heads * max(sizes)


@functools.cache
def _device_bytes_limit(platform: str) -> int | None:
    stats = jax.local_devices(backend=platform)[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def dense_budget_bytes(platform: str | None = None) -> int | None:
    """The bytes the dense path's S² buffers may take on ``platform`` (default: JAX's default backend);
    None where the rule never takes the dense path (CPU, or a device that reports no memory limit)."""
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return None
    limit = _device_bytes_limit(platform)
    return None if limit is None else int(DENSE_MEMORY_SHARE * limit)


def dense_fits(call: FlashAttentionCall, budget: int | None, *, differentiated: bool = True) -> bool:
    """The rule's inequality (module docstring) for ``budget`` bytes (None: never): forward+backward's
    peak, or the forward's alone when ``differentiated`` is False."""
    need = dense_peak_bytes(call) if differentiated else dense_forward_peak_bytes(call)
    return budget is not None and need <= budget


def takes_dense_path(call: FlashAttentionCall, config: XlaFlashConfig, *, differentiated: bool = True) -> bool:
    """Whether ``config`` runs ``call`` on the dense path (forced, or by the rule): under differentiation
    (the default), or a forward that is not differentiated (``differentiated=False``)."""
    resolved = config.resolved(call)
    return resolved.dense if differentiated else resolved.forward_dense


# ---- the implementation ------------------------------------------------------------------------------


def _dense_primal_blockwise_vjp(blocks, params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed):
    """Not differentiated: the dense forward. Differentiated: the blockwise forward (its residuals, the
    output and the log-sum-exp) and backward. For calls whose dense forward fits but whose dense
    forward+backward does not."""
    return dense_forward(params, q, k, v, bias, aux, mask, q_tok, kv_tok, seed)


_dense_forward_blockwise_gradient = jax.custom_vjp(_dense_primal_blockwise_vjp, nondiff_argnums=(0, 1))
_dense_forward_blockwise_gradient.defvjp(_flash_fwd, _flash_bwd)


# One compiled program per (shapes, static arguments): eager lax.scan would re-trace its body per call.
@functools.partial(jax.jit, static_argnames=("params", "blocks", "forward_dense"))
def _flash_jit(
    query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, cum_seqlens_q, cum_seqlens_k,
    softmax_aux, dropout_seed, *, params: AttentionParams, blocks: BlockSizes | None, forward_dense: bool,
):
    """``blocks``: the path under differentiation (None: dense); ``forward_dense``: the path of a forward
    that is not differentiated (True whenever ``blocks`` is None)."""
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q_tokens = query_tokens(
        batch, q_len, kv_len, segment_ids=q_segment_ids, cum_seqlens_q=cum_seqlens_q, cum_seqlens_k=cum_seqlens_k
    )
    kv_tokens = key_tokens(batch, kv_len, segment_ids=kv_segment_ids, cum_seqlens_k=cum_seqlens_k)
    common = dict(
        params=params, bias=bias, softmax_aux=softmax_aux, attention_mask=attention_mask, q_tokens=q_tokens,
        kv_tokens=kv_tokens, dropout_seed=dropout_seed,
    )
    if blocks is None:
        return flash_attention_dense(query, key, value, **common)
    if not forward_dense:
        return flash_attention_blockwise(query, key, value, blocks=blocks, **common)
    seed = None if params.dropout_prob == 0.0 else seed_bits(dropout_seed)
    return _dense_forward_blockwise_gradient(
        blocks, params, query, key, value, bias, softmax_aux, attention_mask, q_tokens, kv_tokens, seed
    )


class XlaFlashAttention(Implementation[FlashAttentionCall, XlaFlashConfig]):
    config_type = XlaFlashConfig

    def heuristic_config(self, call: FlashAttentionCall) -> XlaFlashConfig:
        """The rule's path and the default block sizes, decided (``XlaFlashConfig().resolved(call)``)."""
        return XlaFlashConfig().resolved(call)

    def candidate_configs(self, call: FlashAttentionCall) -> list[XlaFlashConfig]:
        """Both paths where the dense one fits the device (autotuning times them), else nothing to tune."""
        if not dense_fits(call, dense_budget_bytes()):
            return []
        return [XlaFlashConfig(dense=True).resolved(call), XlaFlashConfig(dense=False).resolved(call)]

    def __call__(self, call: FlashAttentionCall, config: XlaFlashConfig) -> jax.Array:
        config = config.resolved(call)  # a user's config may leave fields to the rule; the executor's are resolved
        blocks = None if config.dense else config.blocks(call.query.shape[1], call.key.shape[1], call.query.shape[3])
        return _flash_jit(
            call.query, call.key, call.value, call.bias, call.attention_mask, call.q_segment_ids,
            call.kv_segment_ids, call.cum_seqlens_q, call.cum_seqlens_k, call.softmax_aux,
            None if call.dropout_seed is None else seed_bits(call.dropout_seed),  # any int: its low 32 bits
            params=AttentionParams.of(call), blocks=blocks, forward_dense=config.forward_dense,
        )


IMPLEMENTATION = XlaFlashAttention()
