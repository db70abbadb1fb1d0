// Paged flash-attention forward for Hopper (sm_90a): ragged_page_attention's prefill (and any other) rows.
//
// queries [T, Hq, D] packed by query_start_loc; kv_pages [P, page_size, 2 Hkv, D], the key of kv head h at
// axis-2 index 2h, its value at 2h + 1; sequence s (< num_seqs) owns rows [query_start_loc[s],
// query_start_loc[s + 1]), whose query i sits at position context_lens[s] - q_len + i and sees the keys
// <= that position (causal within the sequence, always: the operation's definition).
//
// The pipeline of forward_pipeline.cuh (TMA producer warpgroup, two ping-ponging wgmma consumer warpgroups)
// with two sources of its own:
// - work: the grid is a static upper bound of query tiles (ceil(T / 128) + max_num_seqs + 1) x Hq. Warp 0 of
//   each CTA finds its tile by a warp-wide scan over the sequences' tile counts (32 sequences per step) and
//   puts it in shared memory; tiles of 128 rows never cross sequences (a sequence's last tile is partial), the
//   heaviest tile of a sequence comes first. The rows past query_start_loc[num_seqs] form one more "sequence"
//   with no keys: its tiles write the zeros the contract gives them. CTAs past the last tile exit.
// - keys: a key block of 128 keys is loaded as 64-row chunks by TMA from a tensor map over kv_pages viewed as
//   [1, P * page_size, 2 Hkv, D]: chunk key k lives at row block_tables[s][k / page_size] * page_size +
//   k % page_size (page_size a multiple of 64: a chunk never crosses a page). The producer thread reads the
//   page ids from global memory one block ahead of its loads. A chunk wholly past context_lens[s] is loaded
//   from row P * page_size, out of the map's bounds: TMA fills it with zeros (no other sequence's page is
//   read). Ids are clamped into [0, P). The last chunk of a context may end inside a page: its rows past the
//   context are the page's storage (anything, NaN included), masked out of the scores by the causal bound and
//   zeroed in the value tile before P V (consume_key_blocks' ClearValueTail).
// The output: masked 16-byte stores from the staged tile in shared memory, rows past the sequence's end not
// written. A TMA store would clip at the map's bounds only, i.e. at T, and overwrite the next sequence's
// first rows; a map per sequence would have to be built on the device (tensormap.replace) per tile: the
// masked copy of 2 x 16 KB per CTA costs less than that and keeps the host side one map per operand.
#include "flash_attention/forward_pipeline.cuh"
#include "flash_attention/launch.cuh"

namespace ejk {

constexpr int kPagedBlockKeys = 128;  // keys per block (the dense forward's BN)
constexpr int kPagedChunk = 64;       // rows per TMA box of kv_pages (page_size is a multiple)

struct PagedParams {
  CUtensorMap q_map;   // queries as [1, T, Hq, D], boxes of 128 rows
  CUtensorMap kv_map;  // kv_pages as [1, P * page_size, 2 Hkv, D], boxes of 64 rows
  void* out;           // [T, Hq, D]
  const int* context_lens;     // [max_num_seqs]
  const int* block_tables;     // [max_num_seqs, pages_per_seq]
  const int* query_start_loc;  // [max_num_seqs + 1]
  const int* num_seqs;         // [1]
  int total_tokens, q_heads, kv_heads, page_size, num_pages, pages_per_seq, max_num_seqs;
  float softmax_scale;
};

// The CTA's work: rows [row_begin, row_end) of a sequence whose queries start at packed row q_start (seq < 0:
// the padding rows past the last sequence, no keys).
struct PagedTile {
  int seq, q_start, q_len, kv_len, row_begin;
};

// Tile `index` of the launch (all 32 lanes of a warp call it; every lane gets the answer): seq = -2 past the end.
__device__ __forceinline__ PagedTile find_paged_tile(const PagedParams& params, int index) {
  const int lane = threadIdx.x % 32;
  const int count = min(max(*params.num_seqs, 0), params.max_num_seqs);
  const int* starts = params.query_start_loc;
  int before = 0;  // tiles of the sequences already scanned
  for (int first = 0; first < count; first += 32) {
    const int s = first + lane;
    const int begin = s < count ? starts[s] : 0, end = s < count ? starts[s + 1] : 0;
    const int tiles = max(end - begin, 0) / kForwardRows + ((max(end - begin, 0) % kForwardRows) != 0);
    int inclusive = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(0xffffffff, inclusive, d);
      if (lane >= d) inclusive += other;
    }
    const bool mine = before + inclusive - tiles <= index && index < before + inclusive;
    const unsigned owners = __ballot_sync(0xffffffff, mine);
    if (owners) {
      const int owner = __ffs(owners) - 1;
      const int local = index - before - __shfl_sync(0xffffffff, inclusive - tiles, owner);
      const int owner_tiles = __shfl_sync(0xffffffff, tiles, owner);
      const int seq = first + owner;
      const int q_start = __shfl_sync(0xffffffff, begin, owner), q_end = __shfl_sync(0xffffffff, end, owner);
      // the sequence's last (heaviest, causal) tile first
      return {seq, q_start, q_end - q_start, params.context_lens[seq], (owner_tiles - 1 - local) * kForwardRows};
    }
    before += __shfl_sync(0xffffffff, inclusive, 31);
  }
  const int tail_start = count > 0 ? starts[count] : 0;
  const int tail = max(params.total_tokens - tail_start, 0);
  const int local = index - before;
  if (local * kForwardRows < tail) return {-1, tail_start, tail, 0, local * kForwardRows};
  return {-2, 0, 0, 0, 0};
}

template <class T, int D>
__global__ void __launch_bounds__(kForwardThreads, 1) paged_forward_kernel(const __grid_constant__ PagedParams params) {
  constexpr int BN = kPagedBlockKeys;
  using Shared = ForwardShared<T, D, BN>;
  Shared& shared = aligned_shared<Shared>();
  __shared__ PagedTile found;
  const int head = blockIdx.y;
  const int warpgroup = warpgroup_index();
  const int t = threadIdx.x % 128;

  if (threadIdx.x < 32) {
    const PagedTile tile = find_paged_tile(params, blockIdx.x);
    if (threadIdx.x == 0) {
      found = tile;
      if (tile.seq != -2) init_forward_barriers(shared);
    }
  }
  __syncthreads();
  const PagedTile tile = found;
  if (tile.seq == -2) return;

  // the sequence as a causal Problem of one batch entry (rows and keys local to it)
  const int longest = tile.q_len + tile.kv_len + 1;
  const Problem problem{1, tile.q_len, tile.kv_len, params.q_heads, params.kv_heads, params.softmax_scale, 0.f, 1,
                        -1, -1, -longest, 0};
  const int row_begin = tile.row_begin;
  const int row_end = min(row_begin + kForwardRows, tile.q_len);
  const KeyBlocks blocks = tile.seq >= 0 ? key_blocks(problem, row_begin, row_end, BN) : KeyBlocks{0, 0};

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0 && blocks.last > blocks.first) {
      const int kv_head = head / (params.q_heads / params.kv_heads);
      const int* table = params.block_tables + static_cast<size_t>(tile.seq) * params.pages_per_seq;
      const int past_end = params.num_pages * params.page_size;  // a row out of the map: zeros
      // rows of kv_pages (as one [P * page_size] axis) of the block's 64-key chunks
      auto locate = [&](int key0) {
        int rows[BN / kPagedChunk];
#pragma unroll
        for (int c = 0; c < BN / kPagedChunk; ++c) {
          const int key = key0 + c * kPagedChunk;
          const int logical = key / params.page_size;
          const int page = key < tile.kv_len && logical < params.pages_per_seq
                               ? min(max(table[logical], 0), params.num_pages - 1)
                               : -1;
          rows[c] = page < 0 ? past_end : page * params.page_size + key % params.page_size;
        }
        struct Rows {
          int row[BN / kPagedChunk];
        } where;
#pragma unroll
        for (int c = 0; c < BN / kPagedChunk; ++c) where.row[c] = rows[c];
        return where;
      };
      produce_key_blocks<T, D, BN>(
          shared, blocks,
          [&](Barrier* bar, T* tile_q) {
            load_tile<D>(&params.q_map, bar, tile_q, kForwardRows, tile.q_start + row_begin, head, 0);
          },
          locate,
          [&](Barrier* bar, T* tile_kv, const auto& where, bool value) {
#pragma unroll
            for (int c = 0; c < BN / kPagedChunk; ++c) {
              // chunk c: rows [64 c, 64 c + 64) of each of the tile's D / 64 panels of BN rows
              load_tile<D>(&params.kv_map, bar, tile_kv + c * kPagedChunk * 64, BN, where.row[c],
                           2 * kv_head + (value ? 1 : 0), 0);
            }
          });
    }
    return;
  }

  // consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int group = warpgroup - 1;  // 0 or 1: rows [64 * group, 64 * group + 64) of the tile
  ConsumerRows<D> rows;
  const Extras none{nullptr, 0, nullptr, nullptr};
  consume_key_blocks<T, D, BN, false, Shared, true>(shared, problem, none, row_begin, row_end, blocks, head, 0, group, t, rows);

  // epilogue: normalize into the Q tile, then masked 16-byte copies of this warpgroup's 64 rows (rows past the
  // sequence's end stay untouched: they belong to the next sequence)
  stage_output<T, D>(shared.q, group, t, rows);
  named_sync(3 + group, 128);
  const char* staged = reinterpret_cast<const char*>(shared.q);
  constexpr int kChunksPerRow = D / 8;  // 16 bytes each
#pragma unroll
  for (int j = 0; j < 64 * kChunksPerRow / 128; ++j) {
    const int chunk = t + 128 * j;
    const int row = 64 * group + chunk / kChunksPerRow;  // within the tile
    const int col = (chunk % kChunksPerRow) * 8;
    const int local = row_begin + row;
    if (local < tile.q_len) {
      const uint4 value = *reinterpret_cast<const uint4*>(staged + (col / 64) * kForwardRows * 128 +
                                                          swizzled_offset(row, col % 64));
      T* out = static_cast<T*>(params.out) +
               (static_cast<size_t>(tile.q_start + local) * params.q_heads + head) * D + col;
      *reinterpret_cast<uint4*>(out) = value;
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
  auto kernel = paged_forward_kernel<T, D>;
  const size_t shared_bytes = sizeof(ForwardShared<T, D, kPagedBlockKeys>) + 1024;
  if ((error = allow_shared_memory(kernel, shared_bytes)) != cudaSuccess) return error;
  const int tiles = (params.total_tokens + kForwardRows - 1) / kForwardRows + params.max_num_seqs + 1;
  const dim3 grid(tiles, params.q_heads);
  kernel<<<grid, kForwardThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

namespace {

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("ejkernel paged flash attention: " + what);
}

ffi::Error paged_forward_handler(cudaStream_t stream, ffi::AnyBuffer queries, ffi::AnyBuffer kv_pages,
                                 ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                                 float softmax_scale, ffi::Result<ffi::AnyBuffer> out) {
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
  if (kd[0] * kd[1] >= (int64_t{1} << 31) || qd[0] >= (int64_t{1} << 31) - 128 * (sd[0] + 2)) {
    return invalid("kv_pages or queries too large for 32-bit row coordinates");
  }
  if (qd[0] == 0) return ffi::Error::Success();
  PagedParams params;
  params.out = out->untyped_data();
  params.context_lens = context_lens.typed_data();
  params.block_tables = block_tables.typed_data();
  params.query_start_loc = query_start_loc.typed_data();
  params.num_seqs = num_seqs.typed_data();
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
                                  .Ret<xla::ffi::AnyBuffer>());                  // out
