// Flash-attention backward for Hopper (sm_90a), FlashAttention-3's way: one kernel computes dK, dV and
// dQ with five matrix products per block pair, dQ summed over key tiles in float32 global memory.
//
// One CTA per (128-key tile, kv head, batch). Each of two consumer warpgroups owns 64 keys and keeps their
// dK and dV in registers while a producer warpgroup streams, for every query head of the kv group and
// every 64-query block that sees the tile, Q and dO (TMA, 2 stages) and their rows' lse and delta (one
// producer warp). Per block, keys as rows:
//   S^T = K Q^T and dP^T = V dO^T (wgmma, shared operands); P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta)
//   in registers; dV += P^T dO and dK += dS^T Q (wgmma, P^T / dS^T from registers);
//   dS^T goes to shared memory, and dQ_block = dS K (wgmma: dS read transposed, each warpgroup 64 of the
//   head dim's columns) goes through shared memory into a float32 accumulator (64-query chunks) by one bulk
//   reduce-add (cp.reduce.async.bulk) per block, issued by a third producer warp (the dQ warp). A last kernel
//   scales it and writes dQ in q's layout/dtype.
// GQA sums dK/dV over the group's query heads in registers; at the end they leave through the K and V tiles
// by TMA stores.
//
// Soft cap: with t = tanh(s / c), dS picks up the factor 1 - t^2. Rows past the query length carry
// lse = +inf and delta = 0 (their Q and dO rows arrive as TMA's zeros), so they contribute zeros (added to
// the accumulator's padding rows, which the convert kernel skips); rows that saw no key (lse = +inf) add
// zeros too.
#include "flash_attention/launch.cuh"

namespace ejk {

constexpr int kBackwardThreads = 384;
constexpr int kBackwardStages = 2;
constexpr int kDkvKeys = 128;  // keys per dK/dV CTA (two warpgroups of 64)
constexpr int kDkvRows = 64;   // query rows per streamed block of the dK/dV kernel

struct BackwardParams {
  CUtensorMap q_map, k_map, v_map, do_map;
  CUtensorMap dk_map, dv_map;  // boxes of 64 rows (store_tile)
  const float* lse;    // [B, Hq, Sq]
  const float* delta;  // [B, Hq, Sq]
  float* dq_accum;     // [B, Hq, q_chunks, 64 * D] in fragment order (dq_chunk_offset), zeroed; unscaled
  int section;  // grid_tile's order: (kv head, batch) pairs per section
  Problem problem;
  Extras extras;  // the backward reads the segment ids (sinks act through lse alone)
};

// The scaled (soft-capped) logit in log2 units, and the factor the soft cap puts on its gradient (Capped:
// a compile-time flag, like the forward's, so the elementwise work is branch-free).
template <bool Capped>
struct LogitMap {
  float raw_scale;  // dot -> argument of tanh (capped) or log2 logit
  float cap_log2;   // c * log2(e)

  __device__ LogitMap(const Problem& p) {
    const float log2e = 1.4426950408889634f;
    raw_scale = Capped ? p.softmax_scale / p.softcap : p.softmax_scale * log2e;
    cap_log2 = p.softcap * log2e;
  }
  // P from the dot product and the row's lse in log2 units; sets `slope` to d(capped logit)/d(logit).
  __device__ __forceinline__ float probability(float dot, float lse_log2, float& slope) const {
    if constexpr (Capped) {
      const float t = fast_tanh(dot * raw_scale);
      slope = 1.f - t * t;
      return fast_exp2(cap_log2 * t - lse_log2);
    }
    slope = 1.f;
    return fast_exp2(fmaf(dot, raw_scale, -lse_log2));
  }
};

// ---------------------------------------------------------------------------------------------------------
// dK / dV

template <class T, int D>
struct DkvShared {
  T k[kDkvKeys * D];
  T v[kDkvKeys * D];
  T q[kBackwardStages][kDkvRows * D];
  T d_out[kBackwardStages][kDkvRows * D];
  T ds[2][kDkvKeys * kDkvRows];   // dS^T of a block (alternating): keys as rows, 64 query columns (one panel)
  float dq[kDkvRows * D];         // this block's dQ in fragment order (dq_chunk_offset), for the bulk reduce-add
  float lse[kBackwardStages][kDkvRows];  // log2 units
  float delta[kBackwardStages][kDkvRows];
  int q_segment[kBackwardStages][kDkvRows];  // segment ids of the block's query rows (segmented calls)
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

// A CTA's steps in order: the group's query heads (outer), their 64-query blocks (inner). Counted, not derived
// from the step index: dividing by the runtime block count cost ~20 instructions per step.
struct StepWalk {
  int head, block;
  const int first_block, last_block;
  __device__ StepWalk(int first_head, RowBlocks blocks)
      : head(first_head), block(blocks.first), first_block(blocks.first), last_block(blocks.last) {}
  __device__ __forceinline__ int row0() const { return block * kDkvRows; }
  __device__ __forceinline__ void next() {
    if (++block == last_block) {
      block = first_block;
      ++head;
    }
  }
};

// global[i] += shared[i] for `bytes` bytes (float32), asynchronously; completes with the thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* global, const float* shared, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(global),
               "r"(smem_address(shared)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// The dQ accumulator [B, Hq, q_chunks, 64 * D] holds each 64-query block as one chunk in fragment order:
// the float4 of accumulator elements 4c..4c+3 of thread t of the warpgroup computing 64-column panel
// `panel` at float offset ((panel * 8 + c) * 128 + t) * 4. A warp's 16-byte stores are then contiguous
// (no bank conflicts) and the chunk goes out in one bulk reduce-add; dq_convert_kernel maps it back.
__device__ __forceinline__ int dq_chunk_offset(int panel, int c, int t) { return ((panel * 8 + c) * 128 + t) * 4; }
__host__ __device__ __forceinline__ int q_chunks(const Problem& p) { return (p.q_len + kDkvRows - 1) / kDkvRows; }

inline size_t dq_accum_elements(const Problem& p, int64_t head_dim) {
  return static_cast<size_t>(p.batch) * p.q_heads * q_chunks(p) * kDkvRows * head_dim;
}

constexpr int kConvertThreads = 256;  // dq_convert_kernel
// Named barriers of the two consumer warpgroups; the first two with the dQ warp (kDqBarrierThreads)
constexpr int kSyncDsWritten = 1;  // both dS^T halves are in shared memory, and the dQ tile is free again
constexpr int kSyncDqWritten = 2;  // both warpgroups' dQ columns are in the dQ tile
constexpr int kDqBarrierThreads = 256 + 32;
constexpr int kSyncKeysRead = 3;      // epilogue: no product reads the K and V tiles any more
constexpr int kSyncStaged = 4;        // + group: the warpgroup's dK / dV rows are in shared memory

// The epilogue of flash_backward_kernel: dK and dV through the K and V tiles (free once both warpgroups' last
// products, dQ's reading every K row included, are complete) to TMA stores, which clip keys past the length.
// A warp's 4-byte stores straight from the accumulators (half-sector writes, rows 8 apart) had kept the SM from
// its next CTA ~2.5 us longer. The tile's coordinates are derived here again, not carried across the main
// loop: carried, they moved ptxas's register allocation there (fewer spills, but S = 8k 1.6 % slower).
template <class T, int D>
__device__ __forceinline__ void store_key_gradients(const BackwardParams& params, const float* dk, const float* dv) {
  const Problem& problem = params.problem;
  DkvShared<T, D>& shared = aligned_shared<DkvShared<T, D>>();
  const int t = in_loop(threadIdx.x) % 128, group = warpgroup_index() - 1;
  const GridTile tile = grid_tile(gridDim.x, problem.kv_heads * problem.batch, params.section);
  const int kv_head = tile.pair % problem.kv_heads, batch = tile.pair / problem.kv_heads;
  const int row0 = tile.rank * kDkvKeys + 64 * group;
  stage_rows<T, D>(shared.k, kDkvKeys, 64 * group, t, dk, problem.softmax_scale, problem.softmax_scale);
  stage_rows<T, D>(shared.v, kDkvKeys, 64 * group, t, dv, 1.f, 1.f);
  fence_async_shared();
  named_sync(kSyncStaged + group, 128);
  if (t == 0) {
    store_tile<D>(&params.dk_map, shared.k, kDkvKeys, 64 * group, row0, kv_head, batch);
    store_tile<D>(&params.dv_map, shared.v, kDkvKeys, 64 * group, row0, kv_head, batch);
    // the tiles (and the reducing thread's last dQ tile) stay until the copies have read them; their writes
    // to global memory complete with the grid
    cute::tma_store_wait<0>();
  }
}

template <class T, int D, bool Capped>
__global__ void __launch_bounds__(kBackwardThreads, 1) flash_backward_kernel(const __grid_constant__ BackwardParams params) {
  constexpr int BM = kDkvRows;
  using Shared = DkvShared<T, D>;
  Shared& shared = aligned_shared<Shared>();
  const Problem& problem = params.problem;
  const GridTile tile = grid_tile(gridDim.x, problem.kv_heads * problem.batch, params.section);
  const int n_block = tile.rank;  // the first keys (the most causal rows) first
  const int kv_head = tile.pair % problem.kv_heads, batch = tile.pair / problem.kv_heads;
  const int group_size = problem.q_heads / problem.kv_heads;
  const int key_begin = n_block * kDkvKeys;
  const int key_end = min(key_begin + kDkvKeys, problem.kv_len);
  const RowBlocks blocks = row_blocks(problem, key_begin, key_end, BM);
  const int blocks_per_head = blocks.last - blocks.first;
  const int num_steps = blocks_per_head * group_size;  // step = (query head of the group, query block)
  const int warpgroup = warpgroup_index();
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
    cutlass::arch::warpgroup_reg_dealloc<24>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (num_steps > 0 && warp == 0 && lane == 0) {
      barrier_expect(&shared.keys_full, 2 * kDkvKeys * D * sizeof(T));
      load_tile<D>(&params.k_map, &shared.keys_full, shared.k, kDkvKeys, key_begin, kv_head, batch);
      load_tile<D>(&params.v_map, &shared.keys_full, shared.v, kDkvKeys, key_begin, kv_head, batch);
      StepWalk walk(kv_head * group_size, blocks);
      for (int it = 0; it < num_steps; ++it, walk.next()) {
        const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
        barrier_wait(&shared.rows_empty[stage], phase ^ 1);
        barrier_expect(&shared.rows_full[stage], 2 * BM * D * sizeof(T));
        load_tile<D>(&params.q_map, &shared.rows_full[stage], shared.q[stage], BM, walk.row0(), walk.head, batch);
        load_tile<D>(&params.do_map, &shared.rows_full[stage], shared.d_out[stage], BM, walk.row0(), walk.head,
                     batch);
      }
    } else if (num_steps > 0 && warp == 1) {
      StepWalk walk(kv_head * group_size, blocks);
      for (int it = 0; it < num_steps; ++it, walk.next()) {
        const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
        const int row0 = walk.row0();
        const size_t stats = (static_cast<size_t>(batch) * problem.q_heads + walk.head) * problem.q_len;
        barrier_wait(&shared.rows_empty[stage], phase ^ 1);
        for (int r = lane; r < BM; r += 32) {
          const int row = row0 + r;
          const bool inside = row < problem.q_len;
          shared.lse[stage][r] = inside ? params.lse[stats + row] * log2e : INFINITY;
          shared.delta[stage][r] = inside ? params.delta[stats + row] : 0.f;
          if (params.extras.q_segments) {
            shared.q_segment[stage][r] =
                inside ? params.extras.q_segments[static_cast<size_t>(batch) * problem.q_len + row] : -1;
          }
        }
        barrier_arrive(&shared.rows_full[stage]);
      }
    } else if (num_steps > 0 && warp == 2) {
      // The dQ warp, FlashAttention-3's hand-over: once both warpgroups' dQ columns are in the dQ tile it adds the
      // tile into the accumulator (one bulk reduce-add: rows past the length hold zeros, their P is 0, and land
      // in padding) and, once the copy has read the tile, frees it for the next block's columns. The consumers
      // then never wait on the copy (a consumer thread issuing it held up its warpgroup's next products).
      named_arrive(kSyncDsWritten, kDqBarrierThreads);  // the tile starts free
      StepWalk walk(kv_head * group_size, blocks);
      for (int it = 0; it < num_steps; ++it, walk.next()) {
        named_sync(kSyncDqWritten, kDqBarrierThreads);
        if (lane == 0) {
          float* chunk = params.dq_accum +
                         ((static_cast<size_t>(batch) * problem.q_heads + walk.head) * q_chunks(problem) + walk.block) *
                             (BM * D);
          bulk_reduce_add(chunk, shared.dq, BM * D * sizeof(float));
          bulk_wait_read();  // (the last one also keeps the CTA's shared memory until the copy has read it)
        }
        __syncwarp();
        if (it + 1 < num_steps) named_arrive(kSyncDsWritten, kDqBarrierThreads);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<240>();
  const int group = warpgroup - 1;
  const int key_a = key_begin + 64 * group + fragment_row(t);  // this thread's two keys (accumulator rows)
  const int key_b = key_a + 8;
  const bool segmented = params.extras.kv_segments != nullptr;
  int segment_a = -2, segment_b = -2;  // keys past the length: masked by their range anyway
  if (segmented) {
    const int* kv_segments = params.extras.kv_segments + static_cast<size_t>(batch) * problem.kv_len;
    if (key_a < problem.kv_len) segment_a = kv_segments[key_a];
    if (key_b < problem.kv_len) segment_b = kv_segments[key_b];
  }
  const LogitMap<Capped> logits(problem);
  // dQ columns per warpgroup that computes them: half of D = 128 each, all of D = 64 in warpgroup 0 (a
  // 32-column half would start inside a swizzle atom of the K tile)
  constexpr int kDqCols = 64;
  const bool computes_dq = D == 128 || group == 0;

  float dk[D / 2], dv[D / 2];
  float s[BM / 2], dp[BM / 2];
  uint32_t p_operand[BM / 4], ds_operand[BM / 4];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  if (num_steps > 0) {
    barrier_wait(&shared.keys_full, 0);
    const uint32_t k_tile_0 = smem_address(shared.k), v_tile_0 = smem_address(shared.v);
    // The walk to the next block and whether it needs the mask, decided while this block's dK runs (next_block,
    // called before the wait for dK): done after that wait, as the loop's head, they were ~60 instructions between
    // dK's end and the next S^T's issue, with the tensor cores idle.
    StepWalk walk(kv_head * group_size, blocks);
    auto unmasked_at = [&](int row0) {
      return !segmented &&
             block_unmasked(problem, row0, min(row0 + BM, problem.q_len), key_begin, key_begin + kDkvKeys);
    };
    int next_unmasked = unmasked_at(walk.row0());
    auto next_block = [&]() {
      walk.next();
      next_unmasked = unmasked_at(walk.row0());
      asm volatile("" : "+r"(walk.head), "+r"(walk.block), "+r"(next_unmasked));  // here, not after the wait
    };
    // One block pair; `masked`: a compile-time flag, so the elementwise work is branch-free
    auto step = [&](int it, int row0, auto masked) {
      // the step's index as a value the compiler knows warp-uniform (a shuffle from lane 0): the stage's tile
      // addresses and the descriptors derived from them then stay in uniform registers (from a per-thread
      // index, each Q / dO / dS^T descriptor was moved there by two R2URs before its wgmma: 134 per step)
      it = __shfl_sync(0xffffffff, it, 0);
      const int stage = it % kBackwardStages, phase = (it / kBackwardStages) & 1;
      const uint32_t q_tile = smem_address(shared.q[stage]), do_tile = smem_address(shared.d_out[stage]);
      const uint32_t k_tile = in_loop(k_tile_0), v_tile = in_loop(v_tile_0);
      barrier_wait(&shared.rows_full[stage], phase);
      // This thread's 16 query columns come in 8 adjacent pairs: their lse loaded before the products are
      // issued (the loads then complete under S^T), delta once P^T is formed (registers are short before)
      float2 lse_pairs[BM / 8], delta_pairs[BM / 8];
      auto load_pairs = [&](float2* pairs, const float* rows) {
#pragma unroll
        for (int c = 0; c < BM / 8; ++c) pairs[c] = *reinterpret_cast<const float2*>(&rows[fragment_col(t, 4 * c)]);
      };
      load_pairs(lse_pairs, shared.lse[stage]);
      // Five products, FlashAttention-3's order: S^T and dP^T issued together; P^T once S^T is in (dP^T
      // running), dS^T once dP^T is in; then dV, dS^T through shared memory, dQ, dK once dV is in, and dQ read
      // out while dK runs. Issuing dV right after P^T (under dP^T) and dK before dQ, as before, left the tensor
      // cores a shorter queue at the step's end: 3.3-3.7 % slower (H100, NOTES.md).
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BM, Major::K, Major::K>(k_major(k_tile, kDkvKeys, 64 * group, k), k_major(q_tile, BM, 0, k), s,
                                           k > 0);
      }
      cute::warpgroup_commit_batch();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        gmma_ss<T, BM, Major::K, Major::K>(k_major(v_tile, kDkvKeys, 64 * group, k), k_major(do_tile, BM, 0, k),
                                           dp, k > 0);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();  // S^T is in
      fence_operands<BM / 2>(s);

#pragma unroll
      for (int i = 0; i < BM / 2; i += 2) {
        float prob[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = fragment_col(t, i + j);  // query row row0 + col
          float slope;
          const float2 lse = lse_pairs[i / 4];
          prob[j] = logits.probability(s[i + j], j ? lse.y : lse.x, slope);
          if constexpr (decltype(masked)::value) {
            // one range of key - position (Problem) for every row
            const int key = (i & 2) ? key_b : key_a;
            const int distance = key - (row0 + col + problem.kv_len - problem.q_len);
            const bool hidden = (distance < problem.lo_distance) | (distance > problem.hi_distance) |
                                (key >= problem.kv_len) | (row0 + col >= problem.q_len) |
                                (segmented && shared.q_segment[stage][col] != ((i & 2) ? segment_b : segment_a));
            prob[j] = hidden ? 0.f : prob[j];
          }
          s[i + j] = prob[j] * slope;  // what dS^T needs of P^T (P^T itself goes to dV packed)
        }
        p_operand[i / 2] = Element<T>::pack(prob[0], prob[1]);
      }
      load_pairs(delta_pairs, shared.delta[stage]);
      cute::warpgroup_wait<0>();  // dP^T is in
      fence_operands<BM / 2>(dp);
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) {
        const float2 delta = delta_pairs[i / 4];
        dp[i] = s[i] * (dp[i] - ((i & 1) ? delta.y : delta.x));
      }
      to_operand<T, BM>(dp, ds_operand);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < BM / 16; ++k) {
        gmma_rs<T, D, Major::MN>(p_operand + 4 * k, mn_major(do_tile, BM, k), dv, true);
      }
      cute::warpgroup_commit_batch();

      // dS^T into shared memory (keys 64 * group + row, query columns), for dQ = dS K; two tiles, so that a
      // warpgroup ahead by one block does not overwrite the tile the other one still reads
      const uint32_t ds_tile = smem_address(shared.ds[it % 2]);
      store_fragment_pairs<BM>(ds_tile, 64 * group, t, ds_operand);
      fence_async_shared();
      named_sync(kSyncDsWritten, kDqBarrierThreads);  // (the dQ warp's arrival: the last block's dQ has left)

      float dq[kDqCols / 2];
      if (computes_dq) {
        cute::warpgroup_arrive();
        const uint32_t k_columns = k_tile + (D == 128 ? group : 0) * kDkvKeys * 128;  // panel of this group's columns
#pragma unroll
        for (int k = 0; k < kDkvKeys / 16; ++k) {
          gmma_ss<T, kDqCols, Major::MN, Major::MN>(mn_major(ds_tile, kDkvKeys, k), mn_major(k_columns, kDkvKeys, k),
                                                    dq, k > 0);
        }
      }
      cute::warpgroup_commit_batch();  // (empty where this warpgroup computes no dQ: the counts below hold)
      cute::warpgroup_wait<1>();  // dV is in
      fence_operands<D / 2>(dv);
      fence_operands<BM / 4>(p_operand);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < BM / 16; ++k) {
        gmma_rs<T, D, Major::MN>(ds_operand + 4 * k, mn_major(q_tile, BM, k), dk, true);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();  // dQ is in (dK runs under its read-out)
      if (computes_dq) {
        fence_operands<kDqCols / 2>(dq);
        const int panel = D == 128 ? group : 0;
#pragma unroll
        for (int c = 0; c < kDqCols / 8; ++c) {
          *reinterpret_cast<float4*>(&shared.dq[dq_chunk_offset(panel, c, t)]) =
              make_float4(dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
        }
      }
      next_block();
      cute::warpgroup_wait<0>();
      fence_operands<D / 2>(dk);
      fence_operands<BM / 4>(ds_operand);
      if (t == 0) barrier_arrive(&shared.rows_empty[stage]);
      fence_async_shared();
      // Only the dQ warp waits for both warpgroups' dQ columns; the consumers go on to the next block. Its dS^T
      // goes to the other tile; the one after that reuses this block's tile, read by products that completed
      // before kSyncDsWritten of the next block. The dQ tile is rewritten only after that barrier too, which
      // the dQ warp joins once this block's reduce-add has read the tile.
      named_arrive(kSyncDqWritten, kDqBarrierThreads);
    };
    for (int it = 0; it < num_steps; ++it) {
      const int row0 = walk.row0();
      if (next_unmasked) {
        step(it, row0, std::false_type{});
      } else {
        step(it, row0, std::true_type{});
      }
    }
  }
  named_sync(kSyncKeysRead, 256);  // no product reads the K and V tiles any more
  store_key_gradients<T, D>(params, dk, dv);
}

// dq [B, Sq, Hq, D] (q's dtype) = scale * the fragment-ordered accumulator (dq_chunk_offset). One CTA per 64-row
// chunk, no index arithmetic beyond shifts: its float4s are read in order (coalesced), packed into a row-major
// tile in shared memory (rows padded by 16 bytes: the fragment order's 8 rows of a store then fall in different
// banks) and written out 16 bytes per thread along each row (a row's D values are contiguous in dq). The former
// grid-stride version (a 64-bit division per float4, 4-byte stores at rows 8 apart) ran at half this speed.
template <class T, int D>
__global__ void __launch_bounds__(kConvertThreads) dq_convert_kernel(const float* __restrict__ accum,
                                                                      T* __restrict__ dq, Problem problem) {
  constexpr int kChunk = kDkvRows * D;  // floats
  constexpr int kPitch = D / 2 + 4;     // 32-bit words (two values) per tile row, 16 bytes of padding
  constexpr int kVectors = D / 8;       // 16-byte vectors (8 values) per row
  __shared__ __align__(16) uint32_t tile[kDkvRows * kPitch];
  const int chunk = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const float4* source = reinterpret_cast<const float4*>(
      accum + ((static_cast<size_t>(batch) * problem.q_heads + head) * q_chunks(problem) + chunk) * kChunk);
  const float scale = problem.softmax_scale;
#pragma unroll
  for (int w = threadIdx.x; w < kChunk / 4; w += kConvertThreads) {  // w = (panel * 8 + c) * 128 + t
    const float4 x = source[w];
    const int t = w % 128, c = (w / 128) % 8, panel = w / 1024;
    const int row = fragment_row(t), word = (64 * panel + fragment_col(t, 4 * c)) / 2;
    tile[row * kPitch + word] = Element<T>::pack(x.x * scale, x.y * scale);
    tile[(row + 8) * kPitch + word] = Element<T>::pack(x.z * scale, x.w * scale);
  }
  __syncthreads();
  const int row0 = chunk * kDkvRows;
  T* out = dq + (static_cast<size_t>(batch) * problem.q_len + row0) * problem.q_heads * D + head * D;
#pragma unroll
  for (int v = threadIdx.x; v < kDkvRows * kVectors; v += kConvertThreads) {
    const int r = v / kVectors, part = v % kVectors;
    if (row0 + r < problem.q_len) {
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(r) * problem.q_heads * D + part * 8) =
          *reinterpret_cast<const uint4*>(&tile[r * kPitch + part * 4]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launch and FFI binding

template <class T, int D>
cudaError_t launch_backward(cudaStream_t stream, const Problem& problem, const Extras& extras, const void* q,
                            const void* k, const void* v,
                            const void* d_out, const float* lse, const float* delta, float* dq_accum, void* dq,
                            void* dk, void* dv) {
  BackwardParams params;
  params.lse = lse;
  params.delta = delta;
  params.dq_accum = dq_accum;
  params.problem = problem;
  params.extras = extras;
  // causal tiles are uneven; a key tile streams its group's Q and dO and adds into their float32 dQ
  params.section = grid_section(problem.causal, (2.0 * sizeof(T) + sizeof(float)) * problem.q_len * D *
                                                    problem.q_heads / problem.kv_heads,
                                problem.kv_heads * problem.batch);
  const CUtensorMapDataType type = Element<T>::tma_type;
  cudaError_t error;
  auto encode = [&](CUtensorMap* map, const void* data, bool queries, int rows) {
    return encode_tile_map(map, type, data, problem.batch, queries ? problem.q_len : problem.kv_len,
                           queries ? problem.q_heads : problem.kv_heads, D, rows);
  };
  if ((error = encode(&params.q_map, q, true, kDkvRows)) != cudaSuccess ||
      (error = encode(&params.do_map, d_out, true, kDkvRows)) != cudaSuccess ||
      (error = encode(&params.k_map, k, false, kDkvKeys)) != cudaSuccess ||
      (error = encode(&params.v_map, v, false, kDkvKeys)) != cudaSuccess ||
      (error = encode(&params.dk_map, dk, false, 64)) != cudaSuccess ||
      (error = encode(&params.dv_map, dv, false, 64)) != cudaSuccess) {
    return error;
  }
  const size_t accum_bytes = dq_accum_elements(problem, D) * sizeof(float);
  if ((error = cudaMemsetAsync(dq_accum, 0, accum_bytes, stream)) != cudaSuccess) return error;
  auto kernel = problem.softcap > 0.f ? flash_backward_kernel<T, D, true> : flash_backward_kernel<T, D, false>;
  const size_t shared_bytes = sizeof(DkvShared<T, D>) + 1024;
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess) return error;
  kernel<<<dim3((problem.kv_len + kDkvKeys - 1) / kDkvKeys, problem.kv_heads, problem.batch), kBackwardThreads,
           shared_bytes, stream>>>(params);
  if ((error = cudaGetLastError()) != cudaSuccess) return error;
  const dim3 chunks(q_chunks(problem), problem.q_heads, problem.batch);
  dq_convert_kernel<T, D><<<chunks, kConvertThreads, 0, stream>>>(dq_accum, static_cast<T*>(dq), problem);
  return cudaGetLastError();
}

namespace {

ffi::Error backward_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                            ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_segments,
                            ffi::Buffer<ffi::S32> kv_segments, float softmax_scale, bool causal, int64_t window_left, int64_t window_right, float softcap,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum) {
  Problem problem;
  Extras extras;
  ffi::Error error = read_problem(q, k, v, softmax_scale, causal, window_left, window_right, softcap, &problem);
  if (error.failure()) return error;
  if ((error = read_extras(problem, sinks, q_segments, kv_segments, &extras)).failure()) return error;
  if (d_out.element_type() != q.element_type() || d_out.element_count() != q.element_count() ||
      lse.element_count() != static_cast<size_t>(problem.batch) * problem.q_heads * problem.q_len ||
      delta.element_count() != lse.element_count() ||
      dq_accum->element_count() != dq_accum_elements(problem, q.dimensions()[3])) {
    return ffi::Error::InvalidArgument("ejkernel flash attention backward: d_out must match q " + shape_text(q) +
                                       ", lse/delta be float32 [batch, heads, q_len] and the dq accumulator "
                                       "float32 [batch, heads, q_len rounded up to 64, dim]");
  }
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  return dispatch(q.element_type(), head_dim, [&](auto element, auto dim) {
    return launch_backward<typename decltype(element)::type, decltype(dim)::value>(
        stream, problem, extras, q.untyped_data(), k.untyped_data(), v.untyped_data(), d_out.untyped_data(),
        lse.typed_data(), delta.typed_data(), dq_accum->typed_data(), dq->untyped_data(), dk->untyped_data(),
        dv->untyped_data());
  });
}

}  // namespace

}  // namespace ejk

// Results: dq, dk, dv, and the float32 dQ accumulator [B, Hq, Sq rounded up to 64, D] (a workspace: callers
// drop it).
XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkFlashBackward, ejk::backward_handler,
                              ejk::problem_attributes(ejk::extra_buffers(xla::ffi::Ffi::Bind()
                                                                             .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                                             .Arg<xla::ffi::AnyBuffer>()  // q
                                                                             .Arg<xla::ffi::AnyBuffer>()  // k
                                                                             .Arg<xla::ffi::AnyBuffer>()  // v
                                                                             .Arg<xla::ffi::AnyBuffer>()  // d_out
                                                                             .Arg<xla::ffi::Buffer<xla::ffi::F32>>()     // lse
                                                                             .Arg<xla::ffi::Buffer<xla::ffi::F32>>()))  // delta
                                  .Ret<xla::ffi::AnyBuffer>()                  // dq
                                  .Ret<xla::ffi::AnyBuffer>()                  // dk
                                  .Ret<xla::ffi::AnyBuffer>()                  // dv
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());   // dq accumulator
