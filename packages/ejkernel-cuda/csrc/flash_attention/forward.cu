// Flash-attention forward for Hopper (sm_90a).
//
// One CTA per (128-query tile, query head, batch): the pipeline of forward_pipeline.cuh (a TMA producer
// warpgroup, two wgmma consumer warpgroups taking turns) over K/V blocks of [B, S, H, D] tensors. The output
// leaves through the warpgroup's rows of the Q tile and TMA stores. Query tiles are visited from the last one
// down (the longest causal rows start first), causal ones across (head, batch) pairs in grid_tile's sections.
#include "flash_attention/forward_pipeline.cuh"
#include "flash_attention/launch.cuh"

namespace ejk {

struct ForwardParams {
  CUtensorMap q_map, k_map, v_map;
  CUtensorMap out_map;  // [B, Sq, Hq, D], boxes of 64 rows (one consumer warpgroup's)
  float* lse;  // [B, Hq, Sq]
  int section;  // grid_tile's order: (query head, batch) pairs per section
  Problem problem;
  Extras extras;
};

// Capped: a soft cap is applied (a template parameter, like whether a key block needs the mask: the main
// loop must be one branch-free block for the compiler to keep the softmax between the waits for the
// products in flight).
template <class T, int D, int BN, bool Capped>
__global__ void __launch_bounds__(kForwardThreads, 1) flash_forward_kernel(const __grid_constant__ ForwardParams params) {
  using Shared = ForwardShared<T, D, BN>;
  Shared& shared = aligned_shared<Shared>();
  const Problem& problem = params.problem;
  const GridTile tile = grid_tile(gridDim.x, problem.q_heads * problem.batch, params.section);
  const int m_block = gridDim.x - 1 - tile.rank;  // the longest causal rows first
  const int head = tile.pair % problem.q_heads, batch = tile.pair / problem.q_heads;
  const int kv_head = head / (problem.q_heads / problem.kv_heads);
  const int row_begin = m_block * kForwardRows;
  const int row_end = min(row_begin + kForwardRows, problem.q_len);
  const KeyBlocks blocks = key_blocks(problem, row_begin, row_end, BN);
  const int warpgroup = warpgroup_index();
  const int t = threadIdx.x % 128;

  if (threadIdx.x == 0) init_forward_barriers(shared);
  __syncthreads();

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0 && blocks.last > blocks.first) {
      produce_key_blocks<T, D, BN>(
          shared, blocks,
          [&](Barrier* bar, T* tile) {
            load_tile<D>(&params.q_map, bar, tile, kForwardRows, row_begin, head, batch);
          },
          [](int key0) { return key0; },
          [&](Barrier* bar, T* tile, int key0, bool value) {
            load_tile<D>(value ? &params.v_map : &params.k_map, bar, tile, BN, key0, kv_head, batch);
          });
    }
    return;
  }

  // consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int group = warpgroup - 1;  // 0 or 1: rows [64 * group, 64 * group + 64) of the tile
  ConsumerRows<D> rows;
  consume_key_blocks<T, D, BN, Capped>(shared, problem, params.extras, row_begin, row_end, blocks, head, batch,
                                       group, t, rows);

  // epilogue: normalize into the Q tile, then TMA stores, which clip rows past the query length; log-sum-exp
  // in natural log
  stage_output<T, D>(shared.q, group, t, rows);
  fence_async_shared();
  named_sync(3 + group, 128);
  if (t == 0) {
    store_tile<D>(&params.out_map, shared.q, kForwardRows, 64 * group, row_begin + 64 * group, head, batch);
    cute::tma_store_wait<0>();
  }
  if (t % 4 == 0) {
    const float ln2 = 0.6931471805599453f;
    const float unit = Capped ? 1.f : problem.softmax_scale * 1.4426950408889634f;
    const int row_a = row_begin + 64 * group + fragment_row(t), row_b = row_a + 8;
    float* lse = params.lse + (static_cast<size_t>(batch) * problem.q_heads + head) * problem.q_len;
    if (row_a < problem.q_len) {
      lse[row_a] = rows.sum_a > 0.f ? (rows.max_a * unit + __log2f(rows.sum_a)) * ln2 : INFINITY;
    }
    if (row_b < problem.q_len) {
      lse[row_b] = rows.sum_b > 0.f ? (rows.max_b * unit + __log2f(rows.sum_b)) * ln2 : INFINITY;
    }
  }
}

template <class T, int D>
cudaError_t launch_forward(cudaStream_t stream, const Problem& problem, const Extras& extras, const void* q,
                           const void* k, const void* v, void* out, float* lse) {
  constexpr int BN = 128;
  ForwardParams params;
  params.lse = lse;
  params.problem = problem;
  // causal tiles are uneven; a query head's K/V is shared by its kv head's group (adjacent in the order)
  params.section = grid_section(problem.causal, 2.0 * problem.kv_len * D * sizeof(T) * problem.kv_heads /
                                                    problem.q_heads,
                                problem.q_heads * problem.batch);
  params.extras = extras;
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
  const size_t shared_bytes = sizeof(ForwardShared<T, D, BN>) + 1024;
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess) return error;
  const dim3 grid((problem.q_len + kForwardRows - 1) / kForwardRows, problem.q_heads, problem.batch);
  kernel<<<grid, kForwardThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error forward_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_segments,
                           ffi::Buffer<ffi::S32> kv_segments, float softmax_scale, bool causal, int64_t window_left,
                           int64_t window_right, float softcap, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  Problem problem;
  Extras extras;
  ffi::Error error = read_problem(q, k, v, softmax_scale, causal, window_left, window_right, softcap, &problem);
  if (error.failure()) return error;
  if ((error = read_extras(problem, sinks, q_segments, kv_segments, &extras)).failure()) return error;
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  return dispatch(q.element_type(), head_dim, [&](auto element, auto dim) {
    return launch_forward<typename decltype(element)::type, decltype(dim)::value>(
        stream, problem, extras, q.untyped_data(), k.untyped_data(), v.untyped_data(), out->untyped_data(),
        lse->typed_data());
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
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());   // lse
