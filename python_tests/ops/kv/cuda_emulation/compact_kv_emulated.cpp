// The CUDA kernel of compact_kv_ (csrc/compact_kv_kernel.cuh), compiled for the host and run
// on CPU tensors: every launch compact_kv_cuda makes, every block of its grid and every
// thread of each block, one after another.  The threads of the kernel share no memory and
// never wait on each other (each owns whole columns), so any serial order must give what a
// GPU gives; the test runs them forwards and backwards, and with fewer threads a block than
// the GPU's 256 so that a thread walks several columns.  What this cannot check: the launch
// itself (<<<>>>, the stream, the parameter block) and the device's memory model; those need
// a GPU (python_tests/ops/test_kv_cache.py's CUDA tests).
//
// Built by python_tests/ops/test_kv_cache.py with torch.utils.cpp_extension.load (host compiler
// only).  Not part of the package.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "compact_kv_kernel.cuh"

namespace {

using specdec::compact_kv_detail::CacheGroup;
using specdec::compact_kv_detail::compact_kv_thread;
using specdec::compact_kv_detail::for_each_compact_kv_launch;

// compact_kv_cuda's host code after check_compact_kv_meta (which the CPU op shares), with
// each launch run serially.  Returns, per launch, [access bytes, caches in the group].
std::vector<std::vector<int64_t>> compact_kv_emulated(
    std::vector<at::Tensor> caches,
    int64_t src_start,
    const at::Tensor& dst_start,
    const at::Tensor& count,
    int64_t block_dim,
    bool reverse) {
  TORCH_CHECK(block_dim >= 1, "block_dim must be >= 1, got ", block_dim);
  const int64_t B = dst_start.size(0);
  std::vector<std::vector<int64_t>> launches;
  if (B == 0) {
    return launches;
  }
  const at::Tensor dst_c = dst_start.contiguous();
  const at::Tensor cnt_c = count.contiguous();
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();
  for_each_compact_kv_launch(caches, [&](auto vec, const CacheGroup& group, int used) {
    using Vec = typename decltype(vec)::type;
    launches.push_back({static_cast<int64_t>(sizeof(Vec)), used});
    for (int64_t i = 0; i < int64_t{used} * B; ++i) {
      const int64_t block = reverse ? int64_t{used} * B - 1 - i : i;
      const int64_t y = block / B;
      const int64_t x = block % B;
      for (int64_t k = 0; k < block_dim; ++k) {
        const int64_t t = reverse ? block_dim - 1 - k : k;
        compact_kv_thread<Vec>(group, dst, cnt, src_start, x, y, t, block_dim);
      }
    }
  });
  return launches;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compact_kv_emulated", &compact_kv_emulated,
        "compact_kv_'s CUDA kernel run serially on CPU tensors; returns [access bytes, caches] per launch");
}
