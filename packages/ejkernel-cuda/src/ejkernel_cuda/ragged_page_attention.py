"""``ragged_page_attention`` on our own Hopper paged flash-attention forward (``csrc/flash_attention/
paged_forward.cu``, sm_90a), bound through the XLA FFI as ``EjkPagedForward``.

The FFI contract: ``EjkPagedForward(queries [T, Hq, D], kv_pages [P, page_size, 2 * Hkv, D] (D = 64 or 128;
queries' dtype, K/V interleaved on axis 2), context_lens int32 [S], block_tables int32 [S, pages_per_seq],
query_start_loc int32 [S + 1], num_seqs int32 [1], sinks float32 [Hq, max(num_sinks, 1)]) -> (out [T, Hq, D],
work int32 [WORK_INTS], partials float32 [SPLIT_SLOTS, 64, 130])``, attributes ``softmax_scale`` (f32),
``packed_share`` (i32), ``softcap`` (f32, 0: off), ``window_left`` (i32: a query at position p sees keys
[p - window_left, p]; -1: no window) and ``num_sinks`` (i32, 0: none, the sinks buffer unread). The last two
results are the kernel's scratch (the ticket counter and split-K's pair descriptors, zeroed by the handler;
split-K's partial tiles), allocated by XLA and ignored. Causal within each sequence (the operation's
definition); rows past ``query_start_loc[num_seqs]`` are zeros.

Taken: bfloat16/float16, head_dim 64 or 128, page sizes that are multiples of 64, GQA/MQA, any ``softmax_scale > 0``,
logits soft cap, sliding window (``sliding_window`` = W keys, the query's own included: ``window_left = W - 1``),
attention sinks (``softmax_aux`` [Hq] or [Hq, num_sinks]), on a GPU of compute capability 9.0 with the native
library built. Refused (``UnsupportedFeature``, before anything compiles): quantized pages or scales, other
dtypes, head dims and page sizes, no such GPU, the library missing. Forward-only (a gradient raises
``UnsupportedFeature``); ``jax.vmap`` runs one launch per element of the mapped axis (``ffi_call``'s
``vmap_method="sequential"``).

Work items (the kernel's comment has the details): 128-row query tiles of one query head (prefill chunks), and
packed tiles for sequences of at most ``64 / G`` rows (G = query heads per kv head; decode rows, short
speculative chunks): the G heads of one kv head in one tile, so each page is read once per kv head. Persistent
CTAs take both kinds, mixed in rounds (``CudaPagedConfig.packed_share``), from one counter, so that page
streaming (decode rows) and matrix products (prefill tiles) run on different SMs at the same time; both consumer
warpgroups of a packed tile hold its rows and take alternate key blocks. ``max_num_seqs`` up to
:data:`MAX_SEQS`.

Split-K (flash-decoding), decided on the device from the call's data: when the batch holds fewer packed tiles
than two per SM (few decode sequences, e.g. 2 over 32k tokens), each packed tile's keys are cut into chunks
(whole 128-key blocks, at least 1024 keys, at most 16 chunks) that run on different SMs and write unnormalized
partial rows to the ``partials`` scratch; a second kernel of the same handler merges them (log-sum-exp) into the
output. The scratch's size is static (:data:`SPLIT_SLOTS` partial tiles): splitting aims at
``min(2 * SMs, SPLIT_SLOTS / 2)`` items and makes fewer than twice that, on any GPU. Full batches (two packed
tiles per SM or more) do not split. Verified on the GPU (its tests, split-K's included, and the shared
conformance suite: H200, 2026-11-27 14:35 UTC; H100, 15:09 UTC, with 16 launches in one executable; soft cap,
window, sinks and head_dim 64: H100, 17:30 UTC).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.errors import UnsupportedFeature
from ejkernel.modules.operations._contract import Implementation
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttentionCall
from ejkernel_cuda import _native, native_flash

NAME = "cuda paged flash attention"
DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
"""Head dims compiled (queries, keys and values alike)."""
HEAD_DIM = max(HEAD_DIMS)
"""The widest: it sizes split-K's partial tiles (a narrower head dim uses the first columns of a slot)."""
PAGE_MULTIPLE = 64
BLOCK_Q = 128
"""Query rows per CTA (two consumer warpgroups of 64): compiled in."""
BLOCK_KV = 128
"""Keys per step (two 64-row TMA chunks of pages): compiled in."""
MAX_SEQS = 4096
"""Sequence slots (``max_num_seqs``) the kernel takes: its work table (8 bytes a slot) lives in shared memory."""
PRIORITY = 18
"""Rank under ``platform="auto"``: above Triton (15) and XLA; calls it refuses (module docstring) fall to those.
Measured (2026-11-27; 32 q / 8 kv heads, D = 128, pages of 64): the mixed batch of ``benchmarks/decode.py``
1.47 x Triton on an H100 and 1.32 x on an H200; all-decode batches of 1-64 rows over 512-32k tokens 1.1-4.0 x on
an H200 (``benchmarks/results/nvidia-h200-2026-11-27i-cuda-paged-grid.json``; 64 x 32k: 0.98 x, both at the copy
bandwidth) and 1.03-3.6 x on an H100 (``...-h100-2026-11-27j-cuda-paged-grid.json``); with soft cap, window and
sinks 1.8-2.3 x, gpt-oss's shape (D = 64) 2.6-4.0 x (H100)."""


SPLIT_SLOTS = 4 * 132
"""Partial tiles split-K's scratch holds (the kernel's ``kSplitSlots``): it aims at ``min(2 * SMs, SPLIT_SLOTS / 2)``
items and makes fewer than twice that."""
SPLIT_SLOT_ROWS = 64
"""Rows of a partial tile (a packed tile's): each a row of O (``HEAD_DIM`` floats), then the rows' maxima and sums."""
WORK_INTS = 4 * (1 + SPLIT_SLOTS)
"""The int32 work buffer: the ticket counter (16 bytes), then one 16-byte pair descriptor per slot."""
DEAL_ROUND = 8
"""Tickets per round of the kernel's hand-out order (``packed_share`` of them packed tiles)."""
PACKED_SHARE = 3
"""The default share: set from the mixed-batch measurements (NOTES.md: 3 beat 4 by ~3 % on an H100 with packed tiles
on three stages, and 3-5 tied on an H200 before)."""


@dataclasses.dataclass(frozen=True)
class CudaPagedConfig:
    """The kernel's schedule, spelled out: ``block_q`` query rows per query tile and ``block_kv`` keys per step
    (compiled sizes: only those are taken), ``packed_share`` packed tiles (decode rows) per 8 items handed out
    while both kinds last (0-8: more keeps more SMs streaming pages beside the prefill tiles)."""

    block_q: int = BLOCK_Q
    block_kv: int = BLOCK_KV
    packed_share: int = PACKED_SHARE

    def __post_init__(self):
        for name, compiled in (("block_q", BLOCK_Q), ("block_kv", BLOCK_KV)):
            value = getattr(self, name)
            if value != compiled:
                raise ValueError(f"CudaPagedConfig.{name} must be {compiled} (the compiled tile), got {value!r}")
        if not (isinstance(self.packed_share, int) and 0 <= self.packed_share <= DEAL_ROUND):
            raise ValueError(f"CudaPagedConfig.packed_share must be an int in [0, {DEAL_ROUND}], "
                             f"got {self.packed_share!r}")


def refusal(call: RaggedPageAttentionCall, *, check_device: bool = True) -> str | None:
    """Why the paged kernel cannot take ``call`` here, or None: the call's features first (named on any
    machine), then the GPU and the library (``check_device=False``: the call alone)."""
    queries, kv_pages = call.queries, call.kv_pages
    if call.key_scale is not None or call.value_scale is not None:
        return "key_scale/value_scale (quantized pages) is not supported"
    if kv_pages.dtype != queries.dtype:
        return f"kv_pages dtype {kv_pages.dtype} (quantized pages) is not supported (the queries' dtype)"
    if queries.dtype not in DTYPES:
        return f"dtype {queries.dtype} is not supported (bfloat16 or float16)"
    if queries.shape[-1] not in HEAD_DIMS:
        return f"head_dim {queries.shape[-1]} is not supported (only {' or '.join(map(str, HEAD_DIMS))})"
    page_size = kv_pages.shape[1]
    if page_size % PAGE_MULTIPLE:
        return f"page_size {page_size} is not supported (a multiple of {PAGE_MULTIPLE}: whole TMA boxes of keys)"
    if not call.softmax_scale > 0:
        return f"softmax_scale={call.softmax_scale} (the kernel needs a positive scale)"
    if call.context_lens.shape[0] > MAX_SEQS:
        return (f"max_num_seqs {call.context_lens.shape[0]} is not supported (at most {MAX_SEQS}: the kernel's work "
                "table lives in shared memory)")
    if kv_pages.shape[0] * page_size >= 2**31:
        return f"{kv_pages.shape[0]} pages of {page_size} keys: more rows than 32-bit TMA coordinates hold"
    if not check_device:
        return None
    return native_flash.usable_here()


def check_supported(call: RaggedPageAttentionCall, *, check_device: bool = True) -> None:
    """Raise ``UnsupportedFeature`` naming :func:`refusal`'s reason."""
    reason = refusal(call, check_device=check_device)
    if reason is not None:
        raise UnsupportedFeature(f"{NAME}: {reason}")


def paged_ffi_call(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, sinks, *, scale: float,
                   packed_share: int, softcap: float = 0.0, window_left: int = -1, num_sinks: int = 0):
    """The FFI call on the contract's arrays (module docstring: int32 indices, float32 sinks [Hq, max(num_sinks,
    1)]): (out, work, partials). The last two are the kernel's scratch, allocated by XLA: the work buffer (ticket
    counter, split-K's descriptors: zeroed by the handler before the launch) and split-K's partial tiles (static
    size: the kernel bounds its slots); benchmarks/experiments/cuda_paged_timeline.py reads them."""
    results = (jax.ShapeDtypeStruct(queries.shape, queries.dtype), jax.ShapeDtypeStruct((WORK_INTS,), jnp.int32),
               jax.ShapeDtypeStruct((SPLIT_SLOTS, SPLIT_SLOT_ROWS, HEAD_DIM + 2), jnp.float32))
    return jax.ffi.ffi_call(_native.PAGED_TARGET, results, vmap_method="sequential")(
        queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, sinks,
        softmax_scale=np.float32(scale), packed_share=np.int32(packed_share), softcap=np.float32(softcap),
        window_left=np.int32(window_left), num_sinks=np.int32(num_sinks))


@functools.lru_cache(maxsize=None)
def _paged_call(scale: float, packed_share: int, softcap: float, window_left: int, num_sinks: int):
    """The FFI call for one softmax scale, schedule, soft cap (0: off), window (-1: none) and sink count (0:
    none): forward-only, vmapped by one launch per element."""

    def forward(*arrays):
        return paged_ffi_call(*arrays, scale=scale, packed_share=packed_share, softcap=softcap,
                              window_left=window_left, num_sinks=num_sinks)[0]

    @jax.custom_vjp
    def attend(*arrays):
        return forward(*arrays)

    def attend_bwd(_, d_out):
        raise UnsupportedFeature(f"{NAME} is forward-only (an inference kernel); for gradients use platform='xla'")

    attend.defvjp(lambda *arrays: (forward(*arrays), None), attend_bwd)
    return attend


def paged_attention(queries, kv_pages, context_lens, block_tables, query_start_loc, num_seqs, sinks=None, *,
                    scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
                    config: CudaPagedConfig = CudaPagedConfig()):
    """The kernel on the FFI contract's arrays (module docstring); the targets registered first. ``sinks``:
    ``[Hq]`` or ``[Hq, num_sinks]`` logits joining every row's softmax denominator; ``soft_cap``:
    ``c * tanh(logit / c)``; ``sliding_window``: each query sees at most this many keys, itself included."""
    _native.ensure_registered()
    if queries.shape[0] == 0:
        return queries
    heads = queries.shape[1]
    if sinks is None:
        num_sinks, sinks = 0, jnp.zeros((heads, 1), jnp.float32)  # unread (num_sinks = 0)
    else:
        sinks = jnp.reshape(sinks, (heads, -1)).astype(jnp.float32)
        num_sinks = sinks.shape[1]
    window_left = -1 if sliding_window is None else int(sliding_window) - 1
    call = _paged_call(float(scale), config.packed_share, float(soft_cap or 0.0), window_left, num_sinks)
    return call(queries, kv_pages, context_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
                query_start_loc.astype(jnp.int32), jnp.reshape(num_seqs, (1,)).astype(jnp.int32), sinks)


class CudaRaggedPageAttention(Implementation[RaggedPageAttentionCall, CudaPagedConfig]):
    config_type = CudaPagedConfig

    def supports(self, call: RaggedPageAttentionCall) -> None:
        check_supported(call)

    def priority_for(self, call: RaggedPageAttentionCall) -> int | None:
        return PRIORITY

    def heuristic_config(self, call: RaggedPageAttentionCall) -> CudaPagedConfig:
        return CudaPagedConfig()

    def candidate_configs(self, call: RaggedPageAttentionCall) -> Sequence[CudaPagedConfig]:
        # the mixed batch's schedules worth trying: 3 measured best on an H100, 3-5 tied on an H200 (NOTES.md)
        return tuple(CudaPagedConfig(packed_share=share) for share in (3, 4, 5))

    def __call__(self, call: RaggedPageAttentionCall, config: CudaPagedConfig) -> jax.Array:
        check_supported(call)
        return paged_attention(call.queries, call.kv_pages, call.context_lens, call.block_tables,
                               call.query_start_loc, call.num_seqs, call.softmax_aux, scale=call.softmax_scale,
                               soft_cap=call.logits_soft_cap, sliding_window=call.sliding_window, config=config)


IMPLEMENTATION = CudaRaggedPageAttention()
