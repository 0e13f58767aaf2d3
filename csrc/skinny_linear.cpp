// specdec::skinny_linear: y = x @ weight^T (+ bias) for fp32 CPU tensors with few rows.
//
// Why: verifying K draft tokens runs the target over K+1 positions.  On a CPU one position is
// a GEMV bound by reading the weights once; a handful of positions should cost about the same,
// since every weight loaded from memory can be used for all K+1 rows while it sits in a
// register.  torch's fp32 `linear` with 2-16 rows goes to an SGEMM (MKL on x86) that, on the
// AVX2 machines we measured (AMD EPYC, no AVX-512), takes 2-3x the one-row time: a
// 49,152 x 576 output layer costs 14 ms for one row and 45 ms for five.  This kernel streams
// the weight matrix once for all rows and costs little more than the GEMV.
//
// Weights: fp32, or fp16 (F16C widens them exactly as they are loaded, so fp16-exact weights
// give the fp32 result bit for bit from half the bytes: the embedded draft is stored in fp16).
//
// Memory traffic: reads N*K*4 bytes of weight (N*K*2 in fp16; once, the floor: every weight is needed), M*K*4
// of x (from cache, M rows are reused for every weight block) and N*4 of bias; writes M*N*4.
// Arithmetic: 2*M*N*K flops, so for M <= ~16 rows on a single AVX2 core the weight stream, not
// the FMAs, sets the time.
//
// Batch invariance: y[i, j] is computed by the same sequence of floating-point operations
// whatever M is and wherever row i sits in x: 8 lane accumulators over k = 0, 8, 16, ... with
// fused multiply-adds, a fixed pairwise reduction of the 8 lanes, then the k tail (K % 8) with
// fused multiply-adds in order, then + bias[j].  So a row's logits are bit-identical whether the
// target sees it alone (a decode step) or among K+1 verified positions, and the result does not
// depend on the thread count.  It is not bit-identical to torch.nn.functional.linear (whose
// summation order is MKL's); the tests bound the difference against a float64 reference.
//
// Three code paths with the same arithmetic, selected at run time: AVX-512 (F + DQ), AVX2+FMA+F16C
// and portable C++ (std::fma on 8 explicit lanes).  All give the same bits.  The AVX-512 path
// keeps the 8-lane order by putting two weight rows in one 16-lane register (lanes 0-7: row j,
// lanes 8-15: row j+1, the x row broadcast to both halves), so each FMA instruction does the
// work of two AVX2 ones and 16 accumulators cover 16 x rows in one pass.  It wins once the FMAs,
// not the weight stream, set the time: from kMinRowsAvx512 = 5 rows (a verify of K >= 4 drafts);
// with fewer rows the AVX2 path's single weight stream is faster.  Since the bits are the same,
// choosing the path by M keeps every row's result independent of M.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#else
#define SPECDEC_X86 0
#endif

namespace specdec {
namespace {

// Tiles: nr weight rows x mr x rows, mr * nr <= 12 accumulators.  fp32 weights run nr = 1: one
// weight row at a time, used by up to 12 x rows while it is in registers (one pass over the
// weights for M <= 12, a single prefetched stream).  Measured on the AVX2 EPYC
// (bench_skinny_linear.py), that beat 2, 4 or 8 weight rows per tile at every M from 1 to 16
// (fewer concurrent streams for the prefetcher), and beat MKL's GEMV at M = 1; on the Zen 5 VM
// too (the target's layers, one row: 15.1 ms with nr = 1, 18-20 ms with 2 or 4).  fp16 weights
// (the embedded draft) with M <= 3 run nr = 4, and nr = 2 at M = 4: each weight row is a chain of
// K / 8 dependent FMAs, and with half the bytes per FMA that chain, not the memory, sets the
// time, so four independent chains side by side go faster (Zen 5 VM, 1 thread,
// bench_skinny_linear.py --draft-fp16, the embedded draft's 12,288 x 192 output layer: one row
// 201 -> 98 us from cache, 217 -> 145 us after a 64 MB stream; 2 rows 259 -> 136 us; 4 rows
// (nr = 2) 359 -> 274 us; its 192 x 768 layer, one row, 12.4 -> 6.1 us).  The tile shape never
// changes the arithmetic of an output element.
// About 256 KiB of weights per parallel task: small enough to split a 576 x 576 matrix over
// two threads, large enough that a thread wake-up (~10 us) is not the cost.
constexpr int64_t kMinWeightBytesPerTask = int64_t{256} * 1024;
// Software prefetch distance on each weight row (both SIMD paths; past a row's end it reaches
// into the next rows, which are next in memory).  Measured on the 2-core AMD EPYC Zen 5 VM, 1 thread,
// the embedded target's layers (538 MB): 1,024 bytes streamed them at 28 GB/s (19.1 ms for one
// row); 8,192 at 34 GB/s (15.9 ms); 16,384 and 32,768 no better; 512 worse (22 ms).  With many
// rows (the AVX-512 path at M = 9) it matters more: 42.7 -> 25.8 ms.  A prefetch never changes
// the arithmetic, so the bits are the same at any distance.
constexpr int64_t kPrefetchBytes = 8192;

// The 8-lane reduction, written once for both paths: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float reduce8(const float* l) {
  const float t0 = l[0] + l[4];
  const float t1 = l[1] + l[5];
  const float t2 = l[2] + l[6];
  const float t3 = l[3] + l[7];
  return (t0 + t2) + (t1 + t3);
}

// y[i, j] for i in [i0, i0 + mr), j in [j0, j0 + nr): portable path.
// Weights are fp32, or fp16 widened exactly to fp32 as they are loaded (half the bytes to
// stream; use_skinny_linear picks fp16 only for weights that fp16 holds exactly, so both give
// the same bits).
inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <int64_t mr, int64_t nr, typename WT>
void tile_portable(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  float acc[mr][nr][8];
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b)
      for (int l = 0; l < 8; ++l) acc[a][b][l] = 0.0f;
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    for (int64_t a = 0; a < mr; ++a) {
      const float* xr = x + (i0 + a) * K + k;
      for (int64_t b = 0; b < nr; ++b) {
        const WT* wr = w + (j0 + b) * K + k;
        for (int l = 0; l < 8; ++l) acc[a][b][l] = std::fma(xr[l], to_float(wr[l]), acc[a][b][l]);
      }
    }
  }
  for (int64_t a = 0; a < mr; ++a) {
    for (int64_t b = 0; b < nr; ++b) {
      float s = reduce8(acc[a][b]);
      const float* xr = x + (i0 + a) * K;
      const WT* wr = w + (j0 + b) * K;
      for (int64_t k = K8; k < K; ++k) s = std::fma(xr[k], to_float(wr[k]), s);
      if (bias != nullptr) s += bias[j0 + b];
      y[(i0 + a) * N + j0 + b] = s;
    }
  }
}

#if SPECDEC_X86
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* w) {
  return _mm256_loadu_ps(w);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const c10::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// One step of 8 lanes over k .. k+7: the same per-lane order as the portable path.
template <int64_t mr, int64_t nr, typename WT>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void step8(
    __m256 (&acc)[mr][nr], const float* x, const WT* w, int64_t K, int64_t i0, int64_t j0,
    int64_t k) {
  __m256 wv[nr];
  for (int64_t b = 0; b < nr; ++b) wv[b] = load8(w + (j0 + b) * K + k);
  for (int64_t a = 0; a < mr; ++a) {
    const __m256 xv = _mm256_loadu_ps(x + (i0 + a) * K + k);
    for (int64_t b = 0; b < nr; ++b) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
  }
}

template <int64_t mr, int64_t nr, typename WT>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  __m256 acc[mr][nr];
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b) acc[a][b] = _mm256_setzero_ps();
  const int64_t K8 = K - K % 8;
  const int64_t K16 = K - K % 16;
  // With many x rows the loop body is long, so out-of-order execution alone keeps few weight
  // cache lines in flight; prefetching kPrefetchBytes ahead on every weight row keeps the
  // memory stream busy while the FMAs run (past a row's end it fetches the next tile's rows,
  // which are next in memory).
  constexpr int64_t pf = kPrefetchBytes / int64_t{sizeof(WT)};
  int64_t k = 0;
  for (; k < K16; k += 16) {
    for (int64_t b = 0; b < nr; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j0 + b) * K + k + pf), _MM_HINT_T0);
    }
    step8<mr, nr, WT>(acc, x, w, K, i0, j0, k);
    step8<mr, nr, WT>(acc, x, w, K, i0, j0, k + 8);
  }
  for (; k < K8; k += 8) step8<mr, nr, WT>(acc, x, w, K, i0, j0, k);
  for (int64_t a = 0; a < mr; ++a) {
    for (int64_t b = 0; b < nr; ++b) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[a][b]);
      float s = reduce8(lanes);
      const float* xr = x + (i0 + a) * K;
      const WT* wr = w + (j0 + b) * K;
      for (int64_t k = K8; k < K; ++k) s = std::fma(xr[k], to_float(wr[k]), s);
      if (bias != nullptr) s += bias[j0 + b];
      y[(i0 + a) * N + j0 + b] = s;
    }
  }
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// GCC 12's headers implement the 256 -> 512-bit casts and broadcasts with a deliberately
// undefined upper half, which -Wmaybe-uninitialized reports at every use (a known false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// AVX-512: weight rows j0 and j0 + 1 in the low and high 8 lanes of one register.
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 load8x2(
    const float* w0, const float* w1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w0)), _mm256_loadu_ps(w1), 1);
}
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) inline __m512 load8x2(
    const c10::Half* w0, const c10::Half* w1) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1)), 1);
  return _mm512_cvtph_ps(h);
}

// One step of 8 lanes over k .. k+7 for two weight rows at once.
template <int64_t mr, typename WT>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"), always_inline)) inline void step8x2(
    __m512 (&acc)[mr], const float* x, const WT* w0, const WT* w1, int64_t K, int64_t i0,
    int64_t k) {
  const __m512 wv = load8x2(w0 + k, w1 + k);
  for (int64_t a = 0; a < mr; ++a) {
    const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (i0 + a) * K + k));
    acc[a] = _mm512_fmadd_ps(xv, wv, acc[a]);
  }
}

// y[i, j0] and y[i, j0 + 1] for i in [i0, i0 + mr): per output element exactly the arithmetic
// of tile_avx2 / tile_portable (8 lanes over k in steps of 8, reduce8, the tail, the bias).
template <int64_t mr, typename WT>
__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))) void tile_avx512(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  __m512 acc[mr];
  for (int64_t a = 0; a < mr; ++a) acc[a] = _mm512_setzero_ps();
  const WT* w0 = w + j0 * K;
  const WT* w1 = w0 + K;
  const int64_t K8 = K - K % 8;
  constexpr int64_t pf = kPrefetchBytes / int64_t{sizeof(WT)};
  const int64_t K16 = K - K % 16;
  int64_t k = 0;
  for (; k < K16; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + k + pf), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + k + pf), _MM_HINT_T0);
    step8x2<mr, WT>(acc, x, w0, w1, K, i0, k);
    step8x2<mr, WT>(acc, x, w0, w1, K, i0, k + 8);
  }
  for (; k < K8; k += 8) step8x2<mr, WT>(acc, x, w0, w1, K, i0, k);
  for (int64_t a = 0; a < mr; ++a) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[a]);
    const float* xr = x + (i0 + a) * K;
    for (int64_t b = 0; b < 2; ++b) {
      float s = reduce8(lanes + 8 * b);
      const WT* wr = b == 0 ? w0 : w1;
      for (int64_t k = K8; k < K; ++k) s = std::fma(xr[k], to_float(wr[k]), s);
      if (bias != nullptr) s += bias[j0 + b];
      y[(i0 + a) * N + j0 + b] = s;
    }
  }
}

bool cpu_has_avx512() {
  static const bool has = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq");
  return has;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Up to 16 x rows per pass over a pair of weight rows (16 accumulators of the 32 registers).
constexpr int64_t kMaxRowsAvx512 = 16;

template <typename WT, int64_t mr = kMaxRowsAvx512>
void tile_avx512_dispatch(
    int64_t m, const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  if constexpr (mr >= 1) {
    if (m == mr) {
      tile_avx512<mr, WT>(x, w, bias, y, K, N, i0, j0);
      return;
    }
    if constexpr (mr > 1) {
      tile_avx512_dispatch<WT, mr - 1>(m, x, w, bias, y, K, N, i0, j0);
    }
  }
}
#endif

// Which code path runs; every path gives the same bits.
enum class Isa { kPortable, kAvx2, kAvx512 };

// Runs tile<mr, nr> with a run-time mr in [1, 12 / nr] (12 accumulators fit the 16 AVX2
// registers with the weight and x vectors).
template <int64_t nr, typename WT, int64_t mr = 12 / nr>
void tile_dispatch(
    bool avx2, int64_t m, const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  if constexpr (mr >= 1) {
    if (m == mr) {
#if SPECDEC_X86
      if (avx2) {
        tile_avx2<mr, nr, WT>(x, w, bias, y, K, N, i0, j0);
        return;
      }
#endif
      tile_portable<mr, nr, WT>(x, w, bias, y, K, N, i0, j0);
      return;
    }
    if constexpr (mr > 1) {
      tile_dispatch<nr, WT, mr - 1>(avx2, m, x, w, bias, y, K, N, i0, j0);
    }
  }
}

// All M rows of y for weight rows [j0, j0 + nr).  With M <= 12 / nr the weight tile is read
// from memory in one pass while every x row uses it; for more rows it is re-read from L1.
template <int64_t nr, typename WT>
void column_tile(
    bool avx2, const float* x, const WT* w, const float* bias, float* y,
    int64_t M, int64_t K, int64_t N, int64_t j0) {
  constexpr int64_t max_mr = 12 / nr;
  for (int64_t i0 = 0; i0 < M; i0 += max_mr) {
    tile_dispatch<nr, WT>(avx2, std::min(max_mr, M - i0), x, w, bias, y, K, N, i0, j0);
  }
}

// All of y, nr weight rows per tile, tiles split over threads.
template <int64_t nr, typename WT>
void run_tiles(
    bool avx2, const float* x, const WT* w, const float* bias, float* y,
    int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = N / nr;
  const int64_t grain =
      std::max<int64_t>(1, kMinWeightBytesPerTask / (nr * K * int64_t{sizeof(WT)}));
  at::parallel_for(0, tiles + (N % nr != 0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t < tiles) {
        column_tile<nr, WT>(avx2, x, w, bias, y, M, K, N, t * nr);
      } else {  // the last N % nr weight rows
        for (int64_t j = tiles * nr; j < N; ++j) column_tile<1, WT>(avx2, x, w, bias, y, M, K, N, j);
      }
    }
  });
}

#if SPECDEC_X86
// All of y on the AVX-512 path: pairs of weight rows split over threads, each pair used by up
// to 16 x rows per pass; an odd last weight row goes through the AVX2 tile (same bits).
template <typename WT>
void run_tiles_avx512(
    const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t pairs = N / 2;
  const int64_t grain =
      std::max<int64_t>(1, kMinWeightBytesPerTask / (2 * K * int64_t{sizeof(WT)}));
  at::parallel_for(0, pairs + (N % 2), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t < pairs) {
        for (int64_t i0 = 0; i0 < M; i0 += kMaxRowsAvx512) {
          tile_avx512_dispatch<WT>(std::min(kMaxRowsAvx512, M - i0), x, w, bias, y, K, N, i0, 2 * t);
        }
      } else {
        column_tile<1, WT>(/*avx2=*/true, x, w, bias, y, M, K, N, N - 1);
      }
    }
  });
}
#endif

// The paths this CPU supports, for error messages.
std::string skinny_linear_isas() {
  std::string out = "portable";
#if SPECDEC_X86
  if (cpu_has_avx2_fma()) out += ", avx2";
  if (cpu_has_avx512()) out += ", avx512";
#endif
  return out;
}

// From this many x rows on, the AVX-512 path is faster than the AVX2 one (FMA-bound); below it
// the AVX2 path's single weight stream wins (memory-bound).  Measured with
// bench/bench_skinny_linear.py --isa on a 2-core AMD EPYC Zen 5 VM, 1 thread, the target's
// layer shapes, kPrefetchBytes = 8192: AVX-512 / AVX2 time 1.30 at M = 1, 1.06 at 3, 0.99 at 4,
// 0.92 at 5, 0.73 at 9, 0.70-0.73 at 12-16 (with 1,024-byte prefetches the switch was at 9).
// Both give the same bits, so switching on M keeps a row's result independent of M.
constexpr int64_t kMinRowsAvx512 = 5;

// The fastest path this CPU supports for M x rows.
Isa best_isa(int64_t M) {
#if SPECDEC_X86
  if (M >= kMinRowsAvx512 && cpu_has_avx512()) return Isa::kAvx512;
  if (cpu_has_avx2_fma()) return Isa::kAvx2;
#endif
  return Isa::kPortable;
}

at::Tensor skinny_linear_cpu(
    const at::Tensor& x,                    // [..., K] fp32
    const at::Tensor& weight,               // [N, K] fp32
    const c10::optional<at::Tensor>& bias,  // [N] fp32 or None
    std::optional<Isa> path,                // None: the fastest for this CPU and M
    bool one_row_tiles = false) {           // fp16 weights too in tiles of 1 weight row (benchmarks)
  TORCH_CHECK(
      x.scalar_type() == at::kFloat,
      "skinny_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(
      weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kHalf,
      "skinny_linear: weight must be float32 or float16, got ", weight.scalar_type());
  TORCH_CHECK(
      weight.dim() == 2,
      "skinny_linear: weight must have 2 dims [N, K], got ", weight.dim(), " (shape ",
      weight.sizes(), ")");
  TORCH_CHECK(x.dim() >= 1, "skinny_linear: x must have at least 1 dim [..., K], got a scalar");
  const int64_t K = weight.size(1);
  const int64_t N = weight.size(0);
  TORCH_CHECK(
      x.size(-1) == K,
      "skinny_linear: x must be [..., K] with K = weight.size(1) = ", K, ", got last dim ",
      x.size(-1), " (shape ", x.sizes(), ")");
  TORCH_CHECK(
      x.device().is_cpu() && weight.device().is_cpu(),
      "skinny_linear: x and weight must be CPU tensors, got ", x.device(), " and ",
      weight.device());
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(
        bias->scalar_type() == at::kFloat,
        "skinny_linear: bias must be float32, got ", bias->scalar_type());
    TORCH_CHECK(
        bias->dim() == 1 && bias->size(0) == N,
        "skinny_linear: bias must be [N] = [", N, "], got shape ", bias->sizes());
    TORCH_CHECK(bias->device().is_cpu(), "skinny_linear: bias must be a CPU tensor, got ",
                bias->device());
    bias_c = bias->contiguous();
    bias_ptr = bias_c.const_data_ptr<float>();
  }

  const at::Tensor x_c = x.contiguous();       // [M, K] once flattened
  const at::Tensor w_c = weight.contiguous();  // [N, K]
  int64_t M = 1;  // rows: the product of x's leading dims
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());  // [..., N] fp32
  if (y.numel() == 0) {
    return y;
  }
  float* y_ptr = y.mutable_data_ptr<float>();
  if (K == 0) {  // an empty sum: y = bias (or 0)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) y_ptr[i * N + j] = bias_ptr ? bias_ptr[j] : 0.0f;
    return y;
  }
  const float* x_ptr = x_c.const_data_ptr<float>();

  const Isa isa = path.has_value() ? *path : best_isa(M);
  auto run = [&](auto* w_ptr) {
    using WT = std::remove_const_t<std::remove_pointer_t<decltype(w_ptr)>>;
#if SPECDEC_X86
    if (isa == Isa::kAvx512) {
      run_tiles_avx512<WT>(x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
      return;
    }
#endif
    const bool avx2 = isa == Isa::kAvx2;
    if (std::is_same_v<WT, c10::Half> && !one_row_tiles) {
      // fp16 weights: half the bytes per FMA, so one weight row's chain of dependent FMAs (K / 8
      // of them, 4 cycles each) and not the memory sets the time; tiles of several weight rows
      // run independent chains side by side (the Tiles note above).
      if (M <= 3) {
        run_tiles<4, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
        return;
      }
      if (M == 4) {
        run_tiles<2, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
        return;
      }
    }
    run_tiles<1, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
  };
  if (w_c.scalar_type() == at::kHalf) {
    run(w_c.const_data_ptr<c10::Half>());
  } else {
    run(w_c.const_data_ptr<float>());
  }
  return y;
}

at::Tensor skinny_linear(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return skinny_linear_cpu(x, weight, bias, std::nullopt);
}

at::Tensor skinny_linear_portable(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return skinny_linear_cpu(x, weight, bias, Isa::kPortable);
}

// One named path, for tests and benchmarks: "portable", "avx2", "avx512", "auto", or
// "avx2_1row": the AVX2 path with fp16 weights in tiles of one weight row, as before the fp16
// tiles of 4 (the same bits; to compare the two side by side).
at::Tensor skinny_linear_isa(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    c10::string_view isa) {
  Isa chosen;
  if (isa == "auto") {
    return skinny_linear_cpu(x, weight, bias, std::nullopt);
  } else if (isa == "portable") {
    chosen = Isa::kPortable;
  } else if (isa == "avx2" || isa == "avx512" || isa == "avx2_1row") {
    const bool avx512 = isa == "avx512";
    bool supported = false;
#if SPECDEC_X86
    supported = avx512 ? cpu_has_avx512() : cpu_has_avx2_fma();
#endif
    TORCH_CHECK(
        supported, "skinny_linear_isa: isa '", std::string(isa),
        "' is not supported by this CPU (supported: ", skinny_linear_isas(), ")");
    chosen = avx512 ? Isa::kAvx512 : Isa::kAvx2;
  } else {
    TORCH_CHECK(
        false, "skinny_linear_isa: isa must be 'auto', 'portable', 'avx2', 'avx2_1row' or 'avx512', got '",
        std::string(isa), "'");
  }
  return skinny_linear_cpu(x, weight, bias, chosen, isa == "avx2_1row");
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_portable", &skinny_linear_portable);
  m.impl("skinny_linear_isa", &skinny_linear_isa);
}

}  // namespace specdec
