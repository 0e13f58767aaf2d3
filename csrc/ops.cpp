// The specdec op namespace: schemas (TORCH_LIBRARY) and the CPU kernels.
//
// Python reaches the ops as torch.ops.specdec.<name> once specdec_kernels.ops._C is imported;
// the module itself is empty and only exists so that the import loads this shared object,
// which runs the static registrations below.  The CUDA kernels register themselves from
// compact_kv_cuda.cu and gather_kv_cuda.cu when the extension is built with CUDA.
//
// compact_kv_ memory traffic: each moved row reads and writes H * D * elem bytes per cache,
// i.e. 2 * count[b] * H * D * elem bytes per (cache, row); nothing else is touched, which is
// the floor for an in-place move.
//
// gather_kv_ memory traffic: per (cache, row b), 2 * moved[b] * H * D * elem bytes, where
// moved[b] counts the j < count[b] with src_index[b, j] != dst_start[b] + j (a column already
// in place is neither read nor written), plus count[b] * 8 bytes of src_index, read once per
// row (the value checks and the plan of runs, before any move).  Again the floor for an
// in-place move.
#include <Python.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include "parallel.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "compact_kv.h"
#include "gather_kv.h"

extern "C" {
// An empty module `specdec_kernels.ops._C`: importing it dlopens this library, and with it the
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL initialisers.  Only the limited Python C API is used.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",                                             // m_name
      "specdec custom ops; use them via torch.ops.specdec",  // m_doc
      -1,                                               // m_size: no per-interpreter state
      nullptr,                                          // m_methods: none
  };
  return PyModule_Create(&module_def);
}
}

namespace specdec {

namespace {

// Whether no two elements of ``c`` share an address: sorted by stride, each dim of size > 1
// steps past everything the smaller strides reach (a sufficient condition; it holds for
// contiguous, transposed and cropped tensors).
bool strides_separate_elements(const at::Tensor& c) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < c.dim(); ++d) {
    if (c.size(d) > 1) {
      dims.emplace_back(c.stride(d), c.size(d));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) {
      return false;
    }
    reach += (size - 1) * stride;
  }
  return true;
}

// [first byte, one past the last byte) that a non-empty tensor's elements span.
std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t last = 0;  // the offset of the last element, in elements
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

}  // namespace

namespace {

// An index tensor of an op, by the name its messages use.
struct NamedIndex {
  const char* name;
  const at::Tensor* tensor;
};

void check_caches_nonempty(const char* op, at::TensorList caches) {
  TORCH_CHECK(
      !caches.empty(),
      op, ": caches must be a non-empty list of [B, H, T, D] tensors, got an empty list");
}

// The rank (`dims`, named `shape`: "[B]" or "[B, M]") and dtype (int64) of an index tensor.
void check_index_meta(
    const char* op, const char* name, const at::Tensor& t, int64_t dims, const char* shape) {
  TORCH_CHECK(
      t.dim() == dims,
      op, ": ", name, " must have ", dims, dims == 1 ? " dim " : " dims ", shape, ", got ", t.dim(),
      " (shape ", t.sizes(), ")");
  TORCH_CHECK(
      t.scalar_type() == at::kLong, op, ": ", name, " must be int64 (Long), got ", t.scalar_type());
}

void check_index_batch(
    const char* op, const char* name, const at::Tensor& t, int64_t B, const char* b_source) {
  TORCH_CHECK(
      t.size(0) == B,
      op, ": ", name, " must have B = ", b_source, " = ", B, " entries, got ", t.size(0));
}

// Every check of one cache list that needs no tensor data and is common to compact_kv_ and
// gather_kv_: the index tensors on the caches' device, and per cache: defined, 4 dims, one
// device, a floating dtype, B rows, a contiguous last dim, then `per_cache(i, c)` (the op's own
// checks), no grad, inference mode, no internal overlap.
template <typename PerCache>
void check_caches_meta(
    const char* op,
    at::TensorList caches,
    std::initializer_list<NamedIndex> indices,
    int64_t B,
    const char* b_source,  // how the messages name B ("dst_start.size(0)")
    const PerCache& per_cache) {
  const c10::Device device = caches[0].device();
  for (const NamedIndex& idx : indices) {
    TORCH_CHECK(
        idx.tensor->device() == device,
        op, ": ", idx.name, " must be on the caches' device ", device, ", got ",
        idx.tensor->device());
  }

  for (size_t i = 0; i < caches.size(); ++i) {
    const at::Tensor& c = caches[i];
    TORCH_CHECK(c.defined(), op, ": caches[", i, "] must be a tensor, got an undefined one");
    TORCH_CHECK(
        c.dim() == 4,
        op, ": caches[", i, "] must have 4 dims [B, H, T, D], got ", c.dim(), " (shape ",
        c.sizes(), ")");
    TORCH_CHECK(
        c.device() == device,
        op, ": caches[", i, "] must be on caches[0]'s device ", device, ", got ", c.device());
    TORCH_CHECK(
        at::isFloatingType(c.scalar_type()),
        op, ": caches[", i, "] must have a floating-point dtype, got ", c.scalar_type());
    TORCH_CHECK(
        c.size(0) == B,
        op, ": caches[", i, "] must have B = ", b_source, " = ", B, " rows (dim 0), got ",
        c.size(0), " (shape ", c.sizes(), ")");
    // Rows are moved with memmove of D contiguous elements.
    TORCH_CHECK(
        c.stride(3) == 1 || c.size(3) <= 1,
        op, ": caches[", i, "] must have a contiguous last dim (stride(3) == 1), got "
        "stride(3) = ", c.stride(3), " (strides ", c.strides(), ")");
    per_cache(i, c);
    // An expanded tensor (stride 0 over a dim of size > 1), or any layout whose elements may
    // share memory, would be written by several rows/heads at once.  torch answers only for
    // dense tensors (TooHard otherwise); strides that each step past everything the smaller
    // strides reach are a sufficient test for the rest (cropped and transposed caches pass).
    // No derivative: torch's fallback refuses a leaf that requires grad, but a non-leaf would
    // keep its grad_fn and a backward would run through the values before the move.
    TORCH_CHECK(
        !(c.requires_grad() && at::GradMode::is_enabled()),
        op, ": caches[", i, "] must not require grad (the op has no derivative; run it under "
        "torch.no_grad() or torch.inference_mode()), got a tensor with requires_grad=True");
    // As torch's own in-place ops: an inference tensor is written inside inference mode only.
    TORCH_CHECK(
        !c.is_inference() || c10::InferenceMode::is_enabled(),
        op, ": caches[", i, "] is an inference tensor: it may be updated inside "
        "torch.inference_mode() only, got a call outside it");
    const at::MemOverlap internal = at::has_internal_overlap(c);
    TORCH_CHECK(
        internal == at::MemOverlap::No ||
            (internal == at::MemOverlap::TooHard && strides_separate_elements(c)),
        op, ": caches[", i, "] must not have internally overlapping memory (e.g. an "
        "expand()ed tensor), got strides ", c.strides(), " for shape ", c.sizes());
  }

  // Two caches sharing memory would be moved twice, and the result would depend on the order
  // (and, in parallel, the timing) of the copies.  Compare the address ranges the caches span
  // (sorted by start: O(L log L) when they are apart, the usual case of one buffer per cache);
  // for two that meet, torch tells dense tensors apart exactly, and views it cannot judge
  // (non-dense ones: TooHard) are refused.  Views of one buffer that do not meet (keys and
  // values as the two halves of one [2, B, H, T, D] tensor) are fine.
  struct Span {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i) {
    if (caches[i].numel() > 0) {
      const auto [begin, end] = byte_range(caches[i]);
      spans.push_back({begin, end, i});
    }
  }
  // The index tensors are read while the caches are written (on the CPU, and by the CUDA
  // kernel's blocks): one that shares memory with a cache could change under the move.
  for (const NamedIndex& idx : indices) {
    if (idx.tensor->numel() == 0) {
      continue;
    }
    const auto [begin, end] = byte_range(*idx.tensor);
    for (const Span& sp : spans) {
      TORCH_CHECK(
          end <= sp.begin || sp.end <= begin,
          op, ": ", idx.name, " must not share memory with caches[", sp.index,
          "] (it is read while the caches are written), got overlapping memory");
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  for (size_t a = 0; a < spans.size(); ++a) {
    for (size_t b = a + 1; b < spans.size() && spans[b].begin < spans[a].end; ++b) {
      const size_t i = std::min(spans[a].index, spans[b].index);
      const size_t j = std::max(spans[a].index, spans[b].index);
      // Two storages over one memory (two from_numpy of one array, say): torch compares
      // storages, so meeting ranges there are taken as overlapping.
      const at::MemOverlapStatus s = caches[i].storage().is_alias_of(caches[j].storage())
                                         ? at::get_overlap_status(caches[i], caches[j])
                                         : at::MemOverlapStatus::Partial;
      TORCH_CHECK(
          s == at::MemOverlapStatus::No,
          op, ": caches[", i, "] and caches[", j, "] must not share memory, got ",
          s == at::MemOverlapStatus::Full      ? "the same memory"
          : s == at::MemOverlapStatus::Partial ? "overlapping memory"
                                               : "views whose memory ranges meet (not both dense)",
          " (every cache in the list must be moved exactly once)");
    }
  }
}

}  // namespace

void check_compact_kv_meta(
    at::TensorList caches,
    int64_t src_start,
    const at::Tensor& dst_start,
    const at::Tensor& count) {
  constexpr const char* op = "compact_kv_";
  check_caches_nonempty(op, caches);
  TORCH_CHECK(
      dst_start.dim() == 1,
      "compact_kv_: dst_start must have 1 dim [B], got ", dst_start.dim(), " (shape ",
      dst_start.sizes(), ")");
  TORCH_CHECK(
      count.dim() == 1,
      "compact_kv_: count must have 1 dim [B], got ", count.dim(), " (shape ", count.sizes(), ")");
  TORCH_CHECK(
      dst_start.scalar_type() == at::kLong,
      "compact_kv_: dst_start must be int64 (Long), got ", dst_start.scalar_type());
  TORCH_CHECK(
      count.scalar_type() == at::kLong,
      "compact_kv_: count must be int64 (Long), got ", count.scalar_type());
  const int64_t B = dst_start.size(0);
  check_index_batch(op, "count", count, B, "dst_start.size(0)");
  check_caches_meta(
      op, caches, {{"dst_start", &dst_start}, {"count", &count}}, B, "dst_start.size(0)",
      [&](size_t i, const at::Tensor& c) {
        TORCH_CHECK(
            src_start >= 0 && src_start <= c.size(2),
            "compact_kv_: src_start must be in [0, T] = [0, ", c.size(2), "] (T = caches[", i,
            "].size(2)), got ", src_start);
      });
}

void check_gather_kv_meta(
    at::TensorList caches,
    const at::Tensor& src_index,
    const at::Tensor& count,
    const at::Tensor& dst_start) {
  constexpr const char* op = "gather_kv_";
  check_caches_nonempty(op, caches);
  check_index_meta(op, "src_index", src_index, 2, "[B, M]");
  check_index_meta(op, "count", count, 1, "[B]");
  check_index_meta(op, "dst_start", dst_start, 1, "[B]");
  const int64_t B = src_index.size(0);
  check_index_batch(op, "count", count, B, "src_index.size(0)");
  check_index_batch(op, "dst_start", dst_start, B, "src_index.size(0)");
  check_caches_meta(
      op, caches, {{"src_index", &src_index}, {"count", &count}, {"dst_start", &dst_start}}, B,
      "src_index.size(0)", [&](size_t i, const at::Tensor& c) {
        // One T for every cache: the index values are checked against it once.
        TORCH_CHECK(
            c.size(2) == caches[0].size(2),  // (caches[0] passed every check above at i = 0)
            "gather_kv_: caches[", i, "] must have T = caches[0].size(2) = ", caches[0].size(2),
            " positions (dim 2), got ", c.size(2), " (shape ", c.sizes(), ")");
      });
}

void bump_versions(at::TensorList caches) {
  for (const at::Tensor& c : caches) {
    if (!c.is_inference()) {  // an inference tensor has no version counter
      torch::autograd::impl::bump_version(c);
    }
  }
}

namespace {

// Below this many bytes a (cache, row) task is merged with its neighbours instead of being
// handed to another thread: a memmove of 256 KiB takes ~10-30 us, about a thread wake-up.
constexpr int64_t kMinBytesPerTask = int64_t{256} * 1024;

void compact_kv_cpu(
    at::TensorList caches,        // L x [B, H, T, D] floating, stride(3) == 1
    int64_t src_start,            // in [0, T]
    const at::Tensor& dst_start,  // [B] int64, dst_start[b] in [0, src_start]
    const at::Tensor& count) {    // [B] int64, count[b] in [0, T - src_start]
  check_compact_kv_meta(caches, src_start, dst_start, count);
  bump_versions(caches);  // (a refusal below leaves the data unchanged)

  // On CPU the index values are free to read, so they are checked here (the CUDA kernel
  // cannot check them without a device sync, and skips/clamps instead).
  const at::Tensor dst_c = dst_start.contiguous();  // [B] int64
  const at::Tensor cnt_c = count.contiguous();      // [B] int64
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();
  const int64_t B = dst_c.numel();
  const int64_t L = static_cast<int64_t>(caches.size());

  size_t shortest = 0;  // the cache with the smallest T bounds src_start + count[b]
  for (size_t i = 1; i < caches.size(); ++i) {
    if (caches[i].size(2) < caches[shortest].size(2)) {
      shortest = i;
    }
  }
  const int64_t T = caches[shortest].size(2);
  int64_t moved_rows = 0;  // sum over b of count[b] for rows that actually move
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(dst[b] >= 0, "compact_kv_: dst_start[", b, "] must be >= 0, got ", dst[b]);
    TORCH_CHECK(
        dst[b] <= src_start,
        "compact_kv_: dst_start[", b, "] must be <= src_start = ", src_start, ", got ", dst[b]);
    TORCH_CHECK(cnt[b] >= 0, "compact_kv_: count[", b, "] must be >= 0, got ", cnt[b]);
    TORCH_CHECK(
        cnt[b] <= T - src_start,
        "compact_kv_: src_start + count[", b, "] must be <= T = ", T, " (T = caches[", shortest,
        "].size(2)), got ", src_start, " + ", cnt[b]);
    if (dst[b] != src_start) {
      moved_rows += cnt[b];
    }
  }
  if (moved_rows == 0) {
    return;
  }

  int64_t total_bytes = 0;
  for (const at::Tensor& c : caches) {
    total_bytes += moved_rows * c.size(1) * c.size(3) * c.element_size();
  }
  const int64_t tasks = L * B;
  const int64_t bytes_per_task = std::max<int64_t>(1, total_bytes / tasks);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / bytes_per_task);

  // One task per (cache, row): they touch disjoint memory (checked above), so no locking.
  specdec::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task % B;
      const int64_t n = cnt[b];
      const int64_t d0 = dst[b];
      if (n == 0 || d0 == src_start) {
        continue;
      }
      const at::Tensor& c = caches[task / B];
      const int64_t elem = c.element_size();
      const int64_t H = c.size(1);
      const int64_t row_bytes = c.size(3) * elem;
      const int64_t stride_h = c.stride(1) * elem;  // bytes
      const int64_t stride_t = c.stride(2) * elem;  // bytes
      char* row = static_cast<char*>(c.mutable_data_ptr()) + b * c.stride(0) * elem;
      for (int64_t h = 0; h < H; ++h) {
        char* head = row + h * stride_h;
        if (stride_t == row_bytes) {
          // [T, D] slice is dense: one memmove moves all n rows, overlap included.
          std::memmove(head + d0 * stride_t, head + src_start * stride_t, n * row_bytes);
        } else {
          // Rows are strided (e.g. a [B, T, H, D] buffer viewed as [B, H, T, D]).  Increasing
          // j is safe because dst_start <= src_start: row j is read before any write reaches it.
          for (int64_t j = 0; j < n; ++j) {
            std::memmove(
                head + (d0 + j) * stride_t, head + (src_start + j) * stride_t, row_bytes);
          }
        }
      }
    }
  });
}

// One run of gather_kv_'s moves for one row: `len` columns from src.. to dst.. (src > dst).
struct GatherRun {
  int64_t dst, src, len;
};

void gather_kv_cpu(
    at::TensorList caches,        // L x [B, H, T, D] floating, stride(3) == 1, one T
    const at::Tensor& src_index,  // [B, M] int64, per row strictly increasing, >= dst_start[b]
    const at::Tensor& count,      // [B] int64, count[b] in [0, M]
    const at::Tensor& dst_start) {  // [B] int64, dst_start[b] >= 0, dst_start[b] + count[b] <= T
  check_gather_kv_meta(caches, src_index, count, dst_start);
  bump_versions(caches);  // (a refusal below leaves the data unchanged)

  // On CPU the index values are free to read, so they are checked here (the CUDA kernel
  // cannot check them without a device sync, and leaves a row with bad values unchanged).
  const at::Tensor src_c = src_index.contiguous();  // [B, M] int64
  const at::Tensor cnt_c = count.contiguous();      // [B] int64
  const at::Tensor dst_c = dst_start.contiguous();  // [B] int64
  const int64_t* src = src_c.const_data_ptr<int64_t>();
  const int64_t* cnt = cnt_c.const_data_ptr<int64_t>();
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  const int64_t B = src_c.size(0);
  const int64_t M = src_c.size(1);
  const int64_t L = static_cast<int64_t>(caches.size());
  const int64_t T = caches[0].size(2);  // every cache's (checked above)

  // The moves of every row as runs of consecutive source columns (one memmove each on a
  // dense [T, D] slice); columns already in place (src == dst) are left out.
  std::vector<GatherRun> runs;       // every row's runs, row after row
  std::vector<int64_t> first_run(B + 1, 0);  // row b's runs: [first_run[b], first_run[b + 1])
  int64_t moved_rows = 0;            // sum over b of the columns that actually move
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cnt[b];
    const int64_t d0 = dst[b];
    const int64_t* s = src + b * M;  // [M]
    TORCH_CHECK(d0 >= 0, "gather_kv_: dst_start[", b, "] must be >= 0, got ", d0);
    TORCH_CHECK(
        n >= 0 && n <= M,
        "gather_kv_: count[", b, "] must be in [0, M] = [0, ", M, "] (M = src_index.size(1)), got ", n);
    TORCH_CHECK(
        n <= T - d0,
        "gather_kv_: dst_start[", b, "] + count[", b, "] must be <= T = ", T,
        " (T = caches[0].size(2)), got ", d0, " + ", n);
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK(
          s[j] >= 0 && s[j] < T,
          "gather_kv_: src_index[", b, ", ", j, "] must be in [0, T) = [0, ", T,
          ") (T = caches[0].size(2)), got ", s[j]);
      if (j == 0) {
        TORCH_CHECK(
            s[0] >= d0,
            "gather_kv_: src_index[", b, ", 0] must be >= dst_start[", b, "] = ", d0,
            " (columns move towards the prefix only), got ", s[0]);
      } else {
        TORCH_CHECK(
            s[j] > s[j - 1],
            "gather_kv_: src_index[", b, ", ", j, "] must be > src_index[", b, ", ", j - 1,
            "] = ", s[j - 1], " (the used indices must be strictly increasing), got ", s[j]);
      }
    }
    for (int64_t j = 0; j < n;) {
      if (s[j] == d0 + j) {  // already in place
        ++j;
        continue;
      }
      int64_t len = 1;  // s[j + k] == s[j] + k: none of these is in place either
      while (j + len < n && s[j + len] == s[j] + len) {
        ++len;
      }
      runs.push_back({d0 + j, s[j], len});
      moved_rows += len;
      j += len;
    }
    first_run[b + 1] = static_cast<int64_t>(runs.size());
  }
  if (moved_rows == 0) {
    return;
  }

  int64_t total_bytes = 0;
  for (const at::Tensor& c : caches) {
    total_bytes += moved_rows * c.size(1) * c.size(3) * c.element_size();
  }
  const int64_t tasks = L * B;
  const int64_t bytes_per_task = std::max<int64_t>(1, total_bytes / tasks);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / bytes_per_task);

  // One task per (cache, row): they touch disjoint memory (checked above), so no locking.
  specdec::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task % B;
      if (first_run[b] == first_run[b + 1]) {
        continue;
      }
      const at::Tensor& c = caches[task / B];
      const int64_t elem = c.element_size();
      const int64_t H = c.size(1);
      const int64_t row_bytes = c.size(3) * elem;
      const int64_t stride_h = c.stride(1) * elem;  // bytes
      const int64_t stride_t = c.stride(2) * elem;  // bytes
      char* row = static_cast<char*>(c.mutable_data_ptr()) + b * c.stride(0) * elem;
      for (int64_t h = 0; h < H; ++h) {
        char* head = row + h * stride_h;
        // Runs in increasing j: a run reads columns >= its own destination's, above every
        // column an earlier run wrote (src_index[b, j] >= dst_start[b] + j).
        for (int64_t r = first_run[b]; r < first_run[b + 1]; ++r) {
          const GatherRun& run = runs[r];
          if (stride_t == row_bytes) {
            // [T, D] slice is dense: one memmove moves the whole run, overlap included.
            std::memmove(head + run.dst * stride_t, head + run.src * stride_t, run.len * row_bytes);
          } else {
            for (int64_t k = 0; k < run.len; ++k) {  // increasing k: src > dst, as for compact_kv_
              std::memmove(
                  head + (run.dst + k) * stride_t, head + (run.src + k) * stride_t, row_bytes);
            }
          }
        }
      }
    }
  });
}

// Whether this build's at::parallel_for runs on torch's intra-op threads.  It is a header
// template: where torch's threads are OpenMP's, a file compiled without -fopenmp gets the serial
// fallback and runs every range on the calling thread (setup.py passes the flag; a test asks).
bool intra_op_parallel() {
#ifdef INTRA_OP_PARALLEL
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("intra_op_parallel() -> bool", &intra_op_parallel);
  m.def("compact_kv_(Tensor(a!)[] caches, int src_start, Tensor dst_start, Tensor count) -> ()");
  // For every cache and row b: the columns src_index[b, :count[b]] (strictly increasing, at or
  // past dst_start[b]) move to dst_start[b] onwards; see gather_kv.h.
  m.def("gather_kv_(Tensor(a!)[] caches, Tensor src_index, Tensor count, Tensor dst_start) -> ()");
  // y = x @ weight^T (+ bias), fp32 CPU, batch-invariant; see skinny_linear.cpp.  The
  // _portable variant runs the same arithmetic without SIMD (tests compare the paths).
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_linear_portable(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // One named code path ("auto", "portable", "avx2", "avx512"; AVX-512 is what "auto" picks
  // where the CPU has it): all give the same bits, the tests check that on every path the CPU has.
  m.def("skinny_linear_isa(Tensor x, Tensor weight, Tensor? bias, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("compact_kv_", &compact_kv_cpu);
  m.impl("gather_kv_", &gather_kv_cpu);
}

// compact_kv_ and gather_kv_ write their caches in place and have no derivative: torch's
// fallback refuses a leaf that requires grad (as any in-place op does), and a backward through
// the op says it has none.
// The kernels bump the caches' version counters themselves (bump_versions).

TORCH_LIBRARY_IMPL(specdec, Autograd, m) {
  m.impl("compact_kv_", torch::autograd::autogradNotImplementedFallback());
  m.impl("gather_kv_", torch::autograd::autogradNotImplementedFallback());
  // skinny_linear has no backward either: an output that requires grad would otherwise give
  // x and weight no gradient at all (use_skinny_linear routes grad-enabled calls to F.linear).
  m.impl("skinny_linear", torch::autograd::autogradNotImplementedFallback());
  m.impl("skinny_linear_portable", torch::autograd::autogradNotImplementedFallback());
  m.impl("skinny_linear_isa", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace specdec
