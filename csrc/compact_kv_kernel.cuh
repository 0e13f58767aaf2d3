// The CUDA kernel of specdec::compact_kv_, written once for two compilers.
//
// compact_kv_cuda.cu compiles it with nvcc and launches it; the test suite compiles the same
// text with the host compiler (python_tests/ops/cuda_emulation/compact_kv_emulated.cpp) and runs
// every thread of every block serially on the CPU, so that the kernel's indexing, clamping,
// grouping and alignment choice are executed and compared with the CPU op on a machine
// without a GPU.  Everything here is either a function of one thread (compact_kv_thread) or
// host code that decides the launches (for_each_compact_kv_launch); only the launch itself
// (grid, stream, <<<>>>) lives in the .cu file.
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
// handled in the kernel instead: a row with dst_start[b] < 0 or dst_start[b] >= src_start
// is skipped (left unchanged; dst == src_start is a no-op anyway), count[b] is clamped to
// [0, T - src_start] per cache.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#ifdef __CUDACC__
#define SPECDEC_HOST_DEVICE __host__ __device__
#else
#define SPECDEC_HOST_DEVICE
#endif

namespace specdec {
namespace compact_kv_detail {

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

// The access type of each width: CUDA's vector types under nvcc, plain structs of the same
// size and alignment on the host.
template <int kBytes>
struct VecOf;
#ifdef __CUDACC__
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
#else
struct alignas(16) HostVec16 { uint32_t w[4]; };
struct alignas(8) HostVec8 { uint32_t w[2]; };
template <> struct VecOf<16> { using type = HostVec16; };
template <> struct VecOf<8> { using type = HostVec8; };
#endif
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<2> { using type = uint16_t; };
template <> struct VecOf<1> { using type = uint8_t; };

template <int kBytes>
struct VecTag {
  using type = typename VecOf<kBytes>::type;
  static_assert(sizeof(type) == kBytes && alignof(type) == kBytes, "vector type of the wrong size");
};

// What thread `thread` of block (block_x, block_y) of a launch with `block_dim` threads per
// block does (the kernel passes blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x).
template <typename Vec>
SPECDEC_HOST_DEVICE inline void compact_kv_thread(
    const CacheGroup& group,
    const int64_t* __restrict__ dst_start,  // [B] int64
    const int64_t* __restrict__ count,      // [B] int64
    const int64_t src_start,
    const int64_t block_x,
    const int64_t block_y,
    const int64_t thread,
    const int64_t block_dim) {
  const CacheView& v = group.views[block_y];
  const int64_t b = block_x;
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
  for (int64_t col = thread; col < columns; col += block_dim) {
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
inline int64_t group_alignment(const CacheGroup& g, int n) {
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

// The launches an op over these caches makes (compact_kv_, and gather_kv_ in
// gather_kv_kernel.cuh, which plans its launches the same way): calls
// launch(VecTag<bytes>{}, group, used) once per group of up to kMaxCachesPerLaunch caches
// that have elements, with the widest access their addresses allow.  The grid of each launch
// is (B, used) blocks.  The op's meta check has passed; no tensor data is read.  `op` names
// the op in the error messages.
template <typename Launch>
void for_each_kv_launch(const char* op, at::TensorList caches, Launch&& launch) {
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
          op, ": caches[", first + i, "] must have H and D * element_size < 2^31 on CUDA, "
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
        launch(VecTag<16>{}, group, used);
        break;
      case 8:
        launch(VecTag<8>{}, group, used);
        break;
      case 4:
        launch(VecTag<4>{}, group, used);
        break;
      case 2:
        launch(VecTag<2>{}, group, used);
        break;
      default:
        launch(VecTag<1>{}, group, used);
        break;
    }
  }
}

// compact_kv_'s launches (check_compact_kv_meta has passed).
template <typename Launch>
void for_each_compact_kv_launch(at::TensorList caches, Launch&& launch) {
  for_each_kv_launch("compact_kv_", caches, std::forward<Launch>(launch));
}

}  // namespace compact_kv_detail
}  // namespace specdec
