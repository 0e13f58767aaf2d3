// Shared declarations of the specdec::gather_kv_ op (CPU in ops.cpp, CUDA in gather_kv_cuda.cu).
//
// gather_kv_(Tensor(a!)[] caches, Tensor src_index, Tensor count, Tensor dst_start) -> ()
//
// For every cache c ([B, H, T, D], sequence on dim 2) and every row b:
//   c[b, :, dst_start[b] + j, :] = old c[b, :, src_index[b, j], :]   for j in [0, count[b])
// where "old" means every read happens as if before any write.  The used indices
// src_index[b, :count[b]] must be strictly increasing and src_index[b, 0] >= dst_start[b]
// (so src_index[b, j] >= dst_start[b] + j: columns only move towards the prefix, or stay).
// Under that rule a copy in increasing j reads every source before a write reaches it, with
// no temporary.  Entries src_index[b, j] for j >= count[b] are never read (padding, e.g. -1).
// This is how the tree decoding loop keeps the accepted path of each row: the path's columns,
// scattered over the tree's block of the cache, move to the row's prefix end.
//
// Value rules (checked by the CPU op, which raises; the CUDA kernel leaves a row that breaks
// any of them unchanged):
//   0 <= count[b] <= M = src_index.size(1),  dst_start[b] >= 0,  dst_start[b] + count[b] <= T,
//   0 <= src_index[b, j] < T, src_index[b, 0] >= dst_start[b], src_index[b, j] > src_index[b, j - 1].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace specdec {

// Checks everything about gather_kv_'s arguments that does not need their values: list
// length, ranks, batch sizes, dtypes, devices, strides, one T for every cache, and that no two
// caches (nor an index tensor and a cache) share memory.  Reads no tensor data, so the CUDA
// path calls it without synchronising with the device.  Throws c10::Error naming the argument,
// the expected and the actual value.
void check_gather_kv_meta(
    at::TensorList caches,        // L x [B, H, T, D], any floating dtype, one T
    const at::Tensor& src_index,  // [B, M] int64
    const at::Tensor& count,      // [B] int64
    const at::Tensor& dst_start); // [B] int64

}  // namespace specdec
