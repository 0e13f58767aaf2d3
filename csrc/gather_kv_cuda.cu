// CUDA implementation of specdec::gather_kv_ (schema and CPU kernel in ops.cpp).
//
// The kernel's body and the reasoning about memory traffic, ordering and index values are in
// gather_kv_kernel.cuh (the launch plan is compact_kv_'s, compact_kv_kernel.cuh), which the
// test suite also compiles for the host and runs thread by thread against the CPU op.  This
// file holds what only a GPU build has: the __global__ entry point, the device guard, the
// stream and the launches.  No tensor value is read on the host (that would synchronise).
//
// Memory traffic per (cache, row b): 2 * moved[b] * H * D * elem bytes (moved[b]: the used
// columns not already in place) plus the row's indices; see gather_kv_kernel.cuh.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "compact_kv.h"
#include "gather_kv.h"
#include "gather_kv_kernel.cuh"

namespace specdec {
namespace {

using gather_kv_detail::CacheGroup;
using gather_kv_detail::kThreads;

template <typename Vec>
__global__ void gather_kv_kernel(
    const CacheGroup group,
    const int64_t* __restrict__ src_index,  // [B, M] int64, row-major
    const int64_t* __restrict__ count,      // [B] int64
    const int64_t* __restrict__ dst_start,  // [B] int64
    const int64_t M) {
  gather_kv_detail::gather_kv_thread<Vec>(
      group, src_index, count, dst_start, M, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x);
}

void gather_kv_cuda(
    at::TensorList caches,        // L x [B, H, T, D] floating, stride(3) == 1, one T
    const at::Tensor& src_index,  // [B, M] int64, values checked in-kernel
    const at::Tensor& count,      // [B] int64, values checked in-kernel
    const at::Tensor& dst_start) {  // [B] int64, values checked in-kernel
  check_gather_kv_meta(caches, src_index, count, dst_start);
  bump_versions(caches);  // (a refusal below leaves the data unchanged)
  const int64_t B = src_index.size(0);
  TORCH_CHECK(
      B <= 0x7fffffff, "gather_kv_: B = src_index.size(0) must be < 2^31 on CUDA, got ", B);
  const int64_t M = src_index.size(1);
  if (B == 0 || M == 0) {
    return;  // (M == 0: every valid count is 0)
  }
  const c10::cuda::CUDAGuard guard(src_index.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor src_c = src_index.contiguous();  // [B, M] int64 (a no-op unless strided)
  const at::Tensor cnt_c = count.contiguous();      // [B] int64
  const at::Tensor dst_c = dst_start.contiguous();  // [B] int64
  const int64_t* src = src_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();

  gather_kv_detail::for_each_gather_kv_launch(
      caches, [&](auto vec, const CacheGroup& group, int used) {
        using Vec = typename decltype(vec)::type;
        const dim3 grid(static_cast<unsigned int>(B), static_cast<unsigned int>(used));
        gather_kv_kernel<Vec><<<grid, kThreads, 0, stream>>>(group, src, cnt, dst, M);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("gather_kv_", &gather_kv_cuda);
}

}  // namespace specdec
