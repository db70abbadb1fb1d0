// Pieces every Hopper flash-attention kernel of ejkernel-cuda shares: the problem description, the
// shared-memory tile layout (TMA boxes of 64 columns, 128-byte swizzle), wgmma over such tiles, the
// pipeline barriers and the visibility rule of a query row.
//
// Tile layout. A tile of R rows x D columns (16-bit elements) is stored as D/64 column panels, each R rows
// of 128 bytes, swizzled by TMA with CU_TENSOR_MAP_SWIZZLE_128B. That is wgmma's canonical 128-byte
// swizzled layout read either way:
//   K-major (rows are M or N, columns are the reduction): 8-row groups 1024 B apart (SBO); a 16-column
//     k-step is a 32-byte advance of the start address inside a panel, the next panel R*128 B further.
//   MN-major (rows are the reduction, columns are N): 8-row groups 1024 B apart (SBO), 64-column panels
//     R*128 B apart (LBO); a 16-row k-step is a 2048-byte advance.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

namespace ejk {

using cute::SM90::GMMA::Major;
using cute::SM90::GMMA::ScaleOut;

// What one attention call computes (the masking rule of ejkernel's flash_attention: query i sits at
// p = i + Sk - Sq; key j is visible when j < Sk, j <= p if causal, p - left <= j <= p + right for a
// window side that is set).
struct Problem {
  int batch, q_len, kv_len, q_heads, kv_heads;
  float softmax_scale;  // on the logits
  float softcap;        // c of c * tanh(s / c); 0: off
  int causal;
  int window_left, window_right;  // -1: unbounded (clamped to the lengths on the host)
  // The same rule as one range of key - position for every row (derived on the host, `read_problem`): key j
  // of query i is visible when j < Sk and lo_distance <= j - p <= hi_distance
  int lo_distance, hi_distance;
};

// Optional inputs, read where present: attention sinks (logits that join every row's softmax denominator) and
// segment ids (a key is visible to a query of the same id only).
struct Extras {
  const float* sinks;        // [B, Hq, num_sinks] (the Python side broadcasts the heads' sinks over the batch)
  int num_sinks;             // 0: none
  const int* q_segments;     // [B, Sq], or null
  const int* kv_segments;    // [B, Sk], or null
};

// Where the tile of index `linear` sits in the order tiles start in (a grid's CTAs start about in the order of
// their linear index; a persistent kernel hands its tiles out in it). With tiles of uneven work (causal: the
// query tiles of the last rows, the key tiles of the first keys) pair-by-pair order starts the last (head,
// batch) pair's heaviest tile near the end, and the other SMs idle while it runs (a list-scheduling tail,
// modelled at ~6 % of S = 8k causal: NOTES.md). With `section` > 0 the order runs in sections of that many
// pairs: rank 0 (each pair's heaviest tile) of every pair of the section, then rank 1, and so on, so the work
// ends on light tiles; a section's pairs are few enough for their K/V to stay in L2 (`grid_section` picks it).
// section = 0: pair by pair, each pair's tiles by rank.
struct GridTile {
  int rank, pair;
};

__device__ __forceinline__ GridTile tile_at(int linear, int tiles_per_pair, int pairs, int section) {
  if (section <= 0) return {linear % tiles_per_pair, linear / tiles_per_pair};
  const int span = section * tiles_per_pair;
  const int first = linear / span * section;  // the section's first pair
  const int width = min(section, pairs - first);  // the last section may be narrower
  const int within = linear - linear / span * span;
  return {within / width, first + within % width};
}

// The tile of this CTA when the grid has one CTA per tile, in its linear index's order.
__device__ __forceinline__ GridTile grid_tile(int tiles_per_pair, int pairs, int section) {
  const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return tile_at(linear, tiles_per_pair, pairs, section);
}

// grid_tile's section for `pairs` pairs of uneven tiles that each stream `bytes_per_pair` through L2 (0 for
// even tiles: their order does not matter, and pair by pair keeps the fewest pairs in flight).
inline int grid_section(bool uneven, double bytes_per_pair, int pairs) {
  constexpr double kSectionBytes = 16.0 * (1 << 20);  // a third of an H100's / H200's L2
  if (!uneven) return 0;
  const double fit = kSectionBytes / (bytes_per_pair > 1.0 ? bytes_per_pair : 1.0);
  return fit < 1.0 ? 1 : (fit > pairs ? pairs : static_cast<int>(fit));
}

// The keys [lo, hi] row i may see (hi < lo: none), before the block bounds.
struct RowRange {
  int lo, hi;
};

__device__ __forceinline__ RowRange visible_keys(const Problem& p, int i) {
  const int pos = i + p.kv_len - p.q_len;
  return {max(0, pos + p.lo_distance), min(p.kv_len - 1, pos + p.hi_distance)};
}

// Key blocks [first, last) that rows [row_begin, row_end) may see (block_unmasked: whether one needs the mask).
struct KeyBlocks {
  int first, last;
};

__device__ __forceinline__ KeyBlocks key_blocks(const Problem& p, int row_begin, int row_end, int block_n) {
  const int offset = p.kv_len - p.q_len;
  int hi = p.kv_len - 1;
  if (p.causal) hi = min(hi, row_end - 1 + offset);
  if (p.window_right >= 0) hi = min(hi, row_end - 1 + offset + p.window_right);
  int lo = 0;
  if (p.window_left >= 0) lo = max(lo, row_begin + offset - p.window_left);
  if (hi < lo) return {0, 0};
  return {lo / block_n, hi / block_n + 1};
}

// Whether every row of [row_begin, row_end) sees every key of [key_begin, key_end) (then no mask).
__device__ __forceinline__ bool block_unmasked(const Problem& p, int row_begin, int row_end, int key_begin,
                                               int key_end) {
  const int offset = p.kv_len - p.q_len;
  if (key_end > p.kv_len) return false;
  if (p.causal && key_end - 1 > row_begin + offset) return false;
  if (p.window_right >= 0 && key_end - 1 > row_begin + offset + p.window_right) return false;
  if (p.window_left >= 0 && key_begin < row_end - 1 + offset - p.window_left) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------------------
// Element types and the wgmma instructions over them (64 rows per warpgroup, N columns, k-steps of 16).

template <class T> struct Element;
template <> struct Element<__nv_bfloat16> {
  static constexpr CUtensorMapDataType tma_type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Element<__half> {
  static constexpr CUtensorMapDataType tma_type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <class T, int N, Major A, Major B> struct GmmaOp;
#define EJK_GMMA_OPS(TYPE, TAG, N)                                                                   \
  template <Major A, Major B> struct GmmaOp<TYPE, N, A, B> {                                        \
    using SS = cute::SM90::GMMA::MMA_64x##N##x16_F32##TAG##TAG##_SS<A, B>;                           \
    using RS = cute::SM90::GMMA::MMA_64x##N##x16_F32##TAG##TAG##_RS<Major::K, B>;                   \
  };
EJK_GMMA_OPS(__nv_bfloat16, BF16, 64)
EJK_GMMA_OPS(__nv_bfloat16, BF16, 128)
EJK_GMMA_OPS(__half, F16, 64)
EJK_GMMA_OPS(__half, F16, 128)
#undef EJK_GMMA_OPS

template <class Op, size_t... I>
__device__ __forceinline__ void gmma_ss_(uint64_t a, uint64_t b, float* acc, ScaleOut scale,
                                         std::index_sequence<I...>) {
  Op::fma(a, b, acc[I]..., scale);
}
template <class Op, size_t... I>
__device__ __forceinline__ void gmma_rs_(const uint32_t* a, uint64_t b, float* acc, ScaleOut scale,
                                         std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, acc[I]..., scale);
}

// acc (N/2 floats per thread) = or += A (smem descriptor) x B (smem descriptor), one k-step.
template <class T, int N, Major A, Major B>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, float* acc, bool accumulate) {
  gmma_ss_<typename GmmaOp<T, N, A, B>::SS>(a, b, acc, accumulate ? ScaleOut::One : ScaleOut::Zero,
                                            std::make_index_sequence<N / 2>{});
}
// acc (N/2 floats per thread) = or += A (4 registers: this thread's part of 64 x 16) x B (smem), one k-step.
template <class T, int N, Major B>
__device__ __forceinline__ void gmma_rs(const uint32_t* a, uint64_t b, float* acc, bool accumulate) {
  gmma_rs_<typename GmmaOp<T, N, Major::K, B>::RS>(a, b, acc, accumulate ? ScaleOut::One : ScaleOut::Zero,
                                                   std::make_index_sequence<N / 2>{});
}

template <int N>
__device__ __forceinline__ void fence_operands(float* acc) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(acc[i]);
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t* regs) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(regs[i]);
}

// Descriptor of the 128-byte swizzled layout above, for the operand `offset` bytes into a tile (tiles start
// 1024-byte aligned, offsets are multiples of 16). Shared addresses stay below 2^18, so the 14-bit start
// field is the address / 16 with no masking, and the descriptor is a sum: (tile / 16 + offset / 16) plus
// constants in the low word, a constant high word (stride, base offset 0, layout). A loop's descriptors of
// one tile then cost one uniform add each instead of a bitfield assembly per product.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t tile, uint32_t offset, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  const uint32_t low = (tile >> 4) + (offset >> 4) + ((leading_bytes >> 4) << 16);
  const uint32_t high =
      (stride_bytes >> 4) | (static_cast<uint32_t>(cute::SM90::GMMA::LayoutType::B128) << 30);
  return (static_cast<uint64_t>(high) << 32) | low;
}

// K-major operand: rows [row0, row0 + 64 or N) of a tile of `rows` rows, k-step `k` (16 columns).
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int rows, int row0, int k) {
  return smem_descriptor(tile, (k / 4) * rows * 128 + row0 * 128 + (k % 4) * 32, 16, 1024);
}
// MN-major operand: reduction rows [16k, 16k + 16) of a tile of `rows` rows, all its columns.
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, int rows, int k) {
  return smem_descriptor(tile, k * 16 * 128, rows * 128, 1024);
}

// `x` as a value the compiler cannot hoist out of a loop: descriptors derived from it in the loop body are
// recomputed (one uniform add each) instead of being hoisted into dozens of long-lived registers.
__device__ __forceinline__ uint32_t in_loop(uint32_t x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}

// The warpgroup of the calling thread, as a value the compiler knows to be the same across the warp (a
// shuffle from lane 0): what is computed from it (tile offsets, descriptors) then lives in uniform registers.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffff, threadIdx.x / 128, 0); }

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The kernel's shared storage at the first 1024-byte boundary of dynamic shared memory (128-byte swizzled
// tiles need it; the launch asks for 1024 bytes more). The offset is added to the __shared__ array itself,
// not to its address as an integer, so the compiler still knows the space: LDS/STS, not generic LD/ST
// (whose stores also put a MEMBAR before each proxy fence).
template <class Shared>
__device__ __forceinline__ Shared& aligned_shared() {
  extern __shared__ char raw_shared[];
  const uint32_t misalignment = smem_address(raw_shared) & 1023;
  return *reinterpret_cast<Shared*>(raw_shared + ((1024 - misalignment) & 1023));
}

// ---------------------------------------------------------------------------------------------------------
// Accumulator fragments. Thread t of a warpgroup holds, of a 64 x N float accumulator, rows
// 16 * (t / 32) + (t % 32) / 4 ("row a") and that + 8 ("row b"); element 4 * c + e is column
// 8 * c + 2 * (t % 4) + (e & 1), of row a for e < 2 and row b otherwise.

__device__ __forceinline__ int fragment_row(int thread_in_group) {
  return 16 * (thread_in_group / 32) + (thread_in_group % 32) / 4;
}
__device__ __forceinline__ int fragment_col(int thread_in_group, int element) {
  return 8 * (element / 4) + 2 * (thread_in_group % 4) + (element & 1);
}

// The 16-bit A operand of wgmma (64 x 16 per k-step) from a float accumulator of the same rows: the
// layouts coincide, two floats per register.
template <class T, int N>
__device__ __forceinline__ void to_operand(const float* acc, uint32_t* a) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) a[i] = Element<T>::pack(acc[2 * i], acc[2 * i + 1]);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------------------
// Pipeline barriers (mbarriers in shared memory) and named barriers between warpgroups.

using Barrier = uint64_t;

__device__ __forceinline__ void barrier_init(Barrier* b, int arrivals) {
  cutlass::arch::ClusterBarrier::init(b, arrivals);
}
__device__ __forceinline__ void barrier_wait(Barrier* b, int phase) { cutlass::arch::ClusterBarrier::wait(b, phase); }
__device__ __forceinline__ void barrier_arrive(Barrier* b) { cutlass::arch::ClusterBarrier::arrive(b); }
__device__ __forceinline__ void barrier_expect(Barrier* b, uint32_t bytes) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(b, bytes);
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// L2 cache hint of a load whose data is read once: it leaves L2 before data that other CTAs read again.
constexpr uint64_t kEvictFirst = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);

// Loads rows [row0, row0 + rows) of head `head`, batch `batch` of a [B, S, H, D] tensor into a tile (D/64
// panels), completing `bar`'s transaction. Rows past the end arrive as zeros. `l2_policy`: the L2 cache hint
// (0: none; kEvictFirst).
template <int D>
__device__ __forceinline__ void load_tile(const CUtensorMap* map, Barrier* bar, void* tile, int rows, int row0,
                                          int head, int batch, uint64_t l2_policy = 0) {
#pragma unroll
  for (int panel = 0; panel < D / 64; ++panel) {
    cute::SM90_TMA_LOAD_4D::copy(map, bar, l2_policy, static_cast<char*>(tile) + panel * rows * 128, panel * 64,
                                 head, row0, batch);
  }
}

// Orders this thread's shared-memory writes before later async-proxy reads (wgmma, TMA, bulk copies).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Byte offset of element (row, col) of a 16-bit tile with 64-column panels of 128-byte rows, 128-byte
// swizzle (TMA's layout: the 16-byte chunk index XORed with the row's index within its 8-row group).
__device__ __forceinline__ uint32_t swizzled_offset(int row, int col) {
  return row * 128 + ((((col * 2) >> 4) ^ (row & 7)) << 4) + ((col * 2) & 15);
}

// stmatrix (x4): lanes 8m..8m+7 give the shared addresses of the 16-byte rows 0-7 of 8 x 8 matrix m, and each
// lane holds in `m<i>` its part of matrix i: row lane / 4, columns 2 * (lane % 4) and + 1, the accumulator
// fragment's layout. One instruction per 16 x 16 block where 4-byte stores take four.
__device__ __forceinline__ void store_matrices(uint32_t address, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}

// Writes 16-bit pairs of a warpgroup's 64 x N accumulator (N <= 64; pairs[2c] of row a, pairs[2c + 1] of row b,
// columns 8c..8c+7: to_operand's order) into rows [first, first + 64) of a swizzled 64-column panel at shared
// address `panel`, by stmatrix: the warp's matrices are (row a, 8 columns), (row b, same), (row a, next 8), ...
// (stage_rows below writes the same layout with 4-byte stores: through this, the forward's output staging
// measured 0.4 % slower at 8k, NOTES.md 2026-11-27m.)
template <int N>
__device__ __forceinline__ void store_fragment_pairs(uint32_t panel, int first, int t, const uint32_t* pairs) {
  const int lane = t % 32, matrix = lane / 8;
  const int row = first + 16 * (t / 32) + 8 * (matrix & 1) + lane % 8;
#pragma unroll
  for (int g = 0; g < N / 16; ++g) {
    store_matrices(panel + swizzled_offset(row, 16 * g + 8 * (matrix >> 1)), pairs[4 * g], pairs[4 * g + 1],
                   pairs[4 * g + 2], pairs[4 * g + 3]);
  }
}

// Writes a warpgroup's 64 x D float accumulator (fragment order), times factor_a on each thread's row a and
// factor_b on its row b, as 16-bit values into rows [first, first + 64) of a tile of `rows` rows (D/64
// swizzled panels): the layout store_tile's TMA stores read.
template <class T, int D>
__device__ __forceinline__ void stage_rows(void* tile, int rows, int first, int t, const float* acc, float factor_a,
                                           float factor_b) {
  char* bytes = static_cast<char*>(tile);
#pragma unroll
  for (int i = 0; i < D / 2; i += 2) {
    const int row = first + fragment_row(t) + ((i & 2) ? 8 : 0);
    const int col = fragment_col(t, i);
    const float factor = (i & 2) ? factor_b : factor_a;
    *reinterpret_cast<uint32_t*>(bytes + (col / 64) * rows * 128 + swizzled_offset(row, col % 64)) =
        Element<T>::pack(acc[i] * factor, acc[i + 1] * factor);
  }
}

// Stores rows [row0, row0 + 64) of head `head`, batch `batch` of a [B, S, H, D] tensor from rows
// [first, first + 64) of a tile of `rows` rows (D/64 panels; the map's box is 64 rows), in one bulk group;
// rows past the end are not written. The tile must stay until tma_store_wait.
template <int D>
__device__ __forceinline__ void store_tile(const CUtensorMap* map, const void* tile, int rows, int first, int row0,
                                           int head, int batch) {
#pragma unroll
  for (int panel = 0; panel < D / 64; ++panel) {
    cute::SM90_TMA_STORE_4D::copy(map, static_cast<const char*>(tile) + (panel * rows + first) * 128, panel * 64,
                                  head, row0, batch);
  }
  cute::tma_store_arrive();
}

// ---------------------------------------------------------------------------------------------------------
// Host side: TMA descriptors of [B, S, H, D] tensors with boxes of `rows` rows x 64 columns of one head.

cudaError_t encode_tile_map(CUtensorMap* map, CUtensorMapDataType type, const void* data, int batch, int len,
                            int heads, int dim, int rows);

}  // namespace ejk
