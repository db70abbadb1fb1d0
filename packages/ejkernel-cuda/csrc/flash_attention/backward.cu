// Flash-attention backward for Hopper (sm_90a): two kernels, no atomics.
//
// dQ kernel: one CTA per (128-query tile, query head, batch), like the forward: a TMA producer warpgroup
// streams the visible key/value blocks (64 keys, 2 stages); each of two consumer warpgroups holds 64 rows of
// Q and dO in shared memory and, per block, computes S = Q K^T and dP = dO V^T (wgmma, shared operands),
// dS = P * (dP - delta) in registers (P = exp(S - lse)), then dQ += dS K (wgmma, dS from registers).
//
// dK/dV kernel: one CTA per (128-key tile, kv head, batch); each consumer warpgroup owns 64 keys and keeps
// dK and dV in registers while the producer streams, for every query head of the kv group and every
// 64-query block that sees the tile, Q, dO (TMA) and their rows' lse and delta (copied by a second producer
// warp). Per block, in the transposed form (keys as rows): S^T = K Q^T, dP^T = V dO^T,
// dV += P^T dO, dK += dS^T Q. GQA sums over the group's query heads in registers.
//
// Soft cap: with t = tanh(s / c), dS picks up the factor 1 - t^2. Rows past the query length carry
// lse = +inf and delta = 0, so they contribute nothing; rows that saw no key (lse = +inf) neither.
#include "flash_attention/launch.cuh"

namespace ejk {

constexpr int kBackwardThreads = 384;
constexpr int kBackwardStages = 2;
constexpr int kDqRows = 128;   // query rows per dQ CTA (two warpgroups of 64)
constexpr int kDqKeys = 64;    // keys per streamed block of the dQ kernel
constexpr int kDkvKeys = 128;  // keys per dK/dV CTA (two warpgroups of 64)
constexpr int kDkvRows = 64;   // query rows per streamed block of the dK/dV kernel

template <class Shared>
__device__ __forceinline__ Shared& aligned_backward_shared() {
  extern __shared__ char raw_shared[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw_shared);
  return *reinterpret_cast<Shared*>((base + 1023) & ~uintptr_t(1023));
}

struct BackwardParams {
  CUtensorMap q_map, k_map, v_map, do_map;  // row counts per box as each kernel streams them
  const float* lse;    // [B, Hq, Sq]
  const float* delta;  // [B, Hq, Sq]
  void* dq;            // [B, Sq, Hq, D]
  void* dk;            // [B, Sk, Hk, D]
  void* dv;
  Problem problem;
};

// The scaled (soft-capped) logit in log2 units, and the factor the soft cap puts on its gradient.
struct LogitMap {
  bool capped;
  float raw_scale;  // dot -> argument of tanh (capped) or log2 logit
  float cap_log2;   // c * log2(e)

  __device__ LogitMap(const Problem& p) {
    const float log2e = 1.4426950408889634f;
    capped = p.softcap > 0.f;
    raw_scale = capped ? p.softmax_scale / p.softcap : p.softmax_scale * log2e;
    cap_log2 = p.softcap * log2e;
  }
  // P from the dot product and the row's lse in log2 units; sets `slope` to d(capped logit)/d(logit).
  __device__ __forceinline__ float probability(float dot, float lse_log2, float& slope) const {
    if (capped) {
      const float t = fast_tanh(dot * raw_scale);
      slope = 1.f - t * t;
      return fast_exp2(cap_log2 * t - lse_log2);
    }
    slope = 1.f;
    return fast_exp2(dot * raw_scale - lse_log2);
  }
};

template <class T>
__device__ __forceinline__ void store_rows(T* base, size_t row_stride, int row_a, int row_b, int rows,
                                           int t, const float* acc, int columns, float factor) {
  for (int i = 0; i < columns / 2; i += 2) {
    const int row = (i & 2) ? row_b : row_a;
    if (row < rows) {
      *reinterpret_cast<uint32_t*>(base + row * row_stride + fragment_col(t, i)) =
          Element<T>::pack(acc[i] * factor, acc[i + 1] * factor);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// dQ

template <class T, int D>
struct DqShared {
  T q[kDqRows * D];
  T d_out[kDqRows * D];
  T k[kBackwardStages][kDqKeys * D];
  T v[kBackwardStages][kDqKeys * D];
  Barrier rows_full;
  Barrier k_full[kBackwardStages], k_empty[kBackwardStages];
  Barrier v_full[kBackwardStages], v_empty[kBackwardStages];
};

template <class T, int D>
__global__ void __launch_bounds__(kBackwardThreads, 1) flash_dq_kernel(const __grid_constant__ BackwardParams params) {
  constexpr int BN = kDqKeys;
  using Shared = DqShared<T, D>;
  Shared& shared = aligned_backward_shared<Shared>();
  const Problem& problem = params.problem;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int kv_head = head / (problem.q_heads / problem.kv_heads);
  const int row_begin = m_block * kDqRows;
  const int row_end = min(row_begin + kDqRows, problem.q_len);
  const KeyBlocks blocks = key_blocks(problem, row_begin, row_end, BN);
  const int num_blocks = blocks.last - blocks.first;
  const int warpgroup = threadIdx.x / 128;
  const int t = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    barrier_init(&shared.rows_full, 1);
    for (int s = 0; s < kBackwardStages; ++s) {
      barrier_init(&shared.k_full[s], 1);
      barrier_init(&shared.v_full[s], 1);
      barrier_init(&shared.k_empty[s], 2);
      barrier_init(&shared.v_empty[s], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0 && num_blocks > 0) {
      barrier_expect(&shared.rows_full, 2 * kDqRows * D * sizeof(T));
      load_tile<D>(&params.q_map, &shared.rows_full, shared.q, kDqRows, row_begin, head, batch);
      load_tile<D>(&params.do_map, &shared.rows_full, shared.d_out, kDqRows, row_begin, head, batch);
      for (int it = 0; it < num_blocks; ++it) {
        const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
        const int key0 = (blocks.last - 1 - it) * BN;
        barrier_wait(&shared.k_empty[stage], phase ^ 1);
        barrier_expect(&shared.k_full[stage], BN * D * sizeof(T));
        load_tile<D>(&params.k_map, &shared.k_full[stage], shared.k[stage], BN, key0, kv_head, batch);
        barrier_wait(&shared.v_empty[stage], phase ^ 1);
        barrier_expect(&shared.v_full[stage], BN * D * sizeof(T));
        load_tile<D>(&params.v_map, &shared.v_full[stage], shared.v[stage], BN, key0, kv_head, batch);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<240>();
  const int group = warpgroup - 1;
  const int row_a = row_begin + 64 * group + fragment_row(t);
  const int row_b = row_a + 8;
  const LogitMap logits(problem);
  const float log2e = 1.4426950408889634f;
  const size_t stats = (static_cast<size_t>(batch) * problem.q_heads + head) * problem.q_len;
  // rows past the query length: lse = +inf (P = 0), delta = 0
  const float lse_a = row_a < problem.q_len ? params.lse[stats + row_a] * log2e : INFINITY;
  const float lse_b = row_b < problem.q_len ? params.lse[stats + row_b] * log2e : INFINITY;
  const float delta_a = row_a < problem.q_len ? params.delta[stats + row_a] : 0.f;
  const float delta_b = row_b < problem.q_len ? params.delta[stats + row_b] : 0.f;

  float dq[D / 2];
  float s[BN / 2];
  float dp[BN / 2];
  uint32_t ds[BN / 4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;

  if (num_blocks > 0) {
    barrier_wait(&shared.rows_full, 0);
    const uint32_t q_tile = smem_address(shared.q), do_tile = smem_address(shared.d_out);
    for (int it = 0; it < num_blocks; ++it) {
      const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
      const int key0 = (blocks.last - 1 - it) * BN;
      const uint32_t k_tile = smem_address(shared.k[stage]), v_tile = smem_address(shared.v[stage]);
      barrier_wait(&shared.k_full[stage], phase);
      barrier_wait(&shared.v_full[stage], phase);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BN, Major::K, Major::K>(k_major(q_tile, kDqRows, 64 * group, k), k_major(k_tile, BN, 0, k), s,
                                           k > 0);
      }
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BN, Major::K, Major::K>(k_major(do_tile, kDqRows, 64 * group, k), k_major(v_tile, BN, 0, k),
                                           dp, k > 0);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_operands<BN / 2>(s);
      fence_operands<BN / 2>(dp);
      if (t == 0) barrier_arrive(&shared.v_empty[stage]);

      const bool masked = !block_unmasked(problem, row_begin, row_end, key0, key0 + BN);
      const RowRange range_a = visible_keys(problem, row_a), range_b = visible_keys(problem, row_b);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const bool second = i & 2;
        float slope;
        float prob = logits.probability(s[i], second ? lse_b : lse_a, slope);
        if (masked) {
          const int key = key0 + fragment_col(t, i);
          const RowRange& range = second ? range_b : range_a;
          if (key < range.lo || key > range.hi) prob = 0.f;
        }
        dp[i] = prob * (dp[i] - (second ? delta_b : delta_a)) * slope;
      }
      to_operand<T, BN>(dp, ds);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < BN / 16; ++k) gmma_rs<T, D, Major::MN>(ds + 4 * k, mn_major(k_tile, BN, k), dq, true);
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_operands<D / 2>(dq);
      fence_operands<BN / 4>(ds);
      if (t == 0) barrier_arrive(&shared.k_empty[stage]);
    }
  }
  T* dq_out = static_cast<T*>(params.dq) + (static_cast<size_t>(batch) * problem.q_len * problem.q_heads + head) * D;
  store_rows(dq_out, static_cast<size_t>(problem.q_heads) * D, row_a, row_b, problem.q_len, t, dq, D,
             problem.softmax_scale);
}

// ---------------------------------------------------------------------------------------------------------
// dK / dV

template <class T, int D>
struct DkvShared {
  T k[kDkvKeys * D];
  T v[kDkvKeys * D];
  T q[kBackwardStages][kDkvRows * D];
  T d_out[kBackwardStages][kDkvRows * D];
  float lse[kBackwardStages][kDkvRows];  // log2 units
  float delta[kBackwardStages][kDkvRows];
  Barrier keys_full;
  Barrier rows_full[kBackwardStages], rows_empty[kBackwardStages];
};

// Query rows [first, last) that see any key of [key_begin, key_end).
struct RowBlocks {
  int first, last;
};
__device__ __forceinline__ RowBlocks row_blocks(const Problem& p, int key_begin, int key_end, int block_m) {
  const int offset = p.kv_len - p.q_len;
  int lo = 0, hi = p.q_len - 1;
  if (p.causal) lo = max(lo, key_begin - offset);
  if (p.window_right >= 0) lo = max(lo, key_begin - offset - p.window_right);
  if (p.window_left >= 0) hi = min(hi, key_end - 1 - offset + p.window_left);
  if (hi < lo) return {0, 0};
  return {lo / block_m, hi / block_m + 1};
}

template <class T, int D>
__global__ void __launch_bounds__(kBackwardThreads, 1) flash_dkv_kernel(const __grid_constant__ BackwardParams params) {
  constexpr int BM = kDkvRows;
  using Shared = DkvShared<T, D>;
  Shared& shared = aligned_backward_shared<Shared>();
  const Problem& problem = params.problem;
  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const int group_size = problem.q_heads / problem.kv_heads;
  const int key_begin = n_block * kDkvKeys;
  const int key_end = min(key_begin + kDkvKeys, problem.kv_len);
  const RowBlocks blocks = row_blocks(problem, key_begin, key_end, BM);
  const int blocks_per_head = blocks.last - blocks.first;
  const int num_steps = blocks_per_head * group_size;  // step = (query head of the group, query block)
  const int warpgroup = threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  const float log2e = 1.4426950408889634f;

  if (threadIdx.x == 0) {
    barrier_init(&shared.keys_full, 1);
    for (int s = 0; s < kBackwardStages; ++s) {
      barrier_init(&shared.rows_full[s], 1 + 32);  // the TMA thread and the statistics warp
      barrier_init(&shared.rows_empty[s], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();  // the statistics warp needs more than 24
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (num_steps > 0 && warp == 0 && lane == 0) {
      barrier_expect(&shared.keys_full, 2 * kDkvKeys * D * sizeof(T));
      load_tile<D>(&params.k_map, &shared.keys_full, shared.k, kDkvKeys, key_begin, kv_head, batch);
      load_tile<D>(&params.v_map, &shared.keys_full, shared.v, kDkvKeys, key_begin, kv_head, batch);
      for (int it = 0; it < num_steps; ++it) {
        const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
        const int head = kv_head * group_size + it / blocks_per_head;
        const int row0 = (blocks.first + it % blocks_per_head) * BM;
        barrier_wait(&shared.rows_empty[stage], phase ^ 1);
        barrier_expect(&shared.rows_full[stage], 2 * BM * D * sizeof(T));
        load_tile<D>(&params.q_map, &shared.rows_full[stage], shared.q[stage], BM, row0, head, batch);
        load_tile<D>(&params.do_map, &shared.rows_full[stage], shared.d_out[stage], BM, row0, head, batch);
      }
    } else if (num_steps > 0 && warp == 1) {
      for (int it = 0; it < num_steps; ++it) {
        const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
        const int head = kv_head * group_size + it / blocks_per_head;
        const int row0 = (blocks.first + it % blocks_per_head) * BM;
        const size_t stats = (static_cast<size_t>(batch) * problem.q_heads + head) * problem.q_len;
        barrier_wait(&shared.rows_empty[stage], phase ^ 1);
        for (int r = lane; r < BM; r += 32) {
          const int row = row0 + r;
          const bool inside = row < problem.q_len;
          shared.lse[stage][r] = inside ? params.lse[stats + row] * log2e : INFINITY;
          shared.delta[stage][r] = inside ? params.delta[stats + row] : 0.f;
        }
        barrier_arrive(&shared.rows_full[stage]);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int group = warpgroup - 1;
  const int key_a = key_begin + 64 * group + fragment_row(t);  // this thread's two keys (accumulator rows)
  const int key_b = key_a + 8;
  const LogitMap logits(problem);

  float dk[D / 2], dv[D / 2];
  float s[BM / 2], dp[BM / 2];
  uint32_t p_operand[BM / 4], ds_operand[BM / 4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  if (num_steps > 0) {
    barrier_wait(&shared.keys_full, 0);
    const uint32_t k_tile = smem_address(shared.k), v_tile = smem_address(shared.v);
    for (int it = 0; it < num_steps; ++it) {
      const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
      const int row0 = (blocks.first + it % blocks_per_head) * BM;
      const uint32_t q_tile = smem_address(shared.q[stage]), do_tile = smem_address(shared.d_out[stage]);
      barrier_wait(&shared.rows_full[stage], phase);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BM, Major::K, Major::K>(k_major(k_tile, kDkvKeys, 64 * group, k), k_major(q_tile, BM, 0, k), s,
                                           k > 0);
      }
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BM, Major::K, Major::K>(k_major(v_tile, kDkvKeys, 64 * group, k), k_major(do_tile, BM, 0, k),
                                           dp, k > 0);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_operands<BM / 2>(s);
      fence_operands<BM / 2>(dp);

      const bool masked = !block_unmasked(problem, row0, min(row0 + BM, problem.q_len), key_begin, key_begin + kDkvKeys);
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) {
        const int col = fragment_col(t, i);  // query row row0 + col
        float slope;
        float prob = logits.probability(s[i], shared.lse[stage][col], slope);
        if (masked) {
          const RowRange range = visible_keys(problem, row0 + col);
          const int key = (i & 2) ? key_b : key_a;
          if (key < range.lo || key > range.hi || row0 + col >= problem.q_len) prob = 0.f;
        }
        s[i] = prob;
        dp[i] = prob * (dp[i] - shared.delta[stage][col]) * slope;
      }
      to_operand<T, BM>(s, p_operand);
      to_operand<T, BM>(dp, ds_operand);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < BM / 16; ++k) {
        gmma_rs<T, D, Major::MN>(p_operand + 4 * k, mn_major(do_tile, BM, k), dv, true);
      }
#pragma unroll
      for (int k = 0; k < BM / 16; ++k) {
        gmma_rs<T, D, Major::MN>(ds_operand + 4 * k, mn_major(q_tile, BM, k), dk, true);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_operands<D / 2>(dk);
      fence_operands<D / 2>(dv);
      fence_operands<BM / 4>(p_operand);
      fence_operands<BM / 4>(ds_operand);
      if (t == 0) barrier_arrive(&shared.rows_empty[stage]);
    }
  }
  const size_t row_stride = static_cast<size_t>(problem.kv_heads) * D;
  const size_t offset = (static_cast<size_t>(batch) * problem.kv_len * problem.kv_heads + kv_head) * D;
  store_rows(static_cast<T*>(params.dk) + offset, row_stride, key_a, key_b, problem.kv_len, t, dk, D,
             problem.softmax_scale);
  store_rows(static_cast<T*>(params.dv) + offset, row_stride, key_a, key_b, problem.kv_len, t, dv, D, 1.f);
}

// ---------------------------------------------------------------------------------------------------------
// Launch and FFI binding

template <class T, int D>
cudaError_t launch_backward(cudaStream_t stream, const Problem& problem, const void* q, const void* k, const void* v,
                            const void* d_out, const float* lse, const float* delta, void* dq, void* dk, void* dv) {
  BackwardParams params;
  params.lse = lse;
  params.delta = delta;
  params.dq = dq;
  params.dk = dk;
  params.dv = dv;
  params.problem = problem;
  const CUtensorMapDataType type = Element<T>::tma_type;
  cudaError_t error;
  auto encode = [&](CUtensorMap* map, const void* data, bool queries, int rows) {
    return encode_tile_map(map, type, data, problem.batch, queries ? problem.q_len : problem.kv_len,
                           queries ? problem.q_heads : problem.kv_heads, D, rows);
  };
  // dQ: 128 query rows once, keys streamed 64 at a time
  if ((error = encode(&params.q_map, q, true, kDqRows)) != cudaSuccess ||
      (error = encode(&params.do_map, d_out, true, kDqRows)) != cudaSuccess ||
      (error = encode(&params.k_map, k, false, kDqKeys)) != cudaSuccess ||
      (error = encode(&params.v_map, v, false, kDqKeys)) != cudaSuccess) {
    return error;
  }
  auto dq_kernel = flash_dq_kernel<T, D>;
  const size_t dq_bytes = sizeof(DqShared<T, D>) + 1024;
  if ((error = allow_shared_memory(dq_kernel, dq_bytes)) != cudaSuccess) return error;
  dq_kernel<<<dim3((problem.q_len + kDqRows - 1) / kDqRows, problem.q_heads, problem.batch), kBackwardThreads, dq_bytes,
              stream>>>(params);
  if ((error = cudaGetLastError()) != cudaSuccess) return error;

  // dK/dV: 128 keys once, query rows streamed 64 at a time
  if ((error = encode(&params.q_map, q, true, kDkvRows)) != cudaSuccess ||
      (error = encode(&params.do_map, d_out, true, kDkvRows)) != cudaSuccess ||
      (error = encode(&params.k_map, k, false, kDkvKeys)) != cudaSuccess ||
      (error = encode(&params.v_map, v, false, kDkvKeys)) != cudaSuccess) {
    return error;
  }
  auto dkv_kernel = flash_dkv_kernel<T, D>;
  const size_t dkv_bytes = sizeof(DkvShared<T, D>) + 1024;
  if ((error = allow_shared_memory(dkv_kernel, dkv_bytes)) != cudaSuccess) return error;
  dkv_kernel<<<dim3((problem.kv_len + kDkvKeys - 1) / kDkvKeys, problem.kv_heads, problem.batch), kBackwardThreads,
               dkv_bytes, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error backward_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                            float softmax_scale, bool causal, int64_t window_left, int64_t window_right, float softcap,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv) {
  Problem problem;
  ffi::Error error = read_problem(q, k, v, softmax_scale, causal, window_left, window_right, softcap, &problem);
  if (error.failure()) return error;
  if (d_out.element_type() != q.element_type() || d_out.element_count() != q.element_count() ||
      lse.element_count() != static_cast<size_t>(problem.batch) * problem.q_heads * problem.q_len ||
      delta.element_count() != lse.element_count()) {
    return ffi::Error::InvalidArgument("ejkernel flash attention backward: d_out must match q " + shape_text(q) +
                                       " and lse/delta be float32 [batch, heads, q_len]");
  }
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  return dispatch(q.element_type(), head_dim, [&](auto element, auto dim) {
    return launch_backward<typename decltype(element)::type, decltype(dim)::value>(
        stream, problem, q.untyped_data(), k.untyped_data(), v.untyped_data(), d_out.untyped_data(),
        lse.typed_data(), delta.typed_data(), dq->untyped_data(), dk->untyped_data(), dv->untyped_data());
  });
}

}  // namespace

}  // namespace ejk

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkFlashBackward, ejk::backward_handler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("softcap")
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
