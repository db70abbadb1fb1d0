// What the FFI handlers share: reading the call's shapes and attributes into a Problem (refusing what the
// kernels do not take with an InvalidArgument error; the Python side refuses it earlier, this is the
// guard for direct callers) and dispatching on dtype and head dim.
#pragma once

#include <string>

#include "flash_attention/common.cuh"
#include <type_traits>
#include <utility>

// XLA's FFI headers trip two of nvcc's diagnostics (missing returns after exhaustive switches, always_inline
// on non-inline functions): not ours to fix.
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#include "xla/ffi/api/ffi.h"
#pragma nv_diag_default 940
#pragma nv_diag_default 2473

namespace ejk {

namespace ffi = xla::ffi;

inline std::string shape_text(const ffi::AnyBuffer& buffer) {
  std::string text = "[";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// Problem of q [B, Sq, Hq, D], k and v [B, Sk, Hk, D]; an error names the operand that does not fit.
inline ffi::Error read_problem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               float softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                               float softcap, Problem* problem) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || v.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("ejkernel flash attention: q, k, v must be [batch, len, heads, dim]; got " +
                                       shape_text(q) + ", " + shape_text(k) + ", " + shape_text(v));
  }
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      (q.element_type() != ffi::DataType::BF16 && q.element_type() != ffi::DataType::F16)) {
    return ffi::Error::InvalidArgument("ejkernel flash attention: q, k, v must all be bfloat16 or all float16");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) {
      return ffi::Error::InvalidArgument("ejkernel flash attention: k " + shape_text(k) + " and v " + shape_text(v) +
                                         " differ");
    }
  }
  if (kd[0] != qd[0] || kd[3] != qd[3] || (qd[3] != 64 && qd[3] != 128) || kd[2] == 0 || qd[2] % kd[2] != 0 ||
      qd[1] == 0 || kd[1] == 0) {
    return ffi::Error::InvalidArgument("ejkernel flash attention: q " + shape_text(q) + " and k " + shape_text(k) +
                                       " need equal batch and head dim (64 or 128), kv heads dividing q heads, "
                                       "nonzero lengths");
  }
  const int64_t longest = qd[1] + kd[1];
  auto clamp = [longest](int64_t side) { return side < 0 ? -1 : static_cast<int>(side < longest ? side : longest); };
  const int left = clamp(window_left), right = clamp(window_right), unbounded = static_cast<int>(longest);
  int hi_distance = right >= 0 ? right : unbounded;
  if (causal) hi_distance = std::min(hi_distance, 0);
  *problem = Problem{static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(kd[1]),
                     static_cast<int>(qd[2]), static_cast<int>(kd[2]), softmax_scale, softcap, causal ? 1 : 0,
                     left, right, left >= 0 ? -left : -unbounded, hi_distance};
  return ffi::Error::Success();
}

// Extras of the optional buffers: sinks [B, Hq, n] float32 (n = 0: none), segment ids [B, Sq] and [B, Sk]
// int32 (both [B, 0]: none).
inline ffi::Error read_extras(const Problem& problem, const ffi::Buffer<ffi::F32>& sinks,
                              const ffi::Buffer<ffi::S32>& q_segments, const ffi::Buffer<ffi::S32>& kv_segments,
                              Extras* extras) {
  auto sd = sinks.dimensions(), qs = q_segments.dimensions(), ks = kv_segments.dimensions();
  if (sd.size() != 3 || sd[0] != problem.batch || sd[1] != problem.q_heads) {
    return ffi::Error::InvalidArgument("ejkernel flash attention: sinks must be float32 [batch, heads, n]");
  }
  const bool segmented = qs.size() == 2 && ks.size() == 2 && qs[0] == problem.batch && ks[0] == problem.batch &&
                         qs[1] == problem.q_len && ks[1] == problem.kv_len;
  const bool plain = qs.size() == 2 && ks.size() == 2 && qs[1] == 0 && ks[1] == 0;
  if (!segmented && !plain) {
    return ffi::Error::InvalidArgument("ejkernel flash attention: segment ids must be int32 [batch, q_len] and "
                                       "[batch, kv_len], or both [batch, 0]");
  }
  *extras = Extras{sinks.typed_data(), static_cast<int>(sd[2]), segmented ? q_segments.typed_data() : nullptr,
                   segmented ? kv_segments.typed_data() : nullptr};
  return ffi::Error::Success();
}

// The optional buffers of both handlers (after q, k, v and, in the backward, its own inputs).
template <class Binding>
auto extra_buffers(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // sinks
      .template Arg<ffi::Buffer<ffi::S32>>()   // q segment ids
      .template Arg<ffi::Buffer<ffi::S32>>();  // kv segment ids
}

inline ffi::Error cuda_error(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("ejkernel flash attention: ") + what + ": " + cudaGetErrorString(error));
}

template <class T> struct ElementTag {
  using type = T;
};
template <int D> using HeadDim = std::integral_constant<int, D>;

// Calls launch(ElementTag<T>{}, HeadDim<D>{}) for the call's element type and head dim.
template <class Launch>
ffi::Error dispatch(ffi::DataType type, int head_dim, Launch&& launch) {
  cudaError_t error;
  if (type == ffi::DataType::BF16) {
    error = head_dim == 64 ? launch(ElementTag<__nv_bfloat16>{}, HeadDim<64>{})
                           : launch(ElementTag<__nv_bfloat16>{}, HeadDim<128>{});
  } else {
    error = head_dim == 64 ? launch(ElementTag<__half>{}, HeadDim<64>{}) : launch(ElementTag<__half>{}, HeadDim<128>{});
  }
  return cuda_error(error, "kernel launch");
}

// The attributes of both handlers (after their buffers), as read_problem takes them.
template <class Binding>
auto problem_attributes(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("causal")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap");
}

// Raises a kernel's dynamic shared-memory limit (per device, hence at every launch: a host call of
// microseconds).
template <class Kernel>
cudaError_t allow_shared_memory(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace ejk
