// CUDA C++ pack / unpack / reduce (see hybridcomm_kernels.h for the contract).
//
// Grid-stride loops over int64 indices (buffers past 2^31 elements), 256
// threads a block, at most 65535 blocks: simple on purpose, the baseline the
// Triton kernels are measured against.
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "hybridcomm_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename T>
__device__ __forceinline__ float load_f32(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load_f32<float>(const float* p, int64_t i) { return p[i]; }
template <>
__device__ __forceinline__ float load_f32<__half>(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
template <>
__device__ __forceinline__ float load_f32<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

template <typename T>
__device__ __forceinline__ void store_f32(T* p, int64_t i, float v);
template <>
__device__ __forceinline__ void store_f32<float>(float* p, int64_t i, float v) { p[i] = v; }
template <>
__device__ __forceinline__ void store_f32<__half>(__half* p, int64_t i, float v) {
  p[i] = __float2half_rn(v);
}
template <>
__device__ __forceinline__ void store_f32<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

template <typename TD, typename TS>
__global__ void copy_scaled_kernel(TD* __restrict__ dst, const TS* __restrict__ src, int64_t n,
                                   float scale, bool has_scale) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float v = load_f32(src, i);
    if (has_scale) v *= scale;
    store_f32(dst, i, v);
  }
}

template <typename TD, typename TS, typename TO>
__global__ void reduce_kernel(TD* __restrict__ dst, const TS* __restrict__ src,
                              TO* __restrict__ out, int64_t n, float scale, bool has_scale) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    // fp32 accumulation: fp16/bf16 round once, after the add and the scale.
    float r = load_f32(dst, i) + load_f32(src, i);
    if (has_scale) r *= scale;
    store_f32(dst, i, r);
    if (out != nullptr) store_f32(out, i, r);
  }
}

inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? b : kMaxBlocks);
}

// Calls f with a typed null pointer for each dtype, so the templates above
// are instantiated for every combination from one switch per argument.
template <typename F>
int with_type(hc_dtype t, F&& f) {
  switch (t) {
    case HC_FLOAT32: return f(static_cast<float*>(nullptr));
    case HC_FLOAT16: return f(static_cast<__half*>(nullptr));
    case HC_BFLOAT16: return f(static_cast<__nv_bfloat16*>(nullptr));
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

extern "C" int hc_copy_scaled(void* dst, hc_dtype dst_dtype, const void* src, hc_dtype src_dtype,
                              int64_t numel, float scale, int has_scale, void* stream) {
  if (numel <= 0) return static_cast<int>(cudaSuccess);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return with_type(dst_dtype, [&](auto* d) {
    using TD = std::remove_pointer_t<decltype(d)>;
    return with_type(src_dtype, [&](auto* sp) {
      using TS = std::remove_pointer_t<decltype(sp)>;
      copy_scaled_kernel<TD, TS><<<blocks_for(numel), kThreads, 0, s>>>(
          static_cast<TD*>(dst), static_cast<const TS*>(src), numel, scale, has_scale != 0);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

extern "C" int hc_reduce(void* dst, hc_dtype dst_dtype, const void* src, hc_dtype src_dtype,
                         void* out, hc_dtype out_dtype, int64_t numel, float scale, int has_scale,
                         void* stream) {
  if (numel <= 0) return static_cast<int>(cudaSuccess);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (out == nullptr) out_dtype = dst_dtype;  // never written; one instantiation fewer
  return with_type(dst_dtype, [&](auto* d) {
    using TD = std::remove_pointer_t<decltype(d)>;
    return with_type(src_dtype, [&](auto* sp) {
      using TS = std::remove_pointer_t<decltype(sp)>;
      return with_type(out_dtype, [&](auto* o) {
        using TO = std::remove_pointer_t<decltype(o)>;
        reduce_kernel<TD, TS, TO><<<blocks_for(numel), kThreads, 0, s>>>(
            static_cast<TD*>(dst), static_cast<const TS*>(src), static_cast<TO*>(out), numel,
            scale, has_scale != 0);
        return static_cast<int>(cudaGetLastError());
      });
    });
  });
}
