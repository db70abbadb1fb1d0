// The forward pipeline shared by the dense forward (forward.cu) and the paged one (paged_forward.cu): a CTA of
// 128 query rows and three warpgroups. Warpgroup 0 is the producer: one thread streams Q once and the tile's
// key/value blocks through a 2-stage TMA ring (`produce_key_blocks`; where a block comes from is the caller's:
// a [B, S, H, D] tensor map, or pages). Warpgroups 1 and 2 each own 64 query rows and run, per key block,
// S = Q K^T (wgmma, both operands in shared memory), the online softmax in registers and O += P V (wgmma, P
// from registers) (`consume_key_blocks`). Two overlaps are meant to keep the tensor cores busy:
// - inside a warpgroup, S of block n is issued before P V of block n - 1, so that the softmax of block n
//   could run under that P V (ptxas places the wait for P V before the exponentials, as in FA3's kernel, so
//   this one is partial: NOTES.md);
// - between the two warpgroups, named barriers make them take turns issuing their products, so one's
//   softmax runs while the other's matrix products occupy the tensor cores.
// Key blocks are visited from the last one down (the masked diagonal blocks of causal tiles first). The
// output is normalized into a tile the caller names (`stage_output`) and stored by the caller. A persistent
// caller runs its tiles on through the same ring (the Ring producer, the consumers' block_base).
#pragma once

#include "flash_attention/common.cuh"

namespace ejk {

constexpr int kForwardRows = 128;  // query rows per CTA (two consumer warpgroups of 64)
constexpr int kForwardStages = 2;
constexpr int kForwardThreads = 384;
// How far (log2 units) a block's row maximum may exceed the running one before the row is rescaled to it
// (consume_key_blocks' softmax): probabilities then stay below 2^8.
constexpr float kMaxLagLog2 = 8.f;
// Registers per thread of the two roles of a persistent forward (dense and paged) after setmaxnreg. The CTA's
// pool is what the launch gave it (168 per thread: 384 threads, one CTA per SM): the consumers' increase waits
// for registers the producer released, so a budget above the pool hangs the kernel. 24 / 240 (a one-tile CTA's)
// leave the producer's tile loop too few (it spills, or ptxas ignores setmaxnreg and serializes the wgmma);
// 40 / 232 fit both roles without spills.
constexpr int kPersistentProducerRegisters = 40;
constexpr int kPersistentConsumerRegisters = 232;
static_assert(128 * kPersistentProducerRegisters + 256 * kPersistentConsumerRegisters <= 168 * kForwardThreads,
              "the roles' registers must fit the CTA's allocation");

// Stages: K/V blocks in flight (the dense forward's 2; the paged kernel takes 3 where shared memory allows).
// Full barriers: one per stage, and with an odd stage count one per stage and reader parity (kFullPeriod =
// lcm(Stages, 2) of them), for SplitBlocks tiles, whose warpgroups take alternate blocks: there block `it` lands
// in stage it % Stages and signals full barrier it % kFullPeriod, so every full barrier has one reader, who
// awaits its completions in order. With one full barrier per stage and three stages, a stage would serve both
// warpgroups in turn, and a warpgroup awaiting block it + 6 while block it + 3 had not landed would see the
// completion of block it: the same parity, which is all an mbarrier wait can tell.
template <class T, int D, int BN, int Stages = kForwardStages>
struct ForwardShared {
  static constexpr int kStages = Stages;
  static constexpr int kFullPeriod = Stages % 2 ? 2 * Stages : Stages;
  T q[kForwardRows * D];
  T k[Stages][BN * D];
  T v[Stages][BN * D];
  Barrier q_full;
  Barrier k_full[kFullPeriod], k_empty[Stages];
  Barrier v_full[kFullPeriod], v_empty[Stages];
};

// By thread 0, before the __syncthreads that precedes the warpgroups' roles.
template <class Shared>
__device__ __forceinline__ void init_forward_barriers(Shared& shared, int consumers_per_stage = 2) {
  barrier_init(&shared.q_full, 1);
#pragma unroll
  for (int s = 0; s < Shared::kFullPeriod; ++s) {
    barrier_init(&shared.k_full[s], 1);
    barrier_init(&shared.v_full[s], 1);
    if (s < Shared::kStages) {
      barrier_init(&shared.k_empty[s], consumers_per_stage);  // one arrival per consumer warpgroup reading it
      barrier_init(&shared.v_empty[s], consumers_per_stage);
    }
  }
  cutlass::arch::fence_barrier_init();
}

// The producer thread's loop. load_q(bar, tile) loads the CTA's Q tile (q_bytes of it; 0: the consumers fill
// it themselves and load_q does nothing); locate(key0) says where key block key0
// lives (anything the loads take: it is called one block ahead of the loads, so that page-table reads are in
// flight while the producer waits for a free stage); load_kv(bar, tile, where, value) loads its keys (value =
// false) or values into a tile of BN rows. Each load must complete exactly the bytes of its tile (rows out of
// bounds arrive as zeros and count). split_blocks: the consumers split the blocks (SplitBlocks): block `it`
// signals full barrier it % kFullPeriod.
// Ring (a persistent CTA's tiles, which run on through the ring): block_base counts the blocks of its earlier
// tiles (the consumers pass the same); q_free (with the parity of the completion to await) says the previous
// tile's Q is released, and the Q load follows the first key block's, so that block is in flight while the
// producer waits. The wait comes before q_full's arrival: a tile of one block lets the producer reach the next
// tile's Q before this one's has landed, and a second arrival in the phase would complete it early. (A template
// flag: the one-tile callers' code stays what it was.)
template <class T, int D, int BN, bool Ring = false, class Shared, class LoadQ, class Locate, class LoadKV>
__device__ __forceinline__ void produce_key_blocks(Shared& shared, const KeyBlocks& blocks, LoadQ&& load_q,
                                                   Locate&& locate, LoadKV&& load_kv,
                                                   uint32_t q_bytes = kForwardRows * D * sizeof(T),
                                                   bool split_blocks = false, int block_base = 0,
                                                   Barrier* q_free = nullptr, int q_free_phase = 0) {
  constexpr int stages = Shared::kStages;
  const int num_blocks = blocks.last - blocks.first;
  if constexpr (!Ring) {
    barrier_expect(&shared.q_full, q_bytes);
    load_q(&shared.q_full, shared.q);
  }
  auto where = locate((blocks.last - 1) * BN);
  for (int it = 0; it < num_blocks; ++it) {
    const int n = Ring ? block_base + it : it;  // the block's place in the ring
    const int stage = n % stages, phase = (n / stages) & 1;
    const int full = split_blocks ? n % Shared::kFullPeriod : stage;
    const auto here = where;
    if (it + 1 < num_blocks) where = locate((blocks.last - 2 - it) * BN);
    barrier_wait(&shared.k_empty[stage], phase ^ 1);
    barrier_expect(&shared.k_full[full], BN * D * sizeof(T));
    load_kv(&shared.k_full[full], shared.k[stage], here, false);
    if constexpr (Ring) {
      if (it == 0) {
        barrier_wait(q_free, q_free_phase);
        barrier_expect(&shared.q_full, q_bytes);
        load_q(&shared.q_full, shared.q);
      }
    }
    barrier_wait(&shared.v_empty[stage], phase ^ 1);
    barrier_expect(&shared.v_full[full], BN * D * sizeof(T));
    load_kv(&shared.v_full[full], shared.v[stage], here, true);
  }
}

// What a consumer thread holds after the key blocks: its part of the output rows (unnormalized) and the
// softmax state of its two rows (row a, row b = a + 8; the sums per thread, the quad's not yet added).
template <int D>
struct ConsumerRows {
  float o[D / 2];
  float max_a, max_b, sum_a, sum_b;
};

// Zeroes rows [from, BN) of a value tile of BN rows in D / 64 panels (the TMA layout, 128-byte swizzle: a row's
// 128 bytes of a panel stay that row's). Called by all 128 threads of a warpgroup before it issues P V on the tile.
template <class T, int D, int BN>
__device__ __forceinline__ void clear_value_rows(T* tile, int from, int group, int t) {
  char* bytes = reinterpret_cast<char*>(tile);
  const int chunks_per_panel = (BN - from) * 8;  // 16-byte chunks
  for (int i = t; i < chunks_per_panel * (D / 64); i += 128) {
    const int panel = i / chunks_per_panel, row = from + (i % chunks_per_panel) / 8, chunk = i % 8;
    *reinterpret_cast<uint4*>(bytes + panel * BN * 128 + row * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_async_shared();  // the generic-proxy stores before the tensor cores' (async-proxy) reads
  named_sync(3 + group, 128);
}

// The scores' exponent unit: the consumers keep raw dot products, exponentiated as exp2(s * softmax_scale *
// log2 e - max * unit), or, soft-capped, capped logits already in log2 units (unit 1). Whoever merges rows kept
// by consume_key_blocks (merge_split_rows, a split-K combine) exponentiates in the same unit.
__device__ __forceinline__ float exponent_unit(bool capped, float softmax_scale) {
  return capped ? 1.f : softmax_scale * 1.4426950408889634f;
}

// One consumer warpgroup's loop over the key blocks of rows [row_begin, row_end) of `problem` (the CTA's
// rows; this warpgroup's are [row_begin + 64 * group, + 64)). `head` and `batch` index the extras (sinks,
// segment ids). Capped: a soft cap is applied (a template parameter, like whether a key block needs the mask:
// the main loop must be one branch-free block for the compiler to keep the softmax between the waits for the
// products in flight). ClearValueTail (the paged kernel's): the value rows of keys past problem.kv_len in the
// first block visited (the only one that can hold any) are zeroed before P V reads them; their probabilities
// are 0, but where a load brings in whole rows of storage past the context (pages), a NaN there would still
// give 0 * NaN = NaN.
// SplitBlocks: the two warpgroups hold the same rows and split the key blocks instead (warpgroup g takes blocks
// g, g + 2, ...: each block has one consumer and each full barrier one reader), taking no turns; the caller
// merges their rows (merge_split_rows). rows_per_query: the 64 tile rows hold that many rows per query (query
// row_begin + tile row / rows_per_query, head `head` + tile row % rows_per_query: the query heads of one kv head
// packed into one tile).
// block_base and q_phase (persistent CTAs; not with SplitBlocks): the blocks the ring carried for earlier tiles
// and the parity of this tile's Q load.
// Returns with every product complete and every stage released.
template <class T, int D, int BN, bool Capped, class Shared, bool ClearValueTail = false, bool SplitBlocks = false>
__device__ __forceinline__ void consume_key_blocks(Shared& shared, const Problem& problem, const Extras& extras,
                                                   int row_begin, int row_end, const KeyBlocks& blocks, int head,
                                                   int batch, int group, int t, ConsumerRows<D>& rows,
                                                   int rows_per_query = 1, int block_base = 0, int q_phase = 0) {
  const int num_blocks = blocks.last - blocks.first;
  constexpr int stages = Shared::kStages;
  const int other = 1 - group;
  const int tile_row = SplitBlocks ? fragment_row(t) : 64 * group + fragment_row(t);
  const int row_a = row_begin + tile_row / rows_per_query;
  const int row_b = row_begin + (tile_row + 8) / rows_per_query;
  const float log2e = 1.4426950408889634f;
  // Scores stay raw dot products (or, soft-capped, capped logits in log2 units) and the running maxima are
  // kept in the same units: the exponent is then one FMA, exp2(s * unit - max * unit).
  const float tanh_scale = problem.softmax_scale / problem.softcap;
  const float cap_log2 = problem.softcap * log2e;
  const float unit = exponent_unit(Capped, problem.softmax_scale);

  float* o = rows.o;
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;  // rescaled (by 0) before the first P V overwrites it
  float s[BN / 2];
  uint32_t p[BN / 4];
  float max_a = -INFINITY, max_b = -INFINITY, sum_a = 0.f, sum_b = 0.f;
  bool rescale_needed = false;  // warp-uniform: a row of this warp has a new maximum (softmax -> the next P V)
  if (extras.num_sinks > 0) {
    // the sinks start every row's softmax state: their maximum (in score units) and their sum against it,
    // counted once per row (the quad's partial sums are added at the end). With rows_per_query > 1 the tile's
    // rows are query heads head, head + 1, ... in turn (row r: head + r % rows_per_query).
    auto start = [&](int row_head) {  // (maximum, sum) of one row's sinks
      const float* sinks =
          extras.sinks + (static_cast<size_t>(batch) * problem.q_heads + row_head) * extras.num_sinks;
      float top = -INFINITY, total = 0.f;
      for (int j = 0; j < extras.num_sinks; ++j) top = fmaxf(top, sinks[j]);
      for (int j = 0; j < extras.num_sinks; ++j) total += fast_exp2((sinks[j] - top) * log2e);
      return make_float2(top * log2e / unit, t % 4 == 0 ? total : 0.f);
    };
    const float2 state_a = start(head + tile_row % rows_per_query);
    const float2 state_b = rows_per_query == 1 ? state_a : start(head + (tile_row + 8) % rows_per_query);
    max_a = state_a.x, sum_a = state_a.y;
    max_b = state_b.x, sum_b = state_b.y;
  }
  // segment ids of this thread's two rows (rows past the length: none of the keys')
  const int* kv_segments = extras.kv_segments ? extras.kv_segments + static_cast<size_t>(batch) * problem.kv_len
                                              : nullptr;
  int segment_a = -1, segment_b = -1;
  if (kv_segments) {
    const int* q_segments = extras.q_segments + static_cast<size_t>(batch) * problem.q_len;
    if (row_a < problem.q_len) segment_a = q_segments[row_a];
    if (row_b < problem.q_len) segment_b = q_segments[row_b];
  }

  const uint32_t q_tile = smem_address(shared.q);
  auto k_tile = [&](int stage) { return smem_address(shared.k[stage]); };
  auto v_tile = [&](int stage) { return smem_address(shared.v[stage]); };

  // The scores of the block's first `keys` keys (all_keys, or half_keys: the first BN / 2 into s[0, BN / 4), the
  // same fragment columns)
  const std::integral_constant<int, BN> all_keys;
  const std::integral_constant<int, BN / 2> half_keys;
  auto issue_scores = [&](int stage, auto keys) {
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      gmma_ss<T, decltype(keys)::value, Major::K, Major::K>(k_major(q_tile, kForwardRows, 64 * group, k),
                                                            k_major(k_tile(stage), BN, 0, k), s, k > 0);
    }
    cute::warpgroup_commit_batch();
  };
  auto issue_values = [&](const uint32_t* p, int stage, bool accumulate) {
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < BN / 16; ++k) {
      gmma_rs<T, D, Major::MN>(p + 4 * k, mn_major(v_tile(stage), BN, k), o, accumulate || k > 0);
    }
    cute::warpgroup_commit_batch();
  };
  // Scores of key block `key0` -> probabilities (in s) against the updated running maxima; returns the
  // factors the previous output rows are rescaled by.
  auto softmax = [&](int key0, auto masked, float& rescale_a, float& rescale_b) {
    if constexpr (Capped) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = cap_log2 * fast_tanh(s[i] * tanh_scale);
    }
    if constexpr (decltype(masked)::value) {
      const RowRange range_a = visible_keys(problem, row_a), range_b = visible_keys(problem, row_b);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {  // branch-free, the segment test apart (a uniform branch)
        const int key = key0 + fragment_col(t, i);
        const RowRange& range = (i & 2) ? range_b : range_a;
        s[i] = (key < range.lo) | (key > range.hi) ? -INFINITY : s[i];
      }
      if (kv_segments) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
          const int key = min(key0 + fragment_col(t, i), problem.kv_len - 1);  // masked above when past the end
          s[i] = kv_segments[key] != ((i & 2) ? segment_b : segment_a) ? -INFINITY : s[i];
        }
      }
    }
    float block_a = -INFINITY, block_b = -INFINITY;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      if (i & 2) block_b = fmaxf(block_b, s[i]);
      else block_a = fmaxf(block_a, s[i]);
    }
    // A row's running maximum moves only when the block's exceeds it by more than kMaxLagLog2 (FlashAttention-4's
    // rule): any maximum gives the same softmax, probabilities stay below 2^kMaxLagLog2 (float32 sums, 16-bit P
    // keep their relative precision), and in long rows most blocks then leave the output rows as they are: a
    // warp skips their rescale (D / 2 multiplies per thread) when none of its rows moved. (-inf - -inf is NaN:
    // a row that has seen no key yet keeps -inf.)
    const float top_a = quad_max(block_a), top_b = quad_max(block_b);
    const float new_a = (top_a - max_a) * unit > kMaxLagLog2 ? top_a : max_a;
    const float new_b = (top_b - max_b) * unit > kMaxLagLog2 ? top_b : max_b;
    rescale_needed = __any_sync(0xffffffffu, (new_a != max_a) | (new_b != max_b));
    // rows that have seen no key yet keep a max of -inf: subtract 0 instead (their probabilities are 0)
    const float base_a = new_a == -INFINITY ? 0.f : new_a * unit, base_b = new_b == -INFINITY ? 0.f : new_b * unit;
    rescale_a = fast_exp2(max_a * unit - base_a);  // 1 where the maximum stayed (0 where it is still -inf)
    rescale_b = fast_exp2(max_b * unit - base_b);
    max_a = new_a;
    max_b = new_b;
    float row_sum_a = 0.f, row_sum_b = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      s[i] = fast_exp2(fmaf(s[i], unit, -((i & 2) ? base_b : base_a)));
      if (i & 2) row_sum_b += s[i];
      else row_sum_a += s[i];
    }
    // pin the exponentials here: left alone, the compiler sinks them below the wait for P V and the
    // softmax no longer overlaps the tensor cores
    fence_operands<BN / 2>(s);
    sum_a = sum_a * rescale_a + row_sum_a;  // per-thread partial sums; the quad is summed at the end
    sum_b = sum_b * rescale_b + row_sum_b;
  };
  auto take_turn = [&]() {
    if constexpr (!SplitBlocks) named_sync(1 + group, 256);
  };
  auto pass_turn = [&]() {
    if constexpr (!SplitBlocks) named_arrive(1 + other, 256);
  };

  // SplitBlocks: this warpgroup's blocks (group, group + 2, ...; block `it` in stage it % stages, signalled on
  // full barrier it % kFullPeriod, which only this warpgroup awaits: ForwardShared), one after the other, each
  // product awaited before the next is issued. Deferring P V to the next step, as the loop
  // below does, would hold the stage's value tile until this warpgroup's NEXT keys arrived, so that the value
  // load of a block would wait for its own key load: two latencies per block instead of one. The other
  // warpgroup's blocks overlap this one's instead.
  auto split_loop = [&]() {
    constexpr int period = Shared::kFullPeriod;
    for (int it = group; it < num_blocks; it += 2) {
      const int stage = it % stages, full = it % period, phase = (it / period) & 1;
      const int key0 = (blocks.last - 1 - it) * BN;
      if (it == group) barrier_wait(&shared.q_full, q_phase);
      barrier_wait(&shared.k_full[full], phase);
      issue_scores(stage, all_keys);
      cute::warpgroup_wait<0>();
      fence_operands<BN / 2>(s);
      if (t == 0) barrier_arrive(&shared.k_empty[stage]);
      float rescale_a, rescale_b;
      if (kv_segments || !block_unmasked(problem, row_begin, row_end, key0, key0 + BN)) {
        softmax(key0, std::true_type{}, rescale_a, rescale_b);
      } else {
        softmax(key0, std::false_type{}, rescale_a, rescale_b);
      }
      to_operand<T, BN>(s, p);
      barrier_wait(&shared.v_full[full], phase);
      if constexpr (ClearValueTail) {
        // block 0 (warpgroup 0's first) holds key kv_len - 1, the only block with value rows past the context
        const int from = problem.kv_len - key0;
        if (it == 0 && from < BN) clear_value_rows<T, D, BN>(shared.v[0], from, group, t);
      }
      if (rescale_needed) {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= (i & 2) ? rescale_b : rescale_a;
      }
      issue_values(p, stage, it > group);
      cute::warpgroup_wait<0>();
      fence_operands<D / 2>(o);
      fence_operands<BN / 4>(p);
      if (t == 0) barrier_arrive(&shared.v_empty[stage]);
    }
  };

  if constexpr (SplitBlocks) {
    split_loop();
  } else if (num_blocks > 0) {
    if (group == 1) pass_turn();  // warpgroup 1 issues first
    barrier_wait(&shared.q_full, q_phase);

    const int first_stage = block_base % stages, first_phase = (block_base / stages) & 1;
    const int first_key = (blocks.last - 1) * BN;
    auto needs_mask = [&](int key0) {
      return kv_segments || !block_unmasked(problem, row_begin, row_end, key0, key0 + BN);
    };
    // Factors the output rows still owe the latest maxima: applied just before the next P V is issued,
    // while the scores of the next block are computed, not after the wait for the last P V.
    float rescale_a, rescale_b;
    // The first block, to its probabilities in p. `half`: warpgroup 0's last row sees none of the block's last 64
    // keys (the causal diagonal, or a window's right edge), so its scores are a 64-key product and the other
    // half's are -inf. A compile-time flag over the whole block: a branch around the product alone made ptxas
    // serialize every wgmma of the kernel (C7511 / C7515).
    auto first_block = [&](auto half) {
      take_turn();
      if constexpr (decltype(half)::value) issue_scores(first_stage, half_keys);
      else issue_scores(first_stage, all_keys);
      pass_turn();
      cute::warpgroup_wait<0>();
      fence_operands<BN / 2>(s);
      if constexpr (decltype(half)::value) {
#pragma unroll
        for (int i = BN / 4; i < BN / 2; ++i) s[i] = -INFINITY;
      }
      if (t == 0) barrier_arrive(&shared.k_empty[first_stage]);
      if (needs_mask(first_key)) softmax(first_key, std::true_type{}, rescale_a, rescale_b);
      else softmax(first_key, std::false_type{}, rescale_a, rescale_b);
      to_operand<T, BN>(s, p);
    };
    barrier_wait(&shared.k_full[first_stage], first_phase);
    bool half = false;
    if constexpr (!ClearValueTail) {  // the dense forward
      half = group == 0 && visible_keys(problem, min(row_begin + 63, row_end - 1)).hi < first_key + BN / 2;
    }
    if (half) first_block(std::true_type{});
    else first_block(std::false_type{});
    if constexpr (ClearValueTail) {
      const int from = problem.kv_len - first_key;  // >= 1: the first block holds key kv_len - 1
      if (from < BN) {
        barrier_wait(&shared.v_full[first_stage], first_phase);
        clear_value_rows<T, D, BN>(shared.v[first_stage], from, group, t);
      }
    }
    auto rescale_output = [&]() {  // skipped where no row of the warp moved (the rows without keys hold zeros)
      if (rescale_needed) {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= (i & 2) ? rescale_b : rescale_a;
      }
    };

    // One step: S of block `it`, P V of block it - 1, softmax of block it (masked: a compile-time flag, so
    // that the step is one branch-free block). ptxas still places the wait for P V right after the first row
    // maximum, before the exponentials, so the softmax overlaps the other warpgroup's products only
    // (FlashAttention-3's own kernel has the same order in its SASS; a branch that pins the exponentials
    // above the wait makes ptxas serialize every wgmma: NOTES.md).
    auto step = [&](int it, auto masked) {
      const int n = block_base + it;
      const int stage = n % stages, phase = (n / stages) & 1;
      const int previous = (n - 1) % stages, previous_phase = ((n - 1) / stages) & 1;
      barrier_wait(&shared.k_full[stage], phase);
      barrier_wait(&shared.v_full[previous], previous_phase);
      take_turn();
      issue_scores(stage, all_keys);
      rescale_output();
      issue_values(p, previous, it > 1);
      pass_turn();
      cute::warpgroup_wait<1>();  // the scores are in
      fence_operands<BN / 2>(s);
      if (t == 0) barrier_arrive(&shared.k_empty[stage]);
      softmax((blocks.last - 1 - it) * BN, masked, rescale_a, rescale_b);
      cute::warpgroup_wait<0>();  // P V of the previous block is in
      fence_operands<D / 2>(o);
      fence_operands<BN / 4>(p);
      if (t == 0) barrier_arrive(&shared.v_empty[previous]);
      to_operand<T, BN>(s, p);
    };
    for (int it = 1; it < num_blocks; ++it) {
      if (needs_mask((blocks.last - 1 - it) * BN)) step(it, std::true_type{});
      else step(it, std::false_type{});
    }

    const int last = block_base + num_blocks - 1;
    const int stage = last % stages, phase = (last / stages) & 1;
    barrier_wait(&shared.v_full[stage], phase);
    take_turn();
    rescale_output();
    issue_values(p, stage, num_blocks > 1);
    if (group == 0) pass_turn();  // warpgroup 1 gave the first turn: it takes no last one back
    cute::warpgroup_wait<0>();
    fence_operands<D / 2>(o);
    if (t == 0) barrier_arrive(&shared.v_empty[stage]);
  }
  rows.max_a = max_a;
  rows.max_b = max_b;
  rows.sum_a = sum_a;
  rows.sum_b = sum_b;
}

// After a SplitBlocks loop: warpgroup 1 hands its rows (the same rows as warpgroup 0's, over the other key
// blocks) to warpgroup 0, which merges them into its own: both softmax states rescaled to the larger maximum.
// Through the tiles of the stage of warpgroup 1's last block (stage 1 if it had none), idle once its loop
// returned: no later block uses that stage, and warpgroup 0's blocks in it came before and were released:
// the outputs in the key tile (D / 2 x 128 floats = BN x D 16-bit values when BN = 128), the maxima and sums in
// the value tile. Both warpgroups call it, with the loop's number of key blocks; afterwards warpgroup 0's `rows`
// are the tile's. `unit`: the scores' exponent scale (the loop's: softmax_scale * log2 e, uncapped).
template <class T, int D, int BN, class Shared>
__device__ __forceinline__ void merge_split_rows(Shared& shared, int num_blocks, int group, int t, float unit,
                                                 ConsumerRows<D>& rows) {
  static_assert(D / 2 * 128 * sizeof(float) <= BN * D * sizeof(T), "a key tile holds the outputs");
  const int last_odd = num_blocks % 2 ? num_blocks - 2 : num_blocks - 1;
  const int stage = last_odd >= 1 ? last_odd % Shared::kStages : 1;
  float* outputs = reinterpret_cast<float*>(shared.k[stage]);
  float* states = reinterpret_cast<float*>(shared.v[stage]);
  if (group == 1) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) outputs[i * 128 + t] = rows.o[i];
    states[t] = rows.max_a;
    states[128 + t] = rows.max_b;
    states[256 + t] = rows.sum_a;
    states[384 + t] = rows.sum_b;
  }
  named_sync(5, 256);
  if (group == 0) {
    const float max_a = states[t], max_b = states[128 + t];
    const float top_a = fmaxf(rows.max_a, max_a), top_b = fmaxf(rows.max_b, max_b);
    // rows that saw no key on either side keep -inf: factors of 0 (their sums and outputs are 0)
    const float base_a = top_a == -INFINITY ? 0.f : top_a * unit, base_b = top_b == -INFINITY ? 0.f : top_b * unit;
    const float mine_a = fast_exp2(rows.max_a * unit - base_a), theirs_a = fast_exp2(max_a * unit - base_a);
    const float mine_b = fast_exp2(rows.max_b * unit - base_b), theirs_b = fast_exp2(max_b * unit - base_b);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) {
      rows.o[i] = (i & 2) ? rows.o[i] * mine_b + outputs[i * 128 + t] * theirs_b
                          : rows.o[i] * mine_a + outputs[i * 128 + t] * theirs_a;
    }
    rows.sum_a = rows.sum_a * mine_a + states[256 + t] * theirs_a;
    rows.sum_b = rows.sum_b * mine_b + states[384 + t] * theirs_b;
    rows.max_a = top_a;
    rows.max_b = top_b;
  }
}

// Epilogue, first half: sums the quads' partial sums (in `rows`) and writes this warpgroup's normalized output
// rows (16-bit) into its rows of the Q tile (its own products that read them are complete; the other
// warpgroup reads only its rows), in the tile's swizzled layout. Rows that saw no key get zeros.
template <class T, int D>
__device__ __forceinline__ void stage_output(T* q, int group, int t, ConsumerRows<D>& rows) {
  rows.sum_a = quad_sum(rows.sum_a);
  rows.sum_b = quad_sum(rows.sum_b);
  const float inverse_a = rows.sum_a > 0.f ? 1.f / rows.sum_a : 0.f;
  const float inverse_b = rows.sum_b > 0.f ? 1.f / rows.sum_b : 0.f;
  stage_rows<T, D>(q, kForwardRows, 64 * group, t, rows.o, inverse_a, inverse_b);
}

}  // namespace ejk
