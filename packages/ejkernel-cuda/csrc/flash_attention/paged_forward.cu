// Paged flash-attention forward for Hopper (sm_90a): ragged_page_attention's mixed batch of prefill chunks and
// decode rows, in one launch.
//
// queries [T, Hq, D] packed by query_start_loc; kv_pages [P, page_size, 2 Hkv, D], the key of kv head h at
// axis-2 index 2h, its value at 2h + 1; sequence s (< num_seqs) owns rows [query_start_loc[s],
// query_start_loc[s + 1]), whose query i sits at position context_lens[s] - q_len + i and sees the keys
// <= that position (causal within the sequence, always: the operation's definition).
//
// The pipeline of forward_pipeline.cuh (TMA producer warpgroup, two wgmma consumer warpgroups) on two kinds
// of work item:
// - a query tile: 128 rows of one query head of one sequence (tiles never cross sequences; a sequence's last
//   tile is partial), both consumer warpgroups ping-ponging, as in the dense forward. Compute-bound.
// - a packed tile, for sequences of at most 64 / G rows (G = Hq / Hkv: decode rows, short speculative
//   chunks): all G query heads of one kv head in 64 rows (row r = query r / G, head r % G), so the kv head's
//   pages are read once for its G heads. Both consumer warpgroups hold these rows and take alternate key
//   blocks (warpgroup g the blocks of stage g, each stage with one reader), without turns; warpgroup 1 hands
//   its softmax state to warpgroup 0 at the end (merge_split_rows). Bandwidth-bound: each block costs one
//   64-row warpgroup's products, and the two warpgroups work on two blocks at once.
// Scheduling: persistent CTAs (one per SM) take items from a counter in global memory (zeroed before the
// launch). Each CTA first builds, in shared memory, the prefix counts of both kinds of item over the
// sequences (all threads, one pass over query_start_loc), then mixes the two kinds in the order it hands out
// (rounds of 8 tickets, packed_share of them packed: a config field; the rest after), so that at any time some
// SMs stream pages for decode rows while others run the matrix products of prefill tiles: the two halves of
// a mixed batch bind on different units and overlap instead of adding up. A packed tile is shorter than a
// query tile, so an even count leaves fewer SMs streaming than the bandwidth needs: the share sets that. A sequence's query tiles come
// heaviest first (causal), its heads next to each other (they read the same pages, mostly from L2). The rows
// past query_start_loc[num_seqs] form one more "sequence" with no keys, whose tiles write zeros.
// Keys: a key block of 128 keys is loaded as 64-row chunks by TMA from a tensor map over kv_pages viewed as
// [1, P * page_size, 2 Hkv, D]: chunk key k lives at row block_tables[s][k / page_size] * page_size +
// k % page_size (page_size a multiple of 64: a chunk never crosses a page). The producer thread reads the
// page ids one block ahead of its loads. A chunk wholly past context_lens[s] is loaded from row P * page_size,
// out of the map's bounds: TMA fills it with zeros (no other sequence's page is read). Ids are clamped into
// [0, P). The last chunk of a context may end inside a page: its rows past the context are the page's storage
// (anything, NaN included), masked out of the scores by the causal bound and zeroed in the value tile before
// P V (consume_key_blocks' ClearValueTail).
// The output: masked 16-byte stores from the staged tile in shared memory, rows past the sequence's end not
// written. A TMA store would clip at the map's bounds only, i.e. at T, and overwrite the next sequence's
// first rows.
#include "flash_attention/forward_pipeline.cuh"
#include "flash_attention/launch.cuh"

namespace ejk {

constexpr int kPagedBlockKeys = 128;  // keys per block (the dense forward's BN)
constexpr int kPagedChunk = 64;       // rows per TMA box of kv_pages (page_size is a multiple)
constexpr int kPackedRows = 64;       // rows of a packed tile (each consumer warpgroup holds them all)
constexpr int kDealRound = 8;         // tickets per round of the hand-out order (packed_share of them packed)
constexpr int kMaxPagedSeqs = 4096;   // the work table's entries live in shared memory (8 bytes each)
// Registers per thread of the two roles after setmaxnreg. The CTA's pool is what the launch gave it (168 per
// thread: 384 threads, one CTA per SM): the consumers' increase waits for registers the producer released, so
// a budget above the pool hangs the kernel. The dense forward's 24 / 240 leave the producer too few for the
// item loop (ptxas then ignores setmaxnreg and serializes the wgmma); 40 / 232 fit both roles without spills.
constexpr int kPagedProducerRegisters = 40;
constexpr int kPagedConsumerRegisters = 232;
static_assert(128 * kPagedProducerRegisters + 256 * kPagedConsumerRegisters <= 168 * kForwardThreads,
              "the roles' registers must fit the CTA's allocation");

struct PagedParams {
  CUtensorMap q_map;   // queries as [1, T, Hq, D], boxes of 128 rows
  CUtensorMap kv_map;  // kv_pages as [1, P * page_size, 2 Hkv, D], boxes of 64 rows
  const void* queries;  // [T, Hq, D] (packed tiles gather their rows themselves)
  void* out;            // [T, Hq, D]
  const int* context_lens;     // [max_num_seqs]
  const int* block_tables;     // [max_num_seqs, pages_per_seq]
  const int* query_start_loc;  // [max_num_seqs + 1]
  const int* num_seqs;         // [1]
  int* next_item;              // [1], zero at launch
  int total_tokens, q_heads, kv_heads, page_size, num_pages, pages_per_seq, max_num_seqs;
  int packed_share;  // packed tiles per kDealRound tickets while both kinds last
  float softmax_scale;
};

// One work item: rows [row_begin, row_begin + 128) of query head `head` (a query tile), or all rows of the
// sequence for the query heads of kv head `head` (packed). seq -1: the padding rows past the last sequence (no
// keys); seq -2: nothing left.
struct PagedItem {
  int seq, packed, head, q_start, q_len, kv_len, row_begin;
};

// The work table: entry e <= count (count = num_seqs clamped; entry count is the padding rows) holds the
// number of query-tile items and of packed items of entries [0, e], in shared memory after the pipeline's.
struct PagedTable {
  int* tile_end;
  int* packed_end;
  int entries;  // max_num_seqs + 1
  int count;
  int tail_start;
};

__device__ __forceinline__ int paged_group(const PagedParams& params) { return params.q_heads / params.kv_heads; }

// Rows of entry e (a sequence, or the padding rows) and how many items of each kind it makes.
__device__ __forceinline__ void entry_items(const PagedParams& params, const PagedTable& table, int e, int& tiles,
                                            int& packed) {
  tiles = packed = 0;
  if (e < table.count) {
    const int q_len = max(params.query_start_loc[e + 1] - params.query_start_loc[e], 0);
    if (q_len == 0) return;
    if (q_len * paged_group(params) <= kPackedRows) packed = params.kv_heads;
    else tiles = (q_len + kForwardRows - 1) / kForwardRows * params.q_heads;
  } else if (e == table.count) {
    const int tail = max(params.total_tokens - table.tail_start, 0);
    tiles = (tail + kForwardRows - 1) / kForwardRows * params.q_heads;
  }
}

// All threads of the CTA: the table's prefix counts (a block-wide scan of per-thread runs of entries).
__device__ __forceinline__ void build_paged_table(const PagedParams& params, const PagedTable& table) {
  __shared__ int warp_sums[2][kForwardThreads / 32];
  const int per_thread = (table.entries + kForwardThreads - 1) / kForwardThreads;
  const int first = threadIdx.x * per_thread, last = min(first + per_thread, table.entries);
  int tiles_sum = 0, packed_sum = 0;
  for (int e = first; e < last; ++e) {
    int tiles, packed;
    entry_items(params, table, e, tiles, packed);
    tiles_sum += tiles;
    packed_sum += packed;
    table.tile_end[e] = tiles_sum;  // within the thread's run; offsets added below
    table.packed_end[e] = packed_sum;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int tiles_incl = tiles_sum, packed_incl = packed_sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int a = __shfl_up_sync(0xffffffff, tiles_incl, d), b = __shfl_up_sync(0xffffffff, packed_incl, d);
    if (lane >= d) tiles_incl += a, packed_incl += b;
  }
  if (lane == 31) warp_sums[0][warp] = tiles_incl, warp_sums[1][warp] = packed_incl;
  __syncthreads();
  int tiles_offset = tiles_incl - tiles_sum, packed_offset = packed_incl - packed_sum;
  for (int w = 0; w < warp; ++w) tiles_offset += warp_sums[0][w], packed_offset += warp_sums[1][w];
  for (int e = first; e < last; ++e) table.tile_end[e] += tiles_offset, table.packed_end[e] += packed_offset;
  __syncthreads();
}

// First entry whose prefix count exceeds j.
__device__ __forceinline__ int find_entry(const int* end, int entries, int j) {
  int lo = 0, hi = entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (end[mid] > j) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Item `ticket` of the hand-out order: rounds of kDealRound tickets, packed_share packed tiles then the rest
// query tiles, while both kinds last; then what is left of the two, alternating, then of the longer one.
__device__ __forceinline__ PagedItem paged_item(const PagedParams& params, const PagedTable& table, int ticket) {
  const int tiles = table.tile_end[table.entries - 1], packed = table.packed_end[table.entries - 1];
  if (ticket >= tiles + packed) return {-2, 0, 0, 0, 0, 0, 0};
  const int share = params.packed_share, rest = kDealRound - share;
  const int rounds = min(share ? packed / share : tiles, rest ? tiles / rest : packed);
  bool is_packed;
  int j;
  if (ticket < rounds * kDealRound) {
    const int round = ticket / kDealRound, place = ticket % kDealRound;
    is_packed = place < share;
    j = is_packed ? round * share + place : round * rest + place - share;
  } else {
    const int left = ticket - rounds * kDealRound;
    const int packed_left = packed - rounds * share, tiles_left = tiles - rounds * rest;
    const int both = min(packed_left, tiles_left);
    if (left < 2 * both) is_packed = left & 1, j = left / 2;
    else is_packed = packed_left > tiles_left, j = left - both;
    j += is_packed ? rounds * share : rounds * rest;
  }
  const int* end = is_packed ? table.packed_end : table.tile_end;
  const int e = find_entry(end, table.entries, j);
  const int local = j - (e > 0 ? end[e - 1] : 0);
  PagedItem item;
  item.packed = is_packed;
  if (e < table.count) {
    item.seq = e;
    item.q_start = params.query_start_loc[e];
    item.q_len = params.query_start_loc[e + 1] - item.q_start;
    item.kv_len = params.context_lens[e];
  } else {
    item.seq = -1;
    item.q_start = table.tail_start;
    item.q_len = params.total_tokens - table.tail_start;
    item.kv_len = 0;
  }
  if (is_packed) {
    item.head = local;
    item.row_begin = 0;
  } else {  // the heaviest (last) tile of the sequence first; its heads next to each other
    const int count = (item.q_len + kForwardRows - 1) / kForwardRows;
    item.head = local % params.q_heads;
    item.row_begin = (count - 1 - local / params.q_heads) * kForwardRows;
  }
  return item;
}

// An item as a causal Problem of one batch entry (rows and keys local to its sequence), the rows it covers
// (query tile: [row_begin, row_end); packed: every query) and their key blocks.
struct ItemKeys {
  Problem problem;
  int row_end;
  KeyBlocks blocks;
};

__device__ __forceinline__ ItemKeys item_keys(const PagedParams& params, const PagedItem& item) {
  ItemKeys keys;
  const int longest = item.q_len + item.kv_len + 1;
  keys.problem = Problem{1, item.q_len, item.kv_len, params.q_heads, params.kv_heads, params.softmax_scale, 0.f, 1,
                         -1, -1, -longest, 0};
  keys.row_end = item.packed ? item.q_len : min(item.row_begin + kForwardRows, item.q_len);
  keys.blocks = item.seq >= 0 ? key_blocks(keys.problem, item.row_begin, keys.row_end, kPagedBlockKeys)
                              : KeyBlocks{0, 0};
  return keys;
}

// The producer thread's part of an item with key blocks: Q (query tiles), then the key blocks from the pages.
template <class T, int D, class Shared>
__device__ __forceinline__ void produce_paged_item(const PagedParams& params, Shared& shared, const PagedItem& item,
                                                   const KeyBlocks& blocks) {
  constexpr int BN = kPagedBlockKeys;
  const int kv_head = item.packed ? item.head : item.head / paged_group(params);
  const int* table = params.block_tables + static_cast<size_t>(item.seq) * params.pages_per_seq;
  const int past_end = params.num_pages * params.page_size;  // a row out of the map: zeros
  // rows of kv_pages (as one [P * page_size] axis) of the block's 64-key chunks
  auto locate = [&](int key0) {
    struct Rows {
      int row[BN / kPagedChunk];
    } where;
#pragma unroll
    for (int c = 0; c < BN / kPagedChunk; ++c) {
      const int key = key0 + c * kPagedChunk;
      const int logical = key / params.page_size;
      const int page = key < item.kv_len && logical < params.pages_per_seq
                           ? min(max(table[logical], 0), params.num_pages - 1)
                           : -1;
      where.row[c] = page < 0 ? past_end : page * params.page_size + key % params.page_size;
    }
    return where;
  };
  auto load_kv = [&](Barrier* bar, T* tile_kv, const auto& where, bool value) {
#pragma unroll
    for (int c = 0; c < BN / kPagedChunk; ++c) {
      // chunk c: rows [64 c, 64 c + 64) of each of the tile's D / 64 panels of BN rows
      load_tile<D>(&params.kv_map, bar, tile_kv + c * kPagedChunk * 64, BN, where.row[c], 2 * kv_head + (value ? 1 : 0),
                   0);
    }
  };
  if (item.packed) {  // the consumer warpgroup gathers the packed rows itself
    produce_key_blocks<T, D, BN>(shared, blocks, [](Barrier*, T*) {}, locate, load_kv, 0);
  } else {
    produce_key_blocks<T, D, BN>(
        shared, blocks,
        [&](Barrier* bar, T* tile_q) {
          load_tile<D>(&params.q_map, bar, tile_q, kForwardRows, item.q_start + item.row_begin, item.head, 0);
        },
        locate, load_kv);
  }
}

// A packed tile's query rows, gathered into consumer warpgroup `group`'s 64 rows of the Q tile (swizzled as TMA
// would put them; zeros past the item's rows; both warpgroups hold the same rows: they split the key blocks).
// By the warpgroup's 128 threads, before its first product.
template <class T, int D>
__device__ __forceinline__ void gather_packed_rows(const PagedParams& params, T* q_tile, const PagedItem& item,
                                                   int group, int t) {
  const int heads = paged_group(params), rows = item.q_len * heads;
  constexpr int kChunksPerRow = D / 8;  // 16 bytes each
  char* tile = reinterpret_cast<char*>(q_tile);
#pragma unroll
  for (int j = 0; j < kPackedRows * kChunksPerRow / 128; ++j) {
    const int chunk = t + 128 * j;
    const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const T* source = static_cast<const T*>(params.queries) +
                        (static_cast<size_t>(item.q_start + row / heads) * params.q_heads + item.head * heads +
                         row % heads) * D + col;
      value = *reinterpret_cast<const uint4*>(source);
    }
    const int tile_row = kPackedRows * group + row;
    *reinterpret_cast<uint4*>(tile + (col / 64) * kForwardRows * 128 + swizzled_offset(tile_row, col % 64)) = value;
  }
  fence_async_shared();  // before the tensor cores read them
  named_sync(3 + group, 128);
}

// Consumer warpgroup `group`'s rows of the staged output tile (normalized, in the Q tile) to `out`: tile row r
// is query row_begin + r / rows_per_query of head first_head + r % rows_per_query; rows past the item's
// queries are not written (they belong to the next sequence).
template <class T, int D>
__device__ __forceinline__ void store_paged_rows(const PagedParams& params, const T* q_tile, const PagedItem& item,
                                                 int group, int t, int first_head, int rows_per_query) {
  const char* staged = reinterpret_cast<const char*>(q_tile);
  constexpr int kChunksPerRow = D / 8;  // 16 bytes each
#pragma unroll
  for (int j = 0; j < 64 * kChunksPerRow / 128; ++j) {
    const int chunk = t + 128 * j;
    const int row = 64 * group + chunk / kChunksPerRow;  // within the tile
    const int col = (chunk % kChunksPerRow) * 8;
    const int query = item.row_begin + row / rows_per_query;
    if (query < item.q_len) {
      const uint4 value = *reinterpret_cast<const uint4*>(staged + (col / 64) * kForwardRows * 128 +
                                                          swizzled_offset(row, col % 64));
      T* out = static_cast<T*>(params.out) +
               (static_cast<size_t>(item.q_start + query) * params.q_heads + first_head + row % rows_per_query) * D +
               col;
      *reinterpret_cast<uint4*>(out) = value;
    }
  }
}

template <class T, int D>
__global__ void __launch_bounds__(kForwardThreads, 1) paged_forward_kernel(const __grid_constant__ PagedParams params) {
  constexpr int BN = kPagedBlockKeys;
  using Shared = ForwardShared<T, D, BN>;
  Shared& pipeline = aligned_shared<Shared>();
  __shared__ PagedItem current;
  const int warpgroup = warpgroup_index();

  // The work table (its shape in shared memory too: the loop keeps no registers for it across the items).
  __shared__ PagedTable table;
  if (threadIdx.x == 0) {
    table.tile_end = reinterpret_cast<int*>(&pipeline + 1);
    table.entries = params.max_num_seqs + 1;
    table.packed_end = table.tile_end + table.entries;
    table.count = min(max(*params.num_seqs, 0), params.max_num_seqs);
    table.tail_start = table.count > 0 ? params.query_start_loc[table.count] : 0;
  }
  __syncthreads();
  build_paged_table(params, table);

  // The roles split once (each on its register budget: ptxas keeps a warpgroup's code after setmaxnreg
  // within it, so no code runs under both budgets); both loops meet at the same two CTA barriers per item.
  // The item's bookkeeping is done by the first consumer thread (the producer runs on few registers).
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kPagedProducerRegisters>();
    for (;;) {
      __syncthreads();  // the dealer has published the item
      if (current.seq == -2) break;
      if (threadIdx.x == 0) {
        const PagedItem item = current;
        const ItemKeys keys = item_keys(params, item);
        if (keys.blocks.last > keys.blocks.first) produce_paged_item<T, D>(params, pipeline, item, keys.blocks);
      }
      __syncthreads();  // the item's shared memory and barriers are free again
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kPagedConsumerRegisters>();
    const int group = warpgroup - 1;  // 0 or 1: rows [64 * group, 64 * group + 64) of a query tile
    const int t = threadIdx.x % 128;
    const Extras none{nullptr, 0, nullptr, nullptr};
    for (;;) {
      if (threadIdx.x == kForwardThreads / 3) {  // the dealer
        current = paged_item(params, table, atomicAdd(params.next_item, 1));
        // fresh phases (every stage of the last item was consumed); a packed tile's stages have one reader
        init_forward_barriers(pipeline, current.packed ? 1 : 2);
      }
      __syncthreads();
      const PagedItem item = current;
      if (item.seq == -2) break;
      const ItemKeys keys = item_keys(params, item);
      ConsumerRows<D> rows;
      if (!item.packed) {
        consume_key_blocks<T, D, BN, false, Shared, true>(pipeline, keys.problem, none, item.row_begin, keys.row_end,
                                                          keys.blocks, item.head, 0, group, t, rows);
        stage_output<T, D>(pipeline.q, group, t, rows);
        named_sync(3 + group, 128);
        store_paged_rows<T, D>(params, pipeline.q, item, group, t, item.head, 1);
      } else {  // packed: both warpgroups on the same rows, alternate key blocks, merged into warpgroup 0's
        const int heads = paged_group(params);
        gather_packed_rows<T, D>(params, pipeline.q, item, group, t);
        consume_key_blocks<T, D, BN, false, Shared, true, true>(pipeline, keys.problem, none, 0, keys.row_end,
                                                                keys.blocks, 0, 0, group, t, rows, heads);
        merge_split_rows<T, D, BN>(pipeline, group, t, params.softmax_scale * 1.4426950408889634f, rows);
        if (group == 0) {
          stage_output<T, D>(pipeline.q, 0, t, rows);
          named_sync(3, 128);
          store_paged_rows<T, D>(params, pipeline.q, item, 0, t, item.head * heads, heads);
        }
      }
      // the tiles this item wrote and read through the generic proxy (gathered rows, staged output, the
      // merge's exchange) are the next item's TMA destinations: order them before the async proxy's writes
      fence_async_shared();
      __syncthreads();  // the item's shared memory and barriers are free again
    }
  }
}

template <class T, int D>
cudaError_t launch_paged_forward(cudaStream_t stream, PagedParams params, const void* queries,
                                 const void* kv_pages) {
  const CUtensorMapDataType type = Element<T>::tma_type;
  cudaError_t error;
  if ((error = encode_tile_map(&params.q_map, type, queries, 1, params.total_tokens, params.q_heads, D,
                               kForwardRows)) != cudaSuccess ||
      (error = encode_tile_map(&params.kv_map, type, kv_pages, 1, params.num_pages * params.page_size,
                               2 * params.kv_heads, D, kPagedChunk)) != cudaSuccess) {
    return error;
  }
  params.queries = queries;
  auto kernel = paged_forward_kernel<T, D>;
  const size_t shared_bytes = sizeof(ForwardShared<T, D, kPagedBlockKeys>) + 1024 +
                              2 * sizeof(int) * static_cast<size_t>(params.max_num_seqs + 1);
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess) return error;
  int device = 0, sms = 0;
  if ((error = cudaGetDevice(&device)) != cudaSuccess ||
      (error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (error = cudaMemsetAsync(params.next_item, 0, sizeof(int), stream)) != cudaSuccess) {
    return error;
  }
  kernel<<<sms, kForwardThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("ejkernel paged flash attention: " + what);
}

ffi::Error paged_forward_handler(cudaStream_t stream, ffi::AnyBuffer queries, ffi::AnyBuffer kv_pages,
                                 ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                                 float softmax_scale, int32_t packed_share, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> next_item) {
  auto qd = queries.dimensions(), kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) {
    return invalid("queries must be [tokens, heads, dim] and kv_pages [pages, page_size, 2 * kv_heads, dim]; got " +
                   shape_text(queries) + ", " + shape_text(kv_pages));
  }
  if (queries.element_type() != kv_pages.element_type() ||
      (queries.element_type() != ffi::DataType::BF16 && queries.element_type() != ffi::DataType::F16)) {
    return invalid("queries and kv_pages must both be bfloat16 or both float16");
  }
  if (qd[2] != 128 || kd[3] != 128 || kd[1] % kPagedChunk != 0 || kd[1] == 0 || kd[2] % 2 != 0 || kd[2] == 0 ||
      qd[1] % (kd[2] / 2) != 0 || kd[0] == 0) {
    return invalid("queries " + shape_text(queries) + " and kv_pages " + shape_text(kv_pages) +
                   " need head dim 128, a page size that is a multiple of 64, kv heads dividing the query heads");
  }
  auto sd = context_lens.dimensions(), td = block_tables.dimensions(), ld = query_start_loc.dimensions();
  if (sd.size() != 1 || td.size() != 2 || td[0] != sd[0] || ld.size() != 1 || ld[0] != sd[0] + 1 ||
      num_seqs.element_count() != 1) {
    return invalid("context_lens [S], block_tables [S, pages], query_start_loc [S + 1], num_seqs [1] expected");
  }
  if (sd[0] > kMaxPagedSeqs || next_item->element_count() != 1) {
    return invalid("at most " + std::to_string(kMaxPagedSeqs) + " sequences (the work table lives in shared memory), got " +
                   std::to_string(sd[0]) + "; and one int32 counter");
  }
  if (kd[0] * kd[1] >= (int64_t{1} << 31) || qd[0] >= (int64_t{1} << 31) - 128 * (sd[0] + 2)) {
    return invalid("kv_pages or queries too large for 32-bit row coordinates");
  }
  if (packed_share < 0 || packed_share > kDealRound) {
    return invalid("packed_share must be in [0, " + std::to_string(kDealRound) + "], got " +
                   std::to_string(packed_share));
  }
  if (qd[0] == 0) return ffi::Error::Success();
  PagedParams params;
  params.packed_share = packed_share;
  params.out = out->untyped_data();
  params.context_lens = context_lens.typed_data();
  params.block_tables = block_tables.typed_data();
  params.query_start_loc = query_start_loc.typed_data();
  params.num_seqs = num_seqs.typed_data();
  params.next_item = next_item->typed_data();
  params.total_tokens = static_cast<int>(qd[0]);
  params.q_heads = static_cast<int>(qd[1]);
  params.kv_heads = static_cast<int>(kd[2] / 2);
  params.page_size = static_cast<int>(kd[1]);
  params.num_pages = static_cast<int>(kd[0]);
  params.pages_per_seq = static_cast<int>(td[1]);
  params.max_num_seqs = static_cast<int>(sd[0]);
  params.softmax_scale = softmax_scale;
  cudaError_t error = queries.element_type() == ffi::DataType::BF16
                          ? launch_paged_forward<__nv_bfloat16, 128>(stream, params, queries.untyped_data(),
                                                                     kv_pages.untyped_data())
                          : launch_paged_forward<__half, 128>(stream, params, queries.untyped_data(),
                                                              kv_pages.untyped_data());
  return cuda_error(error, "paged kernel launch");
}

}  // namespace

}  // namespace ejk

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkPagedForward, ejk::paged_forward_handler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                    // queries
                                  .Arg<xla::ffi::AnyBuffer>()                    // kv_pages
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        // context_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        // block_tables
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        // query_start_loc
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()        // num_seqs
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("packed_share")
                                  .Ret<xla::ffi::AnyBuffer>()                    // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());      // next_item: scratch [1]
