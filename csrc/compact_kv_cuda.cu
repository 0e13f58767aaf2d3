// CUDA kernel of specdec::compact_kv_ (schema and CPU kernel in ops.cpp).
//
// Memory traffic: for every (cache, row b) whose rows move, the kernel reads and writes
// count[b] * H * D * elem bytes, plus 16 bytes of indices per row per block.  That is the
// floor for an in-place move: every moved element is read once and written once.
//
// Launches: one launch per group of up to kMaxCachesPerLaunch (64) caches, so a model with
// up to 32 layers (keys + values) is compacted in one launch.  The caches' pointers and
// strides travel by value in the kernel's parameter block (64 x 48 B = 3 KiB, under the
// 4 KiB limit), so no host-to-device copy and no host sync is needed.
//
// Grid: blockIdx.y = cache within the group, blockIdx.x = row b.  Each thread owns whole
// columns (one head h, one vector of D) and walks j upwards, so memmove semantics hold
// without any barrier: a thread reads row src_start + j before it writes row dst + j, and no
// other thread touches that column.  Up to kUnroll rows are loaded before they are stored;
// this stays correct because every row loaded in a batch sits at or above src_start + j0,
// above everything written so far (dst + j0 - 1 < src_start + j0).
//
// Index values are never read on the host (that would sync).  Out-of-range values are
// handled in the kernel instead: a row with dst_start[b] < 0 or dst_start[b] > src_start
// is skipped (left unchanged), count[b] is clamped to [0, T - src_start] per cache.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "compact_kv.h"

namespace specdec {
namespace {

constexpr int kMaxCachesPerLaunch = 64;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// One cache, with every stride in bytes.
struct CacheView {
  char* base;        // &c[0, 0, 0, 0]
  int64_t stride_b;  // bytes between rows b
  int64_t stride_h;  // bytes between heads h
  int64_t stride_t;  // bytes between positions t
  int64_t T;         // c.size(2)
  int32_t H;          // c.size(1)
  int32_t row_bytes;  // D * elem: bytes per (b, h, t) row
};

struct CacheGroup {
  CacheView views[kMaxCachesPerLaunch];
};

static_assert(sizeof(CacheView) == 48, "CacheView layout changed: recheck the 4 KiB param limit");
static_assert(
    sizeof(CacheGroup) + 3 * sizeof(int64_t) <= 4096,
    "kernel parameters must fit the 4 KiB CUDA parameter block");

template <typename Vec>
__global__ void compact_kv_kernel(
    const CacheGroup group,
    const int64_t* __restrict__ dst_start,  // [B] int64
    const int64_t* __restrict__ count,      // [B] int64
    const int64_t src_start) {
  const CacheView& v = group.views[blockIdx.y];
  const int64_t b = blockIdx.x;
  const int64_t dst = dst_start[b];
  // dst == src_start is a no-op; dst outside [0, src_start] is invalid and skipped.
  if (dst < 0 || dst >= src_start) {
    return;
  }
  const int64_t requested = count[b];
  const int64_t room = v.T - src_start;  // >= 0, checked on the host
  const int64_t n = requested < room ? requested : room;  // clamp to the cache's end
  if (n <= 0) {
    return;
  }
  const int64_t row_vecs = v.row_bytes / static_cast<int64_t>(sizeof(Vec));  // exact: aligned
  char* const row = v.base + b * v.stride_b;
  const int64_t columns = static_cast<int64_t>(v.H) * row_vecs;
  for (int64_t col = threadIdx.x; col < columns; col += blockDim.x) {
    const int64_t h = col / row_vecs;
    const int64_t e = col - h * row_vecs;
    // The source and destination alias, so no __restrict__ here.
    char* const column = row + h * v.stride_h + e * static_cast<int64_t>(sizeof(Vec));
    for (int64_t j0 = 0; j0 < n; j0 += kUnroll) {
      Vec buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j0 + u < n) {
          buf[u] = *reinterpret_cast<const Vec*>(column + (src_start + j0 + u) * v.stride_t);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j0 + u < n) {
          *reinterpret_cast<Vec*>(column + (dst + j0 + u) * v.stride_t) = buf[u];
        }
      }
    }
  }
}

// The widest power-of-two access (<= 16 bytes) that divides every address the group touches.
int64_t group_alignment(const CacheGroup& g, int n) {
  int64_t align = 16;
  for (int i = 0; i < n; ++i) {
    const CacheView& v = g.views[i];
    for (const int64_t x :
         {static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.base)), v.stride_b, v.stride_h,
          v.stride_t, static_cast<int64_t>(v.row_bytes)}) {
      while (align > 1 && (x % align) != 0) {
        align /= 2;
      }
    }
  }
  return align;
}

template <typename Vec>
void launch_group(
    const CacheGroup& group,
    int n,
    int64_t B,
    const int64_t* dst_start,
    const int64_t* count,
    int64_t src_start,
    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(B), static_cast<unsigned int>(n));
  compact_kv_kernel<Vec><<<grid, kThreads, 0, stream>>>(group, dst_start, count, src_start);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void compact_kv_cuda(
    at::TensorList caches,        // L x [B, H, T, D] floating, stride(3) == 1
    int64_t src_start,            // in [0, T]
    const at::Tensor& dst_start,  // [B] int64, values checked in-kernel
    const at::Tensor& count) {    // [B] int64, values clamped in-kernel
  check_compact_kv_meta(caches, src_start, dst_start, count);
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

  const int64_t L = static_cast<int64_t>(caches.size());
  for (int64_t first = 0; first < L; first += kMaxCachesPerLaunch) {
    const int n = static_cast<int>(std::min<int64_t>(kMaxCachesPerLaunch, L - first));
    CacheGroup group{};
    int used = 0;
    for (int i = 0; i < n; ++i) {
      const at::Tensor& c = caches[first + i];
      const int64_t elem = c.element_size();
      const int64_t row_bytes = c.size(3) * elem;
      if (c.numel() == 0) {
        continue;  // nothing to move (H, T or D is 0)
      }
      TORCH_CHECK(
          c.size(1) <= 0x7fffffff && row_bytes <= 0x7fffffff,
          "compact_kv_: caches[", first + i, "] must have H and D * element_size < 2^31 on CUDA, "
          "got shape ", c.sizes());
      CacheView& v = group.views[used++];
      v.base = static_cast<char*>(c.mutable_data_ptr());
      v.stride_b = c.stride(0) * elem;
      v.stride_h = c.stride(1) * elem;
      v.stride_t = c.stride(2) * elem;
      v.T = c.size(2);
      v.H = static_cast<int32_t>(c.size(1));
      v.row_bytes = static_cast<int32_t>(row_bytes);
    }
    if (used == 0) {
      continue;
    }
    switch (group_alignment(group, used)) {
      case 16:
        launch_group<uint4>(group, used, B, dst, cnt, src_start, stream);
        break;
      case 8:
        launch_group<uint2>(group, used, B, dst, cnt, src_start, stream);
        break;
      case 4:
        launch_group<uint32_t>(group, used, B, dst, cnt, src_start, stream);
        break;
      case 2:
        launch_group<uint16_t>(group, used, B, dst, cnt, src_start, stream);
        break;
      default:
        launch_group<uint8_t>(group, used, B, dst, cnt, src_start, stream);
        break;
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("compact_kv_", &compact_kv_cuda);
}

}  // namespace specdec
