// CUDA implementation of specdec::compact_kv_ (schema and CPU kernel in ops.cpp).
//
// The kernel's body, the launch plan (groups of caches, access width) and the reasoning
// about memory traffic and aliasing are in compact_kv_kernel.cuh, which the test suite also
// compiles for the host and runs thread by thread against the CPU op.  This file holds what
// only a GPU build has: the __global__ entry point, the device guard, the stream and the
// launches.  No tensor value is read on the host (that would synchronise).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "compact_kv.h"
#include "compact_kv_kernel.cuh"

namespace specdec {
namespace {

using compact_kv_detail::CacheGroup;
using compact_kv_detail::kThreads;

template <typename Vec>
__global__ void compact_kv_kernel(
    const CacheGroup group,
    const int64_t* __restrict__ dst_start,  // [B] int64
    const int64_t* __restrict__ count,      // [B] int64
    const int64_t src_start) {
  compact_kv_detail::compact_kv_thread<Vec>(
      group, dst_start, count, src_start, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x);
}

void compact_kv_cuda(
    at::TensorList caches,        // L x [B, H, T, D] floating, stride(3) == 1
    int64_t src_start,            // in [0, T]
    const at::Tensor& dst_start,  // [B] int64, values checked in-kernel
    const at::Tensor& count) {    // [B] int64, values clamped in-kernel
  check_compact_kv_meta(caches, src_start, dst_start, count);
  bump_versions(caches);  // (a refusal below leaves the data unchanged)
  const int64_t B = dst_start.size(0);
  TORCH_CHECK(
      B <= 0x7fffffff, "compact_kv_: B = dst_start.size(0) must be < 2^31 on CUDA, got ", B);
  if (B == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(dst_start.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dst_c = dst_start.contiguous();  // [B] int64 (a no-op unless strided)
  const at::Tensor cnt_c = count.contiguous();      // [B] int64
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();

  compact_kv_detail::for_each_compact_kv_launch(
      caches, [&](auto vec, const CacheGroup& group, int used) {
        using Vec = typename decltype(vec)::type;
        const dim3 grid(static_cast<unsigned int>(B), static_cast<unsigned int>(used));
        compact_kv_kernel<Vec><<<grid, kThreads, 0, stream>>>(group, dst, cnt, src_start);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("compact_kv_", &compact_kv_cuda);
}

}  // namespace specdec
