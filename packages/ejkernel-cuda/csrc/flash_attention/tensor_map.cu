// Host side of the TMA descriptors. cuTensorMapEncodeTiled is a driver function: it is reached through the
// runtime's entry-point query so the library links only the static CUDA runtime (no -lcuda).
#include "flash_attention/common.cuh"

namespace ejk {

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_function() {
  static EncodeTiled function = [] {
    void* found = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &found, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(found);
  }();
  return function;
}

}  // namespace

cudaError_t encode_tile_map(CUtensorMap* map, CUtensorMapDataType type, const void* data, int batch, int len,
                            int heads, int dim, int rows) {
  EncodeTiled encode = encode_function();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t sizes[4] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(len), cuuint64_t(batch)};
  const cuuint64_t element = 2;
  const cuuint64_t strides[3] = {dim * element, heads * dim * element, cuuint64_t(len) * heads * dim * element};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  CUresult result = encode(map, type, 4, const_cast<void*>(data), sizes, strides, box, unit,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace ejk
