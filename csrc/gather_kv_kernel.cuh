// The CUDA kernel of specdec::gather_kv_, written once for two compilers.
//
// gather_kv_cuda.cu compiles it with nvcc and launches it; the test suite compiles the same
// text with the host compiler (python_tests/ops/cuda_emulation/gather_kv_emulated.cpp) and runs
// every thread of every block serially on the CPU, as it does for compact_kv_'s kernel.  The
// launch plan (groups of up to 64 caches travelling by value in the parameter block, the
// widest access every address allows) and the access types are compact_kv_'s
// (compact_kv_kernel.cuh); this file holds what one thread of gather_kv_ does.
//
// Memory traffic: for every (cache, row b), the kernel reads and writes moved[b] * H * D * elem
// bytes, where moved[b] counts the j < count[b] with src_index[b, j] != dst_start[b] + j (a
// column already in place is skipped), plus 16 + count[b] * 8 bytes of indices per thread,
// the same addresses for every thread of a block (served by L1/L2 after the first).  That is
// the floor for an in-place move: every moved element is read once and written once.
//
// Grid: blockIdx.y = cache within the group, blockIdx.x = row b.  Each thread owns whole
// columns (one head h, one vector of D) and walks j upwards.  The used indices are strictly
// increasing with src_index[b, 0] >= dst_start[b], so src_index[b, j] >= dst_start[b] + j: a
// thread reads column src_index[b, j] before any write reaches it (its writes so far are at
// dst_start[b] .. dst_start[b] + j - 1), and no other thread touches that column, so no
// barrier and no temporary are needed.  Up to kUnroll columns are loaded before they are
// stored; that stays correct because every column loaded in a batch sits at or above
// dst_start[b] + j0, above everything written so far.
//
// Index values are never read on the host (that would sync).  Each thread checks row b's
// values before it moves anything (the same values for every thread, so a row is moved by all
// of its threads or by none): a row that breaks any rule the CPU op checks (count[b] in
// [0, M], dst_start[b] >= 0, dst_start[b] + count[b] <= T, every used index in [0, T), strictly
// increasing, the first >= dst_start[b]) is left unchanged.
#pragma once

#include <cstdint>
#include <utility>

#include "compact_kv_kernel.cuh"

namespace specdec {
namespace gather_kv_detail {

using compact_kv_detail::CacheGroup;
using compact_kv_detail::CacheView;
using compact_kv_detail::kThreads;
using compact_kv_detail::kUnroll;

static_assert(
    sizeof(CacheGroup) + 3 * sizeof(const int64_t*) + sizeof(int64_t) <= 4096,
    "kernel parameters must fit the 4 KiB CUDA parameter block");

// Whether row b's values obey every rule gather_kv_'s CPU op checks (T: the caches' length,
// one for all of them).
SPECDEC_HOST_DEVICE inline bool gather_row_is_valid(
    const int64_t* __restrict__ src,  // [M] int64: src_index[b]
    const int64_t n,                  // count[b]
    const int64_t dst,                // dst_start[b]
    const int64_t M,
    const int64_t T) {
  if (n < 0 || n > M || dst < 0 || dst > T - n) {
    return false;
  }
  int64_t prev = dst - 1;  // src_index[b, 0] >= dst, then strictly increasing
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = src[j];
    if (s <= prev || s >= T) {
      return false;
    }
    prev = s;
  }
  return true;
}

// What thread `thread` of block (block_x, block_y) of a launch with `block_dim` threads per
// block does (the kernel passes blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x).
template <typename Vec>
SPECDEC_HOST_DEVICE inline void gather_kv_thread(
    const CacheGroup& group,
    const int64_t* __restrict__ src_index,  // [B, M] int64, row-major
    const int64_t* __restrict__ count,      // [B] int64
    const int64_t* __restrict__ dst_start,  // [B] int64
    const int64_t M,
    const int64_t block_x,
    const int64_t block_y,
    const int64_t thread,
    const int64_t block_dim) {
  const CacheView& v = group.views[block_y];
  const int64_t row_vecs = v.row_bytes / static_cast<int64_t>(sizeof(Vec));  // exact: aligned
  const int64_t columns = static_cast<int64_t>(v.H) * row_vecs;
  if (thread >= columns) {
    return;  // no column of this row is this thread's
  }
  const int64_t b = block_x;
  const int64_t* const src = src_index + b * M;  // [M]
  const int64_t n = count[b];
  const int64_t dst = dst_start[b];
  if (!gather_row_is_valid(src, n, dst, M, v.T)) {
    return;
  }
  char* const row = v.base + b * v.stride_b;
  for (int64_t col = thread; col < columns; col += block_dim) {
    const int64_t h = col / row_vecs;
    const int64_t e = col - h * row_vecs;
    // The source and destination alias, so no __restrict__ here.
    char* const column = row + h * v.stride_h + e * static_cast<int64_t>(sizeof(Vec));
    for (int64_t j0 = 0; j0 < n; j0 += kUnroll) {
      Vec buf[kUnroll];
      bool moves[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + u;
        moves[u] = j < n && src[j] != dst + j;  // a column already in place is skipped
        if (moves[u]) {
          buf[u] = *reinterpret_cast<const Vec*>(column + src[j] * v.stride_t);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (moves[u]) {
          *reinterpret_cast<Vec*>(column + (dst + j0 + u) * v.stride_t) = buf[u];
        }
      }
    }
  }
}

// gather_kv_'s launches (check_gather_kv_meta has passed): compact_kv_'s plan.
template <typename Launch>
void for_each_gather_kv_launch(at::TensorList caches, Launch&& launch) {
  compact_kv_detail::for_each_kv_launch("gather_kv_", caches, std::forward<Launch>(launch));
}

}  // namespace gather_kv_detail
}  // namespace specdec
