// Paged flash-attention forward for Hopper (sm_90a): ragged_page_attention's mixed batch of prefill chunks and
// decode rows, in one launch.
//
// queries [T, Hq, D] packed by query_start_loc; kv_pages [P, page_size, 2 Hkv, D], the key of kv head h at
// axis-2 index 2h, its value at 2h + 1; sequence s (< num_seqs) owns rows [query_start_loc[s],
// query_start_loc[s + 1]), whose query i sits at position context_lens[s] - q_len + i and sees the keys
// <= that position (causal within the sequence, always: the operation's definition), and with a sliding window
// of W keys only the last W of them; logits are optionally soft-capped (c * tanh(logit / c)) and attention sinks
// (logits per query head that join every row's softmax denominator) are optional.
//
// The pipeline of forward_pipeline.cuh (TMA producer warpgroup, two wgmma consumer warpgroups) on two kinds
// of work item:
// - a query tile: 128 rows of one query head of one sequence (tiles never cross sequences; a sequence's last
//   tile is partial), both consumer warpgroups ping-ponging, as in the dense forward. Compute-bound.
// - a packed tile, for sequences of at most 64 / G rows (G = Hq / Hkv: decode rows, short speculative
//   chunks): all G query heads of one kv head in 64 rows (row r = query r / G, head r % G), so the kv head's
//   pages are read once for its G heads. Both consumer warpgroups hold these rows and take alternate key
//   blocks (each full barrier with one reader: ForwardShared), without turns; warpgroup 1 hands
//   its softmax state to warpgroup 0 at the end (merge_split_rows). Bandwidth-bound: each block costs one
//   64-row warpgroup's products, and the two warpgroups work on two blocks at once.
// Scheduling: persistent CTAs (one per SM) take items from a counter in global memory (zeroed before the
// launch). Each CTA first builds, in shared memory, the prefix counts of both kinds of item over the
// sequences (all threads, one pass over query_start_loc), then mixes the two kinds in the order it hands out
// (rounds of 8 tickets, packed_share of them packed: a config field; the rest after), so that at any time some
// SMs stream pages for decode rows while others run the matrix products of prefill tiles: the two halves of
// a mixed batch bind on different units and overlap instead of adding up (the share sets how many SMs stream
// pages beside the prefill tiles; 3-5 of 8 measured within noise of each other, and a cap on the streaming CTAs
// instead of rounds measured no better: NOTES.md). A sequence's query tiles come heaviest first (causal), its
// heads next to each other (they read the same pages, mostly from L2). The rows past query_start_loc[num_seqs]
// form one more "sequence" with no keys, whose tiles write zeros.
// Stages: three K/V blocks in flight where shared memory holds them beside the work table (max_num_seqs up to
// ~240), else two (the launch picks the instantiation), for both kinds of item.
// Keys: a key block of 128 keys is loaded as 64-row chunks by TMA from a tensor map over kv_pages viewed as
// [1, P * page_size, 2 Hkv, D]: chunk key k lives at row block_tables[s][k / page_size] * page_size +
// k % page_size (page_size a multiple of 64: a chunk never crosses a page). The producer thread reads the
// page ids one block ahead of its loads. A chunk wholly past context_lens[s] is loaded from row P * page_size,
// out of the map's bounds: TMA fills it with zeros (no other sequence's page is read). Ids are clamped into
// [0, P). The last chunk of a context may end inside a page: its rows past the context are the page's storage
// (anything, NaN included), masked out of the scores by the causal bound and zeroed in the value tile before
// P V (consume_key_blocks' ClearValueTail).
// Split-K of packed tiles (flash-decoding), decided on the device: a packed tile reads its sequence's whole
// context, so a few long decode sequences would leave most SMs idle. When the batch holds fewer unsplit packed
// items than split_target (2 per CTA), each packed sequence's key blocks are cut into chunks (whole 128-key
// blocks, at least kMinSplitKeys keys each, at most kMaxSplits), one item per chunk and kv head. Such an item
// writes its merged rows unnormalized (O, row max, row sum) to a float32 slot of a scratch result, and a second
// kernel on the same stream (combine_split_rows_kernel) merges each pair's chunks and writes the output rows.
// The slot is the item's packed index: when anything splits, there are fewer than 2 * split_target <=
// kSplitSlots packed items (build_paged_table), so the scratch's static size bounds every slot.
// The output: masked 16-byte stores from the staged tile in shared memory, rows past the sequence's end not
// written. A TMA store would clip at the map's bounds only, i.e. at T, and overwrite the next sequence's
// first rows.
#include <cmath>

#include "flash_attention/forward_pipeline.cuh"
#include "flash_attention/launch.cuh"

namespace ejk {

constexpr int kPagedBlockKeys = 128;  // keys per block (the dense forward's BN)
constexpr int kPagedChunk = 64;       // rows per TMA box of kv_pages (page_size is a multiple)
constexpr int kPackedRows = 64;       // rows of a packed tile (each consumer warpgroup holds them all)
constexpr int kDealRound = 8;         // tickets per round of the hand-out order (packed_share of them packed)
constexpr int kMaxPagedSeqs = 4096;   // the work table's entries live in shared memory (8 bytes each)
// Split-K (see the header): the scratch holds kSplitSlots partial tiles; splitting aims at split_target =
// min(2 * SMs, kSplitSlots / 2) items, and the items it makes stay below 2 * split_target (build_paged_table).
constexpr int kPagedHeadDim = 128;               // the largest head dim compiled (64 and 128; sizes the slots)
constexpr int kSplitSlots = 4 * 132;             // 2 x split_target on a 132-SM H100 / H200
constexpr int kMaxSplits = 16;                   // chunks per packed tile at most
constexpr int kMinSplitKeys = 8 * kPagedBlockKeys;  // keys per chunk at least: shorter ones cost more than they save
constexpr int kSplitSlotFloats = kPackedRows * (kPagedHeadDim + 2);  // O [64][D], then 64 maxima, 64 sums
constexpr int kCombineThreads = 128;
// The work buffer (int32): the ticket counter in its first 16 bytes, then one int4 per slot, a split pair's
// descriptor at its first chunk's slot ({splits, q_start, q_len, kv head}; splits 0: none). Zeroed before the
// launch.
constexpr int kPagedWorkInts = 4 * (1 + kSplitSlots);

struct PagedParams {
  CUtensorMap q_map;   // queries as [1, T, Hq, D], boxes of 128 rows
  CUtensorMap kv_map;  // kv_pages as [1, P * page_size, 2 Hkv, D], boxes of 64 rows
  const void* queries;  // [T, Hq, D] (packed tiles gather their rows themselves)
  void* out;            // [T, Hq, D]
  const int* context_lens;     // [max_num_seqs]
  const int* block_tables;     // [max_num_seqs, pages_per_seq]
  const int* query_start_loc;  // [max_num_seqs + 1]
  const int* num_seqs;         // [1]
  int* next_item;              // [1], zero at launch (the work buffer's first int)
  int4* split_descriptors;     // [kSplitSlots], zero at launch (the work buffer's int4s after the counter's)
  float* split_partials;       // [kSplitSlots][kSplitSlotFloats]
  int total_tokens, q_heads, kv_heads, page_size, num_pages, pages_per_seq, max_num_seqs;
  int packed_share;  // packed tiles per kDealRound tickets while both kinds last
  int split_target;  // packed items split-K aims at (min(2 * SMs, kSplitSlots / 2))
  float softmax_scale;
  float softcap;        // c of c * tanh(logit / c); 0: off
  int window_left;      // a query at position p sees keys [p - window_left, p]; -1: every earlier key
  const float* sinks;   // [Hq, num_sinks] float32 logits that join every row's softmax denominator
  int num_sinks;        // 0: none
};

// The optional features of a call as the kernel reads them: in the plain variant (Extended = false: no soft
// cap, window or sinks) they are constants, so that its code is the one without them (the consumers' loop is
// scheduled by ptxas around what it can prove: runtime window and sink fields cost the query tiles ~5 %).
struct PagedFeatures {
  float softcap;
  int window_left;
  const float* sinks;
  int num_sinks;
};

template <bool Extended>
__device__ __forceinline__ PagedFeatures paged_features(const PagedParams& params) {
  PagedFeatures features;
  features.softcap = Extended ? params.softcap : 0.f;
  features.window_left = Extended ? params.window_left : -1;
  features.sinks = Extended ? params.sinks : nullptr;
  features.num_sinks = Extended ? params.num_sinks : 0;
  return features;
}

// Keys a packed tile of q_len rows over kv_len keys may see: the last q_len + window_left with a window.
__device__ __forceinline__ int packed_keys(const PagedFeatures& features, int q_len, int kv_len) {
  return features.window_left >= 0 ? min(kv_len, q_len + features.window_left) : kv_len;
}

// One work item: rows [row_begin, row_begin + 128) of query head `head` (a query tile), or all rows of the
// sequence for the query heads of kv head `head` (packed). seq -1: the padding rows past the last sequence (no
// keys); seq -2: nothing left. A split packed item (splits > 1; 0: not split) covers chunk `split` of the
// packed tile's key blocks and writes its partial rows to scratch slot `slot`.
struct PagedItem {
  int seq, packed, head, q_start, q_len, kv_len, row_begin;
  int split, splits, slot;
};

// The work table: entry e <= count (count = num_seqs clamped; entry count is the padding rows) holds the
// number of query-tile items and of packed items of entries [0, e], in shared memory after the pipeline's.
struct PagedTable {
  int* tile_end;
  int* packed_end;
  int entries;  // max_num_seqs + 1
  int count;
  int tail_start;
  int split_factor;  // chunks per packed tile (before each sequence's own bound): 1 when nothing splits
};

__device__ __forceinline__ int paged_group(const PagedParams& params) { return params.q_heads / params.kv_heads; }

// Chunks of a packed tile of a sequence of kv_len keys: the batch's split factor, bounded by whole chunks of
// kMinSplitKeys keys (so that every chunk holds at least one key block).
__device__ __forceinline__ int packed_splits(int split_factor, int kv_len) {
  return max(min(split_factor, (kv_len + kMinSplitKeys - 1) / kMinSplitKeys), 1);
}

// Key blocks of chunk `split` of `splits` (balanced; chunk boundaries on block boundaries).
__device__ __forceinline__ KeyBlocks split_chunk(const KeyBlocks& blocks, int split, int splits) {
  const int count = blocks.last - blocks.first;
  return {blocks.first + count * split / splits, blocks.first + count * (split + 1) / splits};
}

// Rows of entry e (a sequence, or the padding rows) and how many items of each kind it makes (packed: one per
// kv head and chunk, split_factor as in PagedTable).
__device__ __forceinline__ void entry_items(const PagedParams& params, const PagedFeatures& features,
                                            const PagedTable& table, int e, int split_factor, int& tiles,
                                            int& packed) {
  tiles = packed = 0;
  if (e < table.count) {
    const int q_len = max(params.query_start_loc[e + 1] - params.query_start_loc[e], 0);
    if (q_len == 0) return;
    if (q_len * paged_group(params) <= kPackedRows) {
      packed = params.kv_heads * packed_splits(split_factor, packed_keys(features, q_len, params.context_lens[e]));
    } else {
      tiles = (q_len + kForwardRows - 1) / kForwardRows * params.q_heads;
    }
  } else if (e == table.count) {
    const int tail = max(params.total_tokens - table.tail_start, 0);
    tiles = (tail + kForwardRows - 1) / kForwardRows * params.q_heads;
  }
}

// All threads of the CTA: block-wide sums of two per-thread values. Returns the sum over the threads before
// this one (exclusive prefix) in `a` and `b`, and the totals over the CTA.
__device__ __forceinline__ void block_prefix_sums(int& a, int& b, int& total_a, int& total_b) {
  __shared__ int warp_sums[2][kForwardThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int a_incl = a, b_incl = b;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int up_a = __shfl_up_sync(0xffffffff, a_incl, d), up_b = __shfl_up_sync(0xffffffff, b_incl, d);
    if (lane >= d) a_incl += up_a, b_incl += up_b;
  }
  if (lane == 31) warp_sums[0][warp] = a_incl, warp_sums[1][warp] = b_incl;
  __syncthreads();
  a = a_incl - a, b = b_incl - b;
  total_a = total_b = 0;
  for (int w = 0; w < kForwardThreads / 32; ++w) {
    if (w < warp) a += warp_sums[0][w], b += warp_sums[1][w];
    total_a += warp_sums[0][w], total_b += warp_sums[1][w];
  }
  __syncthreads();  // warp_sums free for the next call
}

// All threads of the CTA: the table's prefix counts (a block-wide scan of per-thread runs of entries). First the
// split factor: the unsplit packed items P0 (one per packed sequence and kv head) counted; if they are fewer
// than split_target, each packed tile is cut into ceil(split_target / P0) chunks (at most kMaxSplits; fewer for
// short contexts: packed_splits). Then the packed items number at most P0 * ceil(split_target / P0) <=
// split_target + P0 - 1 < 2 * split_target <= kSplitSlots: their indices are valid scratch slots.
__device__ __forceinline__ void build_paged_table(const PagedParams& params, const PagedFeatures& features,
                                                  PagedTable& table) {
  const int per_thread = (table.entries + kForwardThreads - 1) / kForwardThreads;
  const int first = threadIdx.x * per_thread, last = min(first + per_thread, table.entries);
  int no_tiles = 0, unsplit = 0, tiles_total, packed_total;  // pass 1: P0 (the query tiles do not matter)
  for (int e = first; e < last; ++e) {
    int tiles, packed;
    entry_items(params, features, table, e, 1, tiles, packed);
    unsplit += packed;
  }
  block_prefix_sums(no_tiles, unsplit, tiles_total, packed_total);
  const int target = params.split_target;
  const int split_factor =
      packed_total > 0 && packed_total < target ? min((target + packed_total - 1) / packed_total, kMaxSplits) : 1;
  int tiles_sum = 0, packed_sum = 0;
  for (int e = first; e < last; ++e) {
    int tiles, packed;
    entry_items(params, features, table, e, split_factor, tiles, packed);
    tiles_sum += tiles;
    packed_sum += packed;
    table.tile_end[e] = tiles_sum;  // within the thread's run; offsets added below
    table.packed_end[e] = packed_sum;
  }
  int tiles_offset = tiles_sum, packed_offset = packed_sum;
  block_prefix_sums(tiles_offset, packed_offset, tiles_total, packed_total);
  for (int e = first; e < last; ++e) table.tile_end[e] += tiles_offset, table.packed_end[e] += packed_offset;
  if (threadIdx.x == 0) table.split_factor = split_factor;
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
__device__ __forceinline__ PagedItem paged_item(const PagedParams& params, const PagedFeatures& features,
                                                const PagedTable& table, int ticket) {
  const int tiles = table.tile_end[table.entries - 1], packed = table.packed_end[table.entries - 1];
  if (ticket >= tiles + packed) return {-2, 0, 0, 0, 0, 0, 0, 0, 0, 0};
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
  item.split = item.splits = 0;
  item.slot = j;
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
  if (is_packed) {  // a kv head's chunks next to each other: the pair's slots [slot - split, + splits)
    const int splits = packed_splits(table.split_factor, packed_keys(features, item.q_len, item.kv_len));
    item.head = local / splits;
    item.split = local % splits;
    item.splits = splits > 1 ? splits : 0;
    item.row_begin = 0;
  } else {  // the heaviest (last) tile of the sequence first; its heads next to each other
    const int count = (item.q_len + kForwardRows - 1) / kForwardRows;
    item.head = local % params.q_heads;
    item.row_begin = (count - 1 - local / params.q_heads) * kForwardRows;
  }
  return item;
}

// An item as a causal Problem of one batch entry (rows and keys local to its sequence), the rows it covers
// (query tile: [row_begin, row_end); packed: every query) and their key blocks (a split item: its chunk).
struct ItemKeys {
  Problem problem;
  int row_end;
  KeyBlocks blocks;
};

__device__ __forceinline__ ItemKeys item_keys(const PagedParams& params, const PagedFeatures& features,
                                              const PagedItem& item) {
  ItemKeys keys;
  // causal within the sequence, and the window's left edge: key - position in [lo, 0]
  const int lo = features.window_left >= 0 ? -features.window_left : -(item.q_len + item.kv_len + 1);
  keys.problem = Problem{1, item.q_len, item.kv_len, params.q_heads, params.kv_heads, params.softmax_scale,
                         features.softcap, 1, features.window_left, -1, lo, 0};
  keys.row_end = item.packed ? item.q_len : min(item.row_begin + kForwardRows, item.q_len);
  keys.blocks = item.seq >= 0 ? key_blocks(keys.problem, item.row_begin, keys.row_end, kPagedBlockKeys)
                              : KeyBlocks{0, 0};
  if (item.splits) keys.blocks = split_chunk(keys.blocks, item.split, item.splits);
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
  // A packed tile's pages are read once (its G heads share each read); a query tile's are read again by the
  // group's other heads and the sequence's other tiles: the former leave L2 first.
  const uint64_t l2_policy = item.packed ? kEvictFirst : 0;
  auto load_kv = [&](Barrier* bar, T* tile_kv, const auto& where, bool value) {
#pragma unroll
    for (int c = 0; c < BN / kPagedChunk; ++c) {
      // chunk c: rows [64 c, 64 c + 64) of each of the tile's D / 64 panels of BN rows
      load_tile<D>(&params.kv_map, bar, tile_kv + c * kPagedChunk * 64, BN, where.row[c], 2 * kv_head + (value ? 1 : 0),
                   0, l2_policy);
    }
  };
  if (item.packed) {  // the consumer warpgroups gather the packed rows themselves
    produce_key_blocks<T, D, BN>(shared, blocks, [](Barrier*, T*) {}, locate, load_kv, 0, true);
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

// A split packed item's merged rows (warpgroup 0's, after merge_split_rows), unnormalized, to its scratch slot:
// O as [64][D] float32, then each row's max (in score units, as the loop keeps it) and sum (the quad's partial
// sums added here). Rows past the sequence's q_len * G are neither written nor read. The item of chunk 0 also
// writes the pair's descriptor (its slot is the pair's first). By warpgroup 0's 128 threads.
template <int D>
__device__ __forceinline__ void store_split_partial(const PagedParams& params, const PagedItem& item, int t,
                                                    const ConsumerRows<D>& rows) {
  static_assert(D <= kPagedHeadDim, "the scratch's slots are sized for the largest compiled head dim");
  const float sum_a = quad_sum(rows.sum_a), sum_b = quad_sum(rows.sum_b);
  const int used = item.q_len * paged_group(params);
  const int row_a = fragment_row(t), row_b = row_a + 8;
  float* slot = params.split_partials + static_cast<size_t>(item.slot) * kSplitSlotFloats;
#pragma unroll
  for (int i = 0; i < D / 2; i += 2) {
    const int row = (i & 2) ? row_b : row_a;
    if (row < used) {
      *reinterpret_cast<float2*>(slot + row * D + fragment_col(t, i)) = make_float2(rows.o[i], rows.o[i + 1]);
    }
  }
  float* maxima = slot + kPackedRows * D;
  float* sums = maxima + kPackedRows;
  if (t % 4 == 0) {  // the quad's maxima and (now) sums are equal
    if (row_a < used) maxima[row_a] = rows.max_a, sums[row_a] = sum_a;
    if (row_b < used) maxima[row_b] = rows.max_b, sums[row_b] = sum_b;
  }
  if (t == 0 && item.split == 0) {
    params.split_descriptors[item.slot] = make_int4(item.splits, item.q_start, item.q_len, item.head);
  }
}

#ifdef EJK_PAGED_TIMELINE
// EJK_PAGED_TIMELINE (an experiment build's -D flag, off in the package): each item's SM, kind, key blocks,
// start / end (%globaltimer, ns) and SM clock cycles over it (clock64: their ratio is the SM's clock) are
// written as a TimelineRecord to the last kTimelineRecords records' worth of the split partials (free unless
// split-K fills more than ~488 of its 528 slots); the record index is the work buffer's fourth int. Read by
// benchmarks/experiments/cuda_paged_timeline.py.
struct TimelineRecord {
  long long start, end;
  int sm, packed, blocks, cycles;
  int first_block, loop_end;  // ns after start: the item's first key block landed; the dealer's key loop ended
};
constexpr int kTimelineRecords = 32768;

__device__ __forceinline__ long long globaltimer() {
  long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ __forceinline__ void record_item(const PagedParams& params, const PagedItem& item, const ItemKeys& keys,
                                            long long started, long long started_clock, long long first_block,
                                            long long loop_end) {
  const int index = atomicAdd(params.next_item + 3, 1);
  if (index >= kTimelineRecords) return;
  int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  TimelineRecord* records = reinterpret_cast<TimelineRecord*>(
      params.split_partials + static_cast<size_t>(kSplitSlots) * kSplitSlotFloats) - kTimelineRecords;
  const int cycles = static_cast<int>(clock64() - started_clock);
  records[index] = {started, globaltimer(), sm, item.packed, keys.blocks.last - keys.blocks.first, cycles,
                    static_cast<int>(first_block - started), static_cast<int>(loop_end - started)};
}
#endif

// Capped: params.softcap is set (the soft cap is a compile-time variant of the consumers' loop, as in the dense
// forward); Extended: a soft cap, window or sinks may be set (else the plain variant: PagedFeatures).
template <class T, int D, int Stages, bool Capped, bool Extended>
__global__ void __launch_bounds__(kForwardThreads, 1) paged_forward_kernel(const __grid_constant__ PagedParams params) {
  constexpr int BN = kPagedBlockKeys;
  using Shared = ForwardShared<T, D, BN, Stages>;
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
  const PagedFeatures features = paged_features<Extended>(params);
  build_paged_table(params, features, table);

  // The roles split once (each on its register budget: ptxas keeps a warpgroup's code after setmaxnreg
  // within it, so no code runs under both budgets); both loops meet at the same two CTA barriers per item.
  // The item's bookkeeping is done by the first consumer thread (the producer runs on few registers).
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kPersistentProducerRegisters>();
    for (;;) {
      __syncthreads();  // the dealer has published the item
      if (current.seq == -2) break;
      if (threadIdx.x == 0) {
        const PagedItem item = current;
        const ItemKeys keys = item_keys(params, features, item);
        if (keys.blocks.last > keys.blocks.first) produce_paged_item<T, D>(params, pipeline, item, keys.blocks);
      }
      __syncthreads();  // the item's shared memory and barriers are free again
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kPersistentConsumerRegisters>();
    const int group = warpgroup - 1;  // 0 or 1: rows [64 * group, 64 * group + 64) of a query tile
    const int t = threadIdx.x % 128;
#ifdef EJK_PAGED_TIMELINE
    long long started = 0, started_clock = 0, first_block = 0, loop_end = 0;
#endif
    for (;;) {
      if (threadIdx.x == kForwardThreads / 3) {  // the dealer
#ifdef EJK_PAGED_TIMELINE
        started = globaltimer();
        started_clock = clock64();
#endif
        current = paged_item(params, features, table, atomicAdd(params.next_item, 1));
        // fresh phases (every stage of the last item was consumed); a packed tile's blocks have one reader each
        init_forward_barriers(pipeline, current.packed ? 1 : 2);
      }
      __syncthreads();
      const PagedItem item = current;
      if (item.seq == -2) break;
      const ItemKeys keys = item_keys(params, features, item);
#ifdef EJK_PAGED_TIMELINE
      if (threadIdx.x / 32 == kForwardThreads / 3 / 32) {  // the dealer's whole warp (the products are warp-wide)
        // block 0 lands in stage 0, full barrier 0, phase 0 (fresh each item)
        if (keys.blocks.last > keys.blocks.first) barrier_wait(&pipeline.k_full[0], 0);
        first_block = globaltimer();
      }
#endif
      ConsumerRows<D> rows;
      if (!item.packed) {
        const Extras sinks{features.sinks, features.num_sinks, nullptr, nullptr};
        consume_key_blocks<T, D, BN, Capped, Shared, true>(pipeline, keys.problem, sinks, item.row_begin,
                                                           keys.row_end, keys.blocks, item.head, 0, group, t, rows);
#ifdef EJK_PAGED_TIMELINE
        if (threadIdx.x == kForwardThreads / 3) loop_end = globaltimer();
#endif
        stage_output<T, D>(pipeline.q, group, t, rows);
        named_sync(3 + group, 128);
        store_paged_rows<T, D>(params, pipeline.q, item, group, t, item.head, 1);
      } else {  // packed: both warpgroups on the same rows, alternate key blocks, merged into warpgroup 0's
        const int heads = paged_group(params);
        gather_packed_rows<T, D>(params, pipeline.q, item, group, t);
        // the sinks join each row's softmax once: warpgroup 0 of the first key chunk starts them
        const bool starts_sinks = group == 0 && item.split == 0;
        const Extras sinks{starts_sinks ? features.sinks : nullptr, starts_sinks ? features.num_sinks : 0, nullptr,
                           nullptr};
        consume_key_blocks<T, D, BN, Capped, Shared, true, true>(pipeline, keys.problem, sinks, 0, keys.row_end,
                                                                 keys.blocks, item.head * heads, 0, group, t, rows,
                                                                 heads);
#ifdef EJK_PAGED_TIMELINE
        if (threadIdx.x == kForwardThreads / 3) loop_end = globaltimer();
#endif
        merge_split_rows<T, D, BN>(pipeline, keys.blocks.last - keys.blocks.first, group, t,
                                   exponent_unit(features.softcap > 0.f, params.softmax_scale), rows);
        if (group == 0 && item.splits) {  // one chunk of the keys: combine_split_rows_kernel finishes the rows
          store_split_partial<D>(params, item, t, rows);
        } else if (group == 0) {
          stage_output<T, D>(pipeline.q, 0, t, rows);
          named_sync(3, 128);
          store_paged_rows<T, D>(params, pipeline.q, item, 0, t, item.head * heads, heads);
        }
      }
      // the tiles this item wrote and read through the generic proxy (gathered rows, staged output, the
      // merge's exchange) are the next item's TMA destinations: order them before the async proxy's writes
      fence_async_shared();
      __syncthreads();  // the item's shared memory and barriers are free again
#ifdef EJK_PAGED_TIMELINE
      if (threadIdx.x == kForwardThreads / 3) {
        record_item(params, item, keys, started, started_clock, first_block, loop_end);
      }
#endif
    }
  }
}

// After paged_forward_kernel, on the same stream (its writes are visible at this kernel's start: stream order):
// CTA b reads slot b's descriptor; where a split pair starts there, it merges the pair's `splits` partial tiles
// (slots b, b + 1, ...) row by row (log-sum-exp: each chunk's rows rescaled to the largest maximum, in the main
// kernel's exp2 units) and writes the normalized rows: row r is query r / G of query head kv_head * G + r % G.
// Rows no chunk saw a key for (every maximum -inf) get zeros. Slots without a descriptor: nothing to do.
template <class T, int D>
__global__ void __launch_bounds__(kCombineThreads)
    combine_split_rows_kernel(const __grid_constant__ PagedParams params) {
  const int4 pair = params.split_descriptors[blockIdx.x];
  const int splits = pair.x, q_start = pair.y, kv_head = pair.w;
  if (splits == 0) return;
  const int heads = paged_group(params), used = pair.z * heads;
  const float unit = exponent_unit(params.softcap > 0.f, params.softmax_scale);
  const float* partials = params.split_partials + static_cast<size_t>(blockIdx.x) * kSplitSlotFloats;
  for (int index = threadIdx.x; index < used * (D / 4); index += kCombineThreads) {
    const int row = index / (D / 4), col = index % (D / 4) * 4;
    float top = -INFINITY;
    for (int c = 0; c < splits; ++c) top = fmaxf(top, partials[c * kSplitSlotFloats + kPackedRows * D + row]);
    const float base = top == -INFINITY ? 0.f : top * unit;
    float4 sum_o = make_float4(0.f, 0.f, 0.f, 0.f);
    float total = 0.f;
    for (int c = 0; c < splits; ++c) {
      const float* chunk = partials + c * kSplitSlotFloats;
      const float weight = exp2f(chunk[kPackedRows * D + row] * unit - base);  // 0 for a chunk that saw no key
      total += weight * chunk[kPackedRows * D + kPackedRows + row];
      const float4 o = *reinterpret_cast<const float4*>(chunk + row * D + col);
      sum_o.x += weight * o.x, sum_o.y += weight * o.y, sum_o.z += weight * o.z, sum_o.w += weight * o.w;
    }
    const float inverse = total > 0.f ? 1.f / total : 0.f;
    T* out = static_cast<T*>(params.out) +
             (static_cast<size_t>(q_start + row / heads) * params.q_heads + kv_head * heads + row % heads) * D + col;
    *reinterpret_cast<uint2*>(out) = make_uint2(Element<T>::pack(sum_o.x * inverse, sum_o.y * inverse),
                                                Element<T>::pack(sum_o.z * inverse, sum_o.w * inverse));
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
  // Three K/V stages where they fit beside the work table (up to ~240 sequence slots at 227 KB per CTA), for the
  // query tiles (~5 % on the mixed batch) and the packed tiles' loads in flight
  const size_t table_bytes = 2 * sizeof(int) * static_cast<size_t>(params.max_num_seqs + 1);
  // three variants: soft-capped (with or without a window and sinks), a window or sinks, none of them
  const bool capped = params.softcap > 0.f, extended = capped || params.window_left >= 0 || params.num_sinks > 0;
  auto variant = [&](auto stages) {
    constexpr int kStages = decltype(stages)::value;
    return capped     ? paged_forward_kernel<T, D, kStages, true, true>
           : extended ? paged_forward_kernel<T, D, kStages, false, true>
                      : paged_forward_kernel<T, D, kStages, false, false>;
  };
  auto kernel = variant(std::integral_constant<int, 3>{});
  size_t shared_bytes = sizeof(ForwardShared<T, D, kPagedBlockKeys, 3>) + 1024 + table_bytes;
  int device = 0, optin = 0;
  cudaFuncAttributes attributes;
  if ((error = cudaGetDevice(&device)) != cudaSuccess ||
      (error = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess ||
      (error = cudaFuncGetAttributes(&attributes, kernel)) != cudaSuccess) {
    return error;
  }
  if (shared_bytes + attributes.sharedSizeBytes > static_cast<size_t>(optin)) {
    kernel = variant(std::integral_constant<int, 2>{});
    shared_bytes = sizeof(ForwardShared<T, D, kPagedBlockKeys, 2>) + 1024 + table_bytes;
  }
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess) return error;
  int sms = 0;
  if ((error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (error = cudaMemsetAsync(params.next_item, 0, kPagedWorkInts * sizeof(int), stream)) != cudaSuccess) {
    return error;
  }
  params.split_target = std::min(2 * sms, kSplitSlots / 2);
  kernel<<<sms, kForwardThreads, shared_bytes, stream>>>(params);
  if ((error = cudaGetLastError()) != cudaSuccess) return error;
  // one CTA per slot a split pair can start at (packed indices < 2 * split_target); most find no descriptor
  combine_split_rows_kernel<T, D><<<2 * params.split_target, kCombineThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("ejkernel paged flash attention: " + what);
}

ffi::Error paged_forward_handler(cudaStream_t stream, ffi::AnyBuffer queries, ffi::AnyBuffer kv_pages,
                                 ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                                 ffi::AnyBuffer sinks, float softmax_scale, int32_t packed_share,
                                 float softcap, int32_t window_left, int32_t num_sinks,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> work,
                                 ffi::Result<ffi::Buffer<ffi::F32>> split_partials) {
  auto qd = queries.dimensions(), kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4) {
    return invalid("queries must be [tokens, heads, dim] and kv_pages [pages, page_size, 2 * kv_heads, dim]; got " +
                   shape_text(queries) + ", " + shape_text(kv_pages));
  }
  if (queries.element_type() != kv_pages.element_type() ||
      (queries.element_type() != ffi::DataType::BF16 && queries.element_type() != ffi::DataType::F16)) {
    return invalid("queries and kv_pages must both be bfloat16 or both float16");
  }
  if ((qd[2] != 64 && qd[2] != 128) || kd[3] != qd[2] || kd[1] % kPagedChunk != 0 || kd[1] == 0 ||
      kd[2] % 2 != 0 || kd[2] == 0 || qd[1] % (kd[2] / 2) != 0 || kd[0] == 0) {
    return invalid("queries " + shape_text(queries) + " and kv_pages " + shape_text(kv_pages) +
                   " need head dim 64 or 128, a page size that is a multiple of 64, kv heads dividing the query "
                   "heads");
  }
  auto sd = context_lens.dimensions(), td = block_tables.dimensions(), ld = query_start_loc.dimensions();
  if (sd.size() != 1 || td.size() != 2 || td[0] != sd[0] || ld.size() != 1 || ld[0] != sd[0] + 1 ||
      num_seqs.element_count() != 1) {
    return invalid("context_lens [S], block_tables [S, pages], query_start_loc [S + 1], num_seqs [1] expected");
  }
  if (sd[0] > kMaxPagedSeqs) {
    return invalid("context_lens has " + std::to_string(sd[0]) + " sequence slots; at most " +
                   std::to_string(kMaxPagedSeqs) + " (the work table lives in shared memory)");
  }
  if (work->element_count() != kPagedWorkInts) {
    return invalid("the work buffer result must be int32[" + std::to_string(kPagedWorkInts) +
                   "] (counter, split descriptors), got " + std::to_string(work->element_count()) + " elements");
  }
  if (split_partials->element_count() != static_cast<int64_t>(kSplitSlots) * kSplitSlotFloats) {
    return invalid("the split partials result must be float32[" + std::to_string(kSplitSlots) + ", " +
                   std::to_string(kPackedRows) + ", " + std::to_string(kPagedHeadDim + 2) + "], got " +
                   std::to_string(split_partials->element_count()) + " elements");
  }
  if (kd[0] * kd[1] >= (int64_t{1} << 31) || qd[0] >= (int64_t{1} << 31) - 128 * (sd[0] + 2)) {
    return invalid("kv_pages or queries too large for 32-bit row coordinates");
  }
  if (packed_share < 0 || packed_share > kDealRound) {
    return invalid("packed_share must be in [0, " + std::to_string(kDealRound) + "], got " +
                   std::to_string(packed_share));
  }
  if (num_sinks < 0 || (num_sinks > 0 && (sinks.element_type() != ffi::DataType::F32 ||
                                           sinks.dimensions().size() != 2 || sinks.dimensions()[0] != qd[1] ||
                                           sinks.dimensions()[1] != num_sinks))) {
    return invalid("sinks must be float32 [query heads = " + std::to_string(qd[1]) + ", num_sinks = " +
                   std::to_string(num_sinks) + "], got " + shape_text(sinks));
  }
  if (!(softcap >= 0.f) || std::isinf(softcap) || window_left < -1) {
    return invalid("softcap must be finite and >= 0 (0: off) and window_left >= -1 (-1: no window), got " +
                   std::to_string(softcap) + ", " + std::to_string(window_left));
  }
  if (qd[0] == 0) return ffi::Error::Success();
  PagedParams params;
  params.packed_share = packed_share;
  params.out = out->untyped_data();
  params.context_lens = context_lens.typed_data();
  params.block_tables = block_tables.typed_data();
  params.query_start_loc = query_start_loc.typed_data();
  params.num_seqs = num_seqs.typed_data();
  params.next_item = work->typed_data();
  params.split_descriptors = reinterpret_cast<int4*>(work->typed_data()) + 1;
  params.split_partials = split_partials->typed_data();
  params.total_tokens = static_cast<int>(qd[0]);
  params.q_heads = static_cast<int>(qd[1]);
  params.kv_heads = static_cast<int>(kd[2] / 2);
  params.page_size = static_cast<int>(kd[1]);
  params.num_pages = static_cast<int>(kd[0]);
  params.pages_per_seq = static_cast<int>(td[1]);
  params.max_num_seqs = static_cast<int>(sd[0]);
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window_left = window_left;
  params.sinks = num_sinks > 0 ? static_cast<const float*>(sinks.untyped_data()) : nullptr;
  params.num_sinks = num_sinks;
  const bool bf16 = queries.element_type() == ffi::DataType::BF16, wide = qd[2] == 128;
  const void *q = queries.untyped_data(), *kv = kv_pages.untyped_data();
  cudaError_t error = bf16 ? (wide ? launch_paged_forward<__nv_bfloat16, 128>(stream, params, q, kv)
                                   : launch_paged_forward<__nv_bfloat16, 64>(stream, params, q, kv))
                           : (wide ? launch_paged_forward<__half, 128>(stream, params, q, kv)
                                   : launch_paged_forward<__half, 64>(stream, params, q, kv));
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
                                  .Arg<xla::ffi::AnyBuffer>()                    // sinks f32 [Hq, num_sinks]
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("packed_share")
                                  .Attr<float>("softcap")        // 0: off
                                  .Attr<int32_t>("window_left")  // -1: no window
                                  .Attr<int32_t>("num_sinks")    // 0: none (sinks then unread)
                                  .Ret<xla::ffi::AnyBuffer>()                    // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()        // work: counter, split descriptors
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());      // split partials: scratch
