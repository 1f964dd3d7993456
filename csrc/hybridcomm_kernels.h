// hybridcomm CUDA kernels: pack / unpack / reduce, behind a thin C API.
//
// The same semantics as kernels/{pack,unpack,reduce}.py (the Triton kernels):
// all math in fp32, one rounding to the destination dtype (round to nearest
// even). These are a fallback where Triton is missing and a baseline to hold
// the Triton kernels against on GPU.
//
// No torch here: this header and hybridcomm_kernels.cu compile with nvcc
// alone (the compile-only test does that); bindings.cpp wraps them for torch.
// Pointers are device pointers; `stream` is a cudaStream_t (void* so this
// header needs no CUDA include). Every call returns a cudaError_t (0: ok).
#ifndef HYBRIDCOMM_KERNELS_H_
#define HYBRIDCOMM_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  HC_FLOAT32 = 0,
  HC_FLOAT16 = 1,
  HC_BFLOAT16 = 2,
} hc_dtype;

// dst[i] = src[i] * scale (scale only if has_scale), cast to dst's dtype.
// pack is one call per tensor into out + offset; unpack one per tensor from
// flat + offset (the caller does the pointer arithmetic).
int hc_copy_scaled(void* dst, hc_dtype dst_dtype, const void* src, hc_dtype src_dtype,
                   int64_t numel, float scale, int has_scale, void* stream);

// r = (dst[i] + src[i]) * scale in fp32; dst[i] = r; out[i] = r if out != NULL.
int hc_reduce(void* dst, hc_dtype dst_dtype, const void* src, hc_dtype src_dtype, void* out,
              hc_dtype out_dtype, int64_t numel, float scale, int has_scale, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // HYBRIDCOMM_KERNELS_H_
