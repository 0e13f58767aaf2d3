// specdec::fp16_exact_copy and specdec::fp16_copy_matches: the preparation of skinny_linear's
// fp16 weights (specdec_kernels/cpu/skinny_linear.py) in one pass over each weight.
//
// skinny_linear widens fp16 weights exactly as it loads them, so a weight that fp16 holds
// exactly gives the fp32 result bit for bit from half the bytes.  Preparing a model means, per
// fp32 weight: convert it to fp16 and check that every value comes back unchanged.  Done with
// torch ops chunk by chunk from Python (copy_, .float(), equal) that is three passes and a
// temporary per chunk; here it is one: each block of 8 values is loaded once, converted, stored,
// widened back in registers and compared, so the weight is read once and the copy written once.
//
// fp16_exact_copy(w) -> (w16, exact): w16 [same shape] fp16, exact a 0-dim bool tensor: whether
// every value of w round-trips through fp16 bit for bit and none is NaN (the same verdict as
// torch.equal(w.half().float(), w): a NaN never equals itself, and -0.0, +-inf and fp16's
// subnormals round-trip with their bits; an fp32 subnormal or a value past fp16's range does
// not).  The comparison is on the bits, so flush-to-zero or denormals-are-zero modes, which
// would make a compare of values call a subnormal equal to 0, cannot make it say yes wrongly.
// When exact is false w16's contents are unspecified: the blocks stop at the first inexact one
// (early exit across threads: a trained fp32 weight fails in its first block).
//
// fp16_exact_copy_into(w, out) -> 0-dim bool: the same conversion and verdict written into
// out, a contiguous fp16 tensor of w's shape the caller allocated (a file mapping for the copies
// kept on disk: specdec_kernels/cpu/weight_cache.py).
//
// fp16_copy_matches(w, w16) -> 0-dim bool: whether the fp16 tensor w16 widens to w's bits, no
// value NaN (one read of both; the check that a copy is still current).
//
// Memory traffic: reads 4 bytes and writes 2 per element (either form); fp16_copy_matches reads 6.  Blocks of
// kBlock elements are split over torch's intra-op threads.
//
// The copy is new memory, and the kernel's first write to each page of it is a page fault (the
// page is zeroed, then mapped).  In 4 KiB pages that costs more than the conversion itself: on
// the 2-core AMD EPYC VM a fresh 110 MB fp16 tensor took 40-70 ms to fill with zeros, against
// 24-36 ms to copy into one already mapped, and 20 ms once backed by 2 MiB pages.  So on Linux
// the copy's memory is marked for transparent huge pages (madvise, before its first touch: the
// common setting "madvise" then gives it 2 MiB pages; "never" ignores the hint, which changes
// nothing else).  A streaming (cache-bypassing) store was no faster in either case.
#include "parallel.h"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#else
#define SPECDEC_X86 0
#endif

namespace specdec {
namespace {

// Elements per block: 256 KiB of fp32, the unit of the early exit and of the split over threads.
constexpr int64_t kBlock = int64_t{1} << 16;

inline uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}

// One value: its fp16 (round to nearest even, as F16C converts) and whether it round-trips.
inline bool convert_one(float v, c10::Half* out) {
  const c10::Half h(v);
  *out = h;
  return bits(static_cast<float>(h)) == bits(v) && !std::isnan(v);
}

inline bool matches_one(float v, c10::Half h) {
  return bits(static_cast<float>(h)) == bits(v) && !std::isnan(v);
}

bool convert_portable(const float* src, c10::Half* dst, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= convert_one(src[i], dst + i);
  return ok;
}

bool matches_portable(const float* w, const c10::Half* h, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= matches_one(w[i], h[i]);
  return ok;
}

#if SPECDEC_X86
bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

// 8 lanes: all ones where the widened fp16 has v's bits and v is not NaN.
__attribute__((target("avx2,f16c"))) inline __m256i same8(__m256 v, __m128i h) {
  const __m256i back = _mm256_castps_si256(_mm256_cvtph_ps(h));
  const __m256i eq = _mm256_cmpeq_epi32(back, _mm256_castps_si256(v));
  return _mm256_and_si256(eq, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
}

__attribute__((target("avx2,f16c"))) bool convert_avx2(const float* src, c10::Half* dst, int64_t n) {
  __m256i all = _mm256_set1_epi32(-1);
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    all = _mm256_and_si256(all, same8(v, h));
  }
  bool ok = _mm256_movemask_epi8(all) == -1;
  return convert_portable(src + n8, dst + n8, n - n8) && ok;
}

__attribute__((target("avx2,f16c"))) bool matches_avx2(const float* w, const c10::Half* h16, int64_t n) {
  __m256i all = _mm256_set1_epi32(-1);
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h16 + i));
    all = _mm256_and_si256(all, same8(_mm256_loadu_ps(w + i), h));
  }
  bool ok = _mm256_movemask_epi8(all) == -1;
  return matches_portable(w + n8, h16 + n8, n - n8) && ok;
}
#endif

// Runs block(start, count) -> bool over [0, n) in kBlock pieces on torch's threads; false once
// any block is, and no block starts after one has failed.
template <class F>
bool all_blocks(int64_t n, const F& block) {
  std::atomic<bool> failed{false};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  specdec::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (failed.load(std::memory_order_relaxed)) return;
      const int64_t start = b * kBlock;
      if (!block(start, std::min(kBlock, n - start))) {
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return !failed.load();
}

void check_weight(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, op, ": w must be float32, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), op, ": w must be a CPU tensor, got ", w.device());
}

// An fp16 tensor of w's shape whose memory (once past 4 MiB) is asked for 2 MiB pages before
// anything touches it (see the header).
at::Tensor new_copy(const at::Tensor& w) {
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kHalf));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t end = begin + out.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (last > first && last - first >= 2 * kHuge) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // a hint: failure is harmless
  }
#endif
  return out;
}

// Converts src (contiguous fp32) into d, n values; whether every one round-trips.
bool convert(const float* s, c10::Half* d, int64_t n) {
  return all_blocks(n, [&](int64_t start, int64_t count) {
#if SPECDEC_X86
    if (cpu_has_f16c()) {
      return convert_avx2(s + start, d + start, count);
    }
#endif
    return convert_portable(s + start, d + start, count);
  });
}

std::tuple<at::Tensor, at::Tensor> fp16_exact_copy(const at::Tensor& w) {
  check_weight(w, "fp16_exact_copy");
  const at::Tensor src = w.contiguous();
  at::Tensor out = new_copy(w);
  const bool ok = convert(src.const_data_ptr<float>(), out.mutable_data_ptr<c10::Half>(), src.numel());
  return {out, at::scalar_tensor(ok, w.options().dtype(at::kBool))};
}

at::Tensor fp16_exact_copy_into(const at::Tensor& w, at::Tensor& out) {
  check_weight(w, "fp16_exact_copy_into");
  TORCH_CHECK(out.scalar_type() == at::kHalf, "fp16_exact_copy_into: out must be float16, got ", out.scalar_type());
  TORCH_CHECK(out.device().is_cpu(), "fp16_exact_copy_into: out must be a CPU tensor, got ", out.device());
  TORCH_CHECK(out.sizes() == w.sizes(), "fp16_exact_copy_into: out must have w's shape ", w.sizes(), ", got ",
              out.sizes());
  TORCH_CHECK(out.is_contiguous(), "fp16_exact_copy_into: out must be contiguous");
  const at::Tensor src = w.contiguous();
  const bool ok = convert(src.const_data_ptr<float>(), out.mutable_data_ptr<c10::Half>(), src.numel());
  return at::scalar_tensor(ok, w.options().dtype(at::kBool));
}

at::Tensor fp16_copy_matches(const at::Tensor& w, const at::Tensor& w16) {
  check_weight(w, "fp16_copy_matches");
  TORCH_CHECK(w16.scalar_type() == at::kHalf, "fp16_copy_matches: w16 must be float16, got ", w16.scalar_type());
  TORCH_CHECK(w16.device().is_cpu(), "fp16_copy_matches: w16 must be a CPU tensor, got ", w16.device());
  bool ok = w.sizes() == w16.sizes();
  if (ok) {
    const at::Tensor a = w.contiguous();
    const at::Tensor b = w16.contiguous();
    const float* pa = a.const_data_ptr<float>();
    const c10::Half* pb = b.const_data_ptr<c10::Half>();
    ok = all_blocks(a.numel(), [&](int64_t start, int64_t count) {
#if SPECDEC_X86
      if (cpu_has_f16c()) return matches_avx2(pa + start, pb + start, count);
#endif
      return matches_portable(pa + start, pb + start, count);
    });
  }
  return at::scalar_tensor(ok, w.options().dtype(at::kBool));
}

// The same verdicts on the portable path alone (tests compare the two).
std::tuple<at::Tensor, at::Tensor> fp16_exact_copy_portable(const at::Tensor& w) {
  check_weight(w, "fp16_exact_copy_portable");
  const at::Tensor src = w.contiguous();
  at::Tensor out = new_copy(w);
  const float* s = src.const_data_ptr<float>();
  c10::Half* d = out.mutable_data_ptr<c10::Half>();
  const bool ok = all_blocks(src.numel(), [&](int64_t start, int64_t count) {
    return convert_portable(s + start, d + start, count);
  });
  return {out, at::scalar_tensor(ok, w.options().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("fp16_exact_copy(Tensor w) -> (Tensor, Tensor)");
  m.def("fp16_exact_copy_portable(Tensor w) -> (Tensor, Tensor)");
  m.def("fp16_exact_copy_into(Tensor w, Tensor(a!) out) -> Tensor");
  m.def("fp16_copy_matches(Tensor w, Tensor w16) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("fp16_exact_copy", &fp16_exact_copy);
  m.impl("fp16_exact_copy_portable", &fp16_exact_copy_portable);
  m.impl("fp16_exact_copy_into", &fp16_exact_copy_into);
  m.impl("fp16_copy_matches", &fp16_copy_matches);
}

// No derivative: the outputs are an fp16 copy and verdicts.
TORCH_LIBRARY_IMPL(specdec, Autograd, m) {
  m.impl("fp16_exact_copy", torch::autograd::autogradNotImplementedFallback());
  m.impl("fp16_exact_copy_portable", torch::autograd::autogradNotImplementedFallback());
  m.impl("fp16_exact_copy_into", torch::autograd::autogradNotImplementedFallback());
  m.impl("fp16_copy_matches", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace specdec
