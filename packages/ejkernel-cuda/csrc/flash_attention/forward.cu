// Flash-attention forward for Hopper (sm_90a).
//
// Persistent: one CTA per SM takes (128-query tile, query head, batch) tiles from a counter, in tile_at's order
// (query tiles from the last one down, so the longest causal rows start first; causal tiles across the (head,
// batch) pairs of a section). Each tile runs the pipeline of forward_pipeline.cuh (a TMA producer warpgroup,
// two wgmma consumer warpgroups taking turns) over K/V blocks of [B, S, H, D] tensors, and the K/V ring runs
// on from one tile into the next: while the consumers finish a tile and store its output (through a tile of
// its own, by TMA), the producer has the next tile's first keys and Q in flight. With one CTA per tile, each
// tile's start-up and epilogue were exposed (per tile 4.7 us against FA3's 2.2: NOTES.md).
#include "flash_attention/forward_pipeline.cuh"
#include "flash_attention/launch.cuh"

namespace ejk {

struct ForwardParams {
  CUtensorMap q_map, k_map, v_map;
  CUtensorMap out_map;  // [B, Sq, Hq, D], boxes of 64 rows (one consumer warpgroup's)
  float* lse;  // [B, Hq, Sq]
  int* next_tile;  // the tickets past the first wave (zeroed before the launch)
  int num_tiles, section;  // tiles in all; tile_at's order: (query head, batch) pairs per section
  Problem problem;
  Extras extras;
};

// The output tile first (1024-byte aligned for TMA, as the pipeline's tiles after it), the pipeline, and the
// hand-over of tile indices from the producer to the consumers: two slots, each with a full barrier (the
// producer's arrival) and an empty one (one arrival per consumer warp once it has read the slot). q_empty: both
// consumer warpgroups are done with the Q tile (their products complete), so the next tile's Q may land.
template <class T, int D, int BN>
struct PersistentForwardShared {
  T out[kForwardRows * D];
  ForwardShared<T, D, BN> pipeline;
  Barrier tile_full[2], tile_empty[2], q_empty;
  int tile_index[2];
};

constexpr int kConsumerWarps = 8;

struct ForwardTile {
  int head, batch, row_begin, row_end;
  KeyBlocks blocks;
};

__device__ __forceinline__ ForwardTile forward_tile(const ForwardParams& params, int index) {
  const Problem& problem = params.problem;
  const int tiles_per_pair = (problem.q_len + kForwardRows - 1) / kForwardRows;
  const GridTile tile = tile_at(index, tiles_per_pair, problem.q_heads * problem.batch, params.section);
  const int row_begin = (tiles_per_pair - 1 - tile.rank) * kForwardRows;  // the longest causal rows first
  const int row_end = min(row_begin + kForwardRows, problem.q_len);
  return {tile.pair % problem.q_heads, tile.pair / problem.q_heads, row_begin, row_end,
          key_blocks(problem, row_begin, row_end, 128)};
}

// Capped: a soft cap is applied (a template parameter, like whether a key block needs the mask: the main
// loop must be one branch-free block for the compiler to keep the softmax between the waits for the
// products in flight).
template <class T, int D, int BN, bool Capped>
__global__ void __launch_bounds__(kForwardThreads, 1) flash_forward_kernel(const __grid_constant__ ForwardParams params) {
  static_assert(BN == 128, "forward_tile's key blocks");
  using Shared = PersistentForwardShared<T, D, BN>;
  Shared& shared = aligned_shared<Shared>();
  const Problem& problem = params.problem;
  const int warpgroup = warpgroup_index();
  const int t = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    init_forward_barriers(shared.pipeline);
    for (int slot = 0; slot < 2; ++slot) {
      barrier_init(&shared.tile_full[slot], 1);
      barrier_init(&shared.tile_empty[slot], kConsumerWarps);
    }
    barrier_init(&shared.q_empty, 2);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<kPersistentProducerRegisters>();
    if (threadIdx.x != 0) return;
    int index = blockIdx.x, block_base = 0, q_loads = 0;
    for (int n = 0;; ++n) {
      barrier_wait(&shared.tile_empty[n & 1], ((n >> 1) & 1) ^ 1);
      shared.tile_index[n & 1] = index;
      barrier_arrive(&shared.tile_full[n & 1]);
      if (index >= params.num_tiles) return;
      const ForwardTile tile = forward_tile(params, index);
      const int num_blocks = tile.blocks.last - tile.blocks.first;
      if (num_blocks > 0) {
        const int kv_head = tile.head / (problem.q_heads / problem.kv_heads);
        produce_key_blocks<T, D, BN, true>(
            shared.pipeline, tile.blocks,
            [&](Barrier* bar, T* q_tile) {
              load_tile<D>(&params.q_map, bar, q_tile, kForwardRows, tile.row_begin, tile.head, tile.batch);
            },
            [](int key0) { return key0; },
            [&](Barrier* bar, T* kv_tile, int key0, bool value) {
              load_tile<D>(value ? &params.v_map : &params.k_map, bar, kv_tile, BN, key0, kv_head, tile.batch);
            },
            kForwardRows * D * sizeof(T), false, block_base, &shared.q_empty, (q_loads - 1) & 1);
        block_base += num_blocks;
        ++q_loads;
      }
      // The next ticket once this tile's loads are issued (the consumers have its last blocks to go, which hide
      // the atomic's latency), not when the tile starts: drawn a tile ahead, a CTA that had just begun a long
      // causal tile took the next long one too, and the tiles' ends spread (benchmarks/experiments/
      // tile_schedule_model.py: +1.3 % of a causal forward at S = 2k, +4 % at 8k and 16k; measured -1 to -3 %).
      index = gridDim.x + atomicAdd(params.next_tile, 1);
    }
  }

  // consumers
  cutlass::arch::warpgroup_reg_alloc<kPersistentConsumerRegisters>();
  const int group = warpgroup - 1;  // 0 or 1: rows [64 * group, 64 * group + 64) of the tile
  int block_base = 0, q_loads = 0;
  for (int n = 0;; ++n) {
    barrier_wait(&shared.tile_full[n & 1], (n >> 1) & 1);
    const int index = shared.tile_index[n & 1];
    __syncwarp();
    if (threadIdx.x % 32 == 0) barrier_arrive(&shared.tile_empty[n & 1]);
    if (index >= params.num_tiles) break;
    const ForwardTile tile = forward_tile(params, index);
    const int num_blocks = tile.blocks.last - tile.blocks.first;
    ConsumerRows<D> rows;
    consume_key_blocks<T, D, BN, Capped>(shared.pipeline, problem, params.extras, tile.row_begin, tile.row_end,
                                         tile.blocks, tile.head, tile.batch, group, t, rows, 1, block_base,
                                         q_loads & 1);
    if (num_blocks > 0) {
      if (t == 0) barrier_arrive(&shared.q_empty);  // this warpgroup's products are complete
      block_base += num_blocks;
      ++q_loads;
    }

    // epilogue: normalize into the output tile (once the previous tile's store has read it), then TMA stores,
    // which clip rows past the query length; log-sum-exp in natural log
    if (t == 0) cute::tma_store_wait<0>();
    named_sync(3 + group, 128);
    stage_output<T, D>(shared.out, group, t, rows);
    fence_async_shared();
    named_sync(3 + group, 128);
    if (t == 0) {
      store_tile<D>(&params.out_map, shared.out, kForwardRows, 64 * group, tile.row_begin + 64 * group, tile.head,
                    tile.batch);
    }
    if (t % 4 == 0) {
      const float ln2 = 0.6931471805599453f;
      const float unit = Capped ? 1.f : problem.softmax_scale * 1.4426950408889634f;
      const int row_a = tile.row_begin + 64 * group + fragment_row(t), row_b = row_a + 8;
      float* lse = params.lse + (static_cast<size_t>(tile.batch) * problem.q_heads + tile.head) * problem.q_len;
      if (row_a < problem.q_len) {
        lse[row_a] = rows.sum_a > 0.f ? (rows.max_a * unit + __log2f(rows.sum_a)) * ln2 : INFINITY;
      }
      if (row_b < problem.q_len) {
        lse[row_b] = rows.sum_b > 0.f ? (rows.max_b * unit + __log2f(rows.sum_b)) * ln2 : INFINITY;
      }
    }
  }
  if (t == 0) cute::tma_store_wait<0>();  // the shared memory stays until the last store has read it
}

template <class T, int D>
cudaError_t launch_forward(cudaStream_t stream, const Problem& problem, const Extras& extras, const void* q,
                           const void* k, const void* v, void* out, float* lse, int* next_tile) {
  constexpr int BN = 128;
  ForwardParams params;
  params.lse = lse;
  params.next_tile = next_tile;
  params.problem = problem;
  params.extras = extras;
  const int pairs = problem.q_heads * problem.batch;
  params.num_tiles = (problem.q_len + kForwardRows - 1) / kForwardRows * pairs;
  // causal tiles are uneven; a query head's K/V is shared by its kv head's group (adjacent in the order)
  params.section = grid_section(problem.causal, 2.0 * problem.kv_len * D * sizeof(T) * problem.kv_heads /
                                                    problem.q_heads,
                                pairs);
  const CUtensorMapDataType type = Element<T>::tma_type;
  cudaError_t error;
  if ((error = encode_tile_map(&params.q_map, type, q, problem.batch, problem.q_len, problem.q_heads, D,
                               kForwardRows)) != cudaSuccess ||
      (error = encode_tile_map(&params.k_map, type, k, problem.batch, problem.kv_len, problem.kv_heads, D, BN)) !=
          cudaSuccess ||
      (error = encode_tile_map(&params.v_map, type, v, problem.batch, problem.kv_len, problem.kv_heads, D, BN)) !=
          cudaSuccess ||
      (error = encode_tile_map(&params.out_map, type, out, problem.batch, problem.q_len, problem.q_heads, D, 64)) !=
          cudaSuccess) {
    return error;
  }
  auto kernel = problem.softcap > 0.f ? flash_forward_kernel<T, D, BN, true> : flash_forward_kernel<T, D, BN, false>;
  const size_t shared_bytes = sizeof(PersistentForwardShared<T, D, BN>) + 1024;
  int device = 0, sms = 0;
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess ||
      (error = cudaGetDevice(&device)) != cudaSuccess ||
      (error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (error = cudaMemsetAsync(next_tile, 0, sizeof(int), stream)) != cudaSuccess) {
    return error;
  }
  kernel<<<std::min(params.num_tiles, sms), kForwardThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error forward_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_segments,
                           ffi::Buffer<ffi::S32> kv_segments, float softmax_scale, bool causal, int64_t window_left,
                           int64_t window_right, float softcap, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::S32>> next_tile) {
  Problem problem;
  Extras extras;
  ffi::Error error = read_problem(q, k, v, softmax_scale, causal, window_left, window_right, softcap, &problem);
  if (error.failure()) return error;
  if ((error = read_extras(problem, sinks, q_segments, kv_segments, &extras)).failure()) return error;
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  return dispatch(q.element_type(), head_dim, [&](auto element, auto dim) {
    return launch_forward<typename decltype(element)::type, decltype(dim)::value>(
        stream, problem, extras, q.untyped_data(), k.untyped_data(), v.untyped_data(), out->untyped_data(),
        lse->typed_data(), next_tile->typed_data());
  });
}

}  // namespace

}  // namespace ejk

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkFlashForward, ejk::forward_handler,
                              ejk::problem_attributes(ejk::extra_buffers(xla::ffi::Ffi::Bind()
                                                                             .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                                             .Arg<xla::ffi::AnyBuffer>()  // q
                                                                             .Arg<xla::ffi::AnyBuffer>()  // k
                                                                             .Arg<xla::ffi::AnyBuffer>()))  // v
                                  .Ret<xla::ffi::AnyBuffer>()                  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()     // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());   // the tile counter (scratch)
