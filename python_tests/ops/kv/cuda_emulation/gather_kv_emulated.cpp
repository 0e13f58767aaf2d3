// The CUDA kernel of gather_kv_ (csrc/gather_kv_kernel.cuh), compiled for the host and run on
// CPU tensors: every launch gather_kv_cuda makes, every block of its grid and every thread of
// each block, one after another.  As for compact_kv_'s kernel (compact_kv_emulated.cpp), the
// threads share no memory and never wait on each other (each owns whole columns), so any
// serial order must give what a GPU gives; the test runs them forwards and backwards, and with
// fewer threads a block than the GPU's 256.  What this cannot check: the launch itself
// (<<<>>>, the stream, the parameter block) and the device's memory model.
//
// Built by python_tests/ops/test_gather_kv.py with torch.utils.cpp_extension.load (host compiler
// only).  Not part of the package.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "gather_kv_kernel.cuh"

namespace {

using specdec::gather_kv_detail::CacheGroup;
using specdec::gather_kv_detail::for_each_gather_kv_launch;
using specdec::gather_kv_detail::gather_kv_thread;

// gather_kv_cuda's host code after check_gather_kv_meta (which the CPU op shares), with each
// launch run serially.  Returns, per launch, [access bytes, caches in the group].
std::vector<std::vector<int64_t>> gather_kv_emulated(
    std::vector<at::Tensor> caches,
    const at::Tensor& src_index,
    const at::Tensor& count,
    const at::Tensor& dst_start,
    int64_t block_dim,
    bool reverse) {
  TORCH_CHECK(block_dim >= 1, "block_dim must be >= 1, got ", block_dim);
  const int64_t B = src_index.size(0);
  const int64_t M = src_index.size(1);
  std::vector<std::vector<int64_t>> launches;
  if (B == 0 || M == 0) {
    return launches;
  }
  const at::Tensor src_c = src_index.contiguous();
  const at::Tensor cnt_c = count.contiguous();
  const at::Tensor dst_c = dst_start.contiguous();
  const int64_t* src = src_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  for_each_gather_kv_launch(caches, [&](auto vec, const CacheGroup& group, int used) {
    using Vec = typename decltype(vec)::type;
    launches.push_back({static_cast<int64_t>(sizeof(Vec)), used});
    for (int64_t i = 0; i < int64_t{used} * B; ++i) {
      const int64_t block = reverse ? int64_t{used} * B - 1 - i : i;
      const int64_t y = block / B;
      const int64_t x = block % B;
      for (int64_t k = 0; k < block_dim; ++k) {
        const int64_t t = reverse ? block_dim - 1 - k : k;
        gather_kv_thread<Vec>(group, src, cnt, dst, M, x, y, t, block_dim);
      }
    }
  });
  return launches;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_kv_emulated", &gather_kv_emulated,
        "gather_kv_'s CUDA kernel run serially on CPU tensors; returns [access bytes, caches] per launch");
}
