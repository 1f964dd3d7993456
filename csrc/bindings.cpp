// torch binding of the CUDA kernels (hybridcomm_kernels.cu), loaded by
// hybridcomm/gpu/cuda_ext.py. Same arguments and checks as the Python launchers in
// kernels/; every launch goes on the current CUDA stream of the tensors'
// device, so under `with torch.cuda.stream(comm)` it runs on the comm stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "hybridcomm_kernels.h"

namespace {

hc_dtype to_hc(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return HC_FLOAT32;
    case at::kHalf: return HC_FLOAT16;
    case at::kBFloat16: return HC_BFLOAT16;
    default: TORCH_CHECK(false, name, " has dtype ", t.scalar_type(),
                         "; supported dtypes are float32, float16, bfloat16");
  }
}

void check(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), ", expected ", ref.device());
  to_hc(t, name);
}

void ok(int err, const char* what) {
  TORCH_CHECK(err == 0, "hybridcomm ", what, ": ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

char* byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

at::Tensor reduce(at::Tensor dst, const at::Tensor& src, std::optional<double> scale,
                  const std::optional<at::Tensor>& out) {
  check(dst, dst, "dst");
  check(src, dst, "src");
  TORCH_CHECK(src.numel() == dst.numel(), "src has ", src.numel(), " elements but dst has ",
              dst.numel());
  if (out) {
    check(*out, dst, "out");
    TORCH_CHECK(out->numel() == dst.numel(), "out has ", out->numel(),
                " elements but dst has ", dst.numel());
  }
  const c10::cuda::CUDAGuard guard(dst.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  ok(hc_reduce(dst.data_ptr(), to_hc(dst, "dst"), src.data_ptr(), to_hc(src, "src"),
               out ? out->data_ptr() : nullptr, out ? to_hc(*out, "out") : to_hc(dst, "dst"),
               dst.numel(), static_cast<float>(scale.value_or(1.0)), scale.has_value(), stream),
     "reduce");
  return dst;
}

// Every tensor checked against ``ref`` (device, dtype, layout); their element count.
int64_t checked_total(const std::vector<at::Tensor>& tensors, const at::Tensor& ref) {
  int64_t total = 0;
  for (const auto& t : tensors) {
    check(t, ref, "tensors[i]");
    total += t.numel();
  }
  return total;
}

at::Tensor pack(const std::vector<at::Tensor>& tensors, at::Tensor out,
                std::optional<double> scale) {
  check(out, out, "out");
  const int64_t total = checked_total(tensors, out);
  TORCH_CHECK(out.numel() == total, "out has ", out.numel(), " elements but the tensors hold ",
              total);
  const c10::cuda::CUDAGuard guard(out.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  int64_t offset = 0;
  for (const auto& t : tensors) {
    ok(hc_copy_scaled(byte_ptr(out) + offset * out.element_size(), to_hc(out, "out"),
                      t.data_ptr(), to_hc(t, "tensors[i]"), t.numel(),
                      static_cast<float>(scale.value_or(1.0)), scale.has_value(), stream),
       "pack");
    offset += t.numel();
  }
  return out;
}

std::vector<at::Tensor> unpack(const at::Tensor& flat, std::vector<at::Tensor> tensors,
                               std::optional<double> scale) {
  check(flat, flat, "flat");
  const int64_t total = checked_total(tensors, flat);
  TORCH_CHECK(flat.numel() == total, "flat has ", flat.numel(),
              " elements but the tensors hold ", total);
  const c10::cuda::CUDAGuard guard(flat.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  int64_t offset = 0;
  for (auto& t : tensors) {
    ok(hc_copy_scaled(t.data_ptr(), to_hc(t, "tensors[i]"),
                      byte_ptr(flat) + offset * flat.element_size(), to_hc(flat, "flat"),
                      t.numel(), static_cast<float>(scale.value_or(1.0)), scale.has_value(),
                      stream),
       "unpack");
    offset += t.numel();
  }
  return tensors;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybridcomm CUDA C++ pack/unpack/reduce (the Triton kernels' fallback and baseline)";
  m.def("reduce", &reduce, "dst = (dst + src) * scale in fp32; optional copy-out", py::arg("dst"),
        py::arg("src"), py::arg("scale") = py::none(), py::arg("out") = py::none());
  m.def("pack", &pack, "tensors -> out (flat), scaled and cast", py::arg("tensors"),
        py::arg("out"), py::arg("scale") = py::none());
  m.def("unpack", &unpack, "flat -> tensors, scaled and cast", py::arg("flat"),
        py::arg("tensors"), py::arg("scale") = py::none());
}
