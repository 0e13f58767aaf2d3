// Shared declarations of the specdec::compact_kv_ op (CPU in ops.cpp, CUDA in compact_kv_cuda.cu).
//
// compact_kv_(Tensor(a!)[] caches, int src_start, Tensor dst_start, Tensor count) -> ()
//
// For every cache c ([B, H, T, D], sequence on dim 2) and every row b:
//   c[b, :, dst_start[b] + j, :] = c[b, :, src_start + j, :]   for j in [0, count[b])
// with memmove semantics: dst_start[b] <= src_start, so copying in increasing j is safe
// even when the two ranges overlap.  This is how the decoding loop rolls the KV cache back
// after rows accepted different numbers of draft tokens: the cache entries written for the
// accepted tokens (and the bonus/recovered token) move down to the row's true length.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace specdec {

// Checks everything about compact_kv_'s arguments that does not need their values:
// list length, ranks, batch sizes, dtypes, devices, strides, src_start against every T,
// and that no two caches share memory.  Reads no tensor data, so the CUDA path calls it
// without synchronising with the device.  Throws c10::Error naming the argument, the
// expected and the actual value.
void check_compact_kv_meta(
    at::TensorList caches,        // L x [B, H, T, D], any floating dtype
    int64_t src_start,            // in [0, T] for every cache
    const at::Tensor& dst_start,  // [B] int64
    const at::Tensor& count);     // [B] int64

// After the move: bump the caches' version counters, as torch's own in-place ops do, so that
// autograd sees the mutation (a backward through a saved cache then fails with "modified by an
// inplace operation" instead of silently using the moved values).  torch's autograd fallback,
// registered for the op, does not look inside a Tensor(a!)[] argument.
void bump_versions(at::TensorList caches);

}  // namespace specdec
