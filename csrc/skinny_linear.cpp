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
// give the fp32 result bit for bit from half the bytes: the embedded draft is stored in fp16),
// or int8 (widened exactly to fp32 as well: y = x @ w^T over the integer values, the same
// arithmetic from a quarter of the bytes; a caller applies its per-row scales afterwards, as the
// feature draft's int8 output layer does: use_skinny_linear(int8_weights=True) in
// specdec_kernels/cpu/skinny_linear.py).
//
// Memory traffic: reads N*K*4 bytes of weight (N*K*2 in fp16, N*K in int8; once, the floor: every weight is needed), M*K*4
// of x (from cache, M rows are reused for every weight block) and N*4 of bias; writes M*N*4.
// Arithmetic: 2*M*N*K flops, so for M <= ~16 rows on a single AVX2 core the weight stream, not
// the FMAs, sets the time.
//
// Batch invariance: y[i, j] is computed by the same sequence of floating-point operations
// whatever M is and wherever row i sits in x: 16 lane accumulators over k = 0, 16, 32, ... with
// fused multiply-adds (lane l takes k = l, l + 16, ...), a fixed pairwise reduction of the 16
// lanes (reduce16), then the k tail (K % 16) with fused multiply-adds in order, then + bias[j].
// So a row's logits are bit-identical whether the target sees it alone (a decode step) or among
// K+1 verified positions, and the result does not depend on the thread count.  It is not
// bit-identical to torch.nn.functional.linear (whose summation order is MKL's); the tests bound
// the difference against a float64 reference.
//
// Why 16 lanes and not 8: each lane is a chain of K / 16 dependent FMAs.  With 8 lanes (one AVX2
// register per weight row, this kernel's first order) the chain was K / 8 FMAs long, and
// with 3 x rows the loop over one weight row grew too long for out-of-order execution to start
// the next row's chain while the last ones finished: on the Zen 5 VM (1 thread, the target's 211
// matrices, 538 MB; bench_skinny_linear.py --isa) 3 rows took 17.5 ms against 15.1 for one,
// where the stream alone allows about 13.4 ms (torch.sum over as many bytes).  Two registers per
// weight row (lanes 0-7 and 8-15) halve the chain: 3 rows 15.9 ms, one row 15.4 (side by side
// with the 8-lane build: 3 rows 0.92x its time, one row 1.02x).
//
// Three code paths with the same arithmetic, selected at run time: AVX-512 (F), AVX2+FMA+F16C
// and portable C++ (std::fma on 16 explicit lanes).  All give the same bits.  The AVX-512 path
// holds a weight row's 16 lanes in one register and two weight rows per tile, so each FMA
// instruction does the work of two AVX2 ones and up to 12 x rows share one pass.  It wins once
// the FMAs, not the weight stream, set the time: from kMinRowsAvx512 x rows (a verify of several
// drafts, or a batch); with fewer rows the AVX2 path is faster.  Since the bits are the same,
// choosing the path by M keeps every row's result independent of M.
#include "parallel.h"
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
#include <limits>
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

// Tiles: nr weight rows x mr x rows, two AVX2 accumulators (16 lanes) per pair, mr * nr <= 6.
// fp32 weights run nr = 1: one weight row at a time, used by up to 6 x rows while it is in
// registers (one pass over the weights for M <= 6 on the AVX2 path; a single prefetched
// stream).  Measured on the AVX2 EPYC (bench_skinny_linear.py), that beat 2, 4
// or 8 weight rows per tile at every M from 1 to 16 (fewer concurrent streams for the
// prefetcher); on the Zen 5 VM too.  fp16 weights (the embedded drafts) carry half the bytes per
// FMA, so there one weight row's chain of K / 16 dependent FMAs, not the memory, can set the
// time, and tiles of several weight rows run independent chains side by side (see
// fp16_tile_rows below).  The tile shape never changes the arithmetic of an output element.
// About 256 KiB of weights per parallel task: small enough to split a 576 x 576 matrix over
// two threads, large enough that a thread wake-up (~10 us) is not the cost.  (Until setup.py
// passed -fopenmp the tasks all ran on the calling thread: csrc/parallel.h.  With two threads on
// the Zen 5 VM the target's 113 MB output layer takes 2.2 ms for one row against 2.9 ms with
// one, 16 rows 2.9-3.5 ms against 5.9-6.0.)
constexpr int64_t kMinWeightBytesPerTask = int64_t{256} * 1024;
// Software prefetch distance on each weight row (both SIMD paths; past a row's end it reaches
// into the next rows, which are next in memory).  Measured on the 2-core AMD EPYC Zen 5 VM, 1 thread,
// the embedded target's layers (538 MB): 1,024 bytes streamed them at 28 GB/s (19.1 ms for one
// row); 8,192 at 34 GB/s (15.9 ms); 16,384 and 32,768 no better; 512 worse (22 ms).  With many
// rows (the AVX-512 path at M = 9) it matters more: 42.7 -> 25.8 ms.  A prefetch never changes
// the arithmetic, so the bits are the same at any distance.
constexpr int64_t kPrefetchBytes = 8192;
// Lanes per output element (the arithmetic above).
constexpr int64_t kLanes = 16;

// The 16-lane reduction, written once for every path:
// t[i] = l[i] + l[i + 8] (i < 8), then ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)).
inline float reduce16(const float* l) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = l[i] + l[i + 8];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

// Weights are fp32, or fp16 widened exactly to fp32 as they are loaded (half the bytes to
// stream; use_skinny_linear picks fp16 only for weights that fp16 holds exactly, so both give
// the same bits).
inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

// A NaN result as the one quiet NaN: which operand's NaN (sign, payload) an x86 FMA passes on
// depends on the instruction form the compiler picked for a tile shape, and std::fma differs
// again, so without this a NaN's bits would depend on the path and the row count.
inline float canonical_nan(float s) { return s != s ? std::numeric_limits<float>::quiet_NaN() : s; }

// The end of one output element, the same on every path: reduce the 16 lanes, the k tail
// (K % 16) in order with fused multiply-adds, the bias.
template <typename WT>
inline float finish(const float* lanes, const float* xr, const WT* wr, int64_t K16, int64_t K,
                    const float* bias, int64_t j) {
  float s = reduce16(lanes);
  for (int64_t k = K16; k < K; ++k) s = std::fma(xr[k], to_float(wr[k]), s);
  if (bias != nullptr) s += bias[j];
  return canonical_nan(s);
}

// y[i, j] for i in [i0, i0 + mr), j in [j0, j0 + nr): portable path.
template <int64_t mr, int64_t nr, typename WT>
void tile_portable(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  float acc[mr][nr][kLanes];
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b)
      for (int l = 0; l < kLanes; ++l) acc[a][b][l] = 0.0f;
  const int64_t K16 = K - K % kLanes;
  for (int64_t k = 0; k < K16; k += kLanes) {
    for (int64_t a = 0; a < mr; ++a) {
      const float* xr = x + (i0 + a) * K + k;
      for (int64_t b = 0; b < nr; ++b) {
        const WT* wr = w + (j0 + b) * K + k;
        for (int l = 0; l < kLanes; ++l) acc[a][b][l] = std::fma(xr[l], to_float(wr[l]), acc[a][b][l]);
      }
    }
  }
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b)
      y[(i0 + a) * N + j0 + b] =
          finish(acc[a][b], x + (i0 + a) * K, w + (j0 + b) * K, K16, K, bias, j0 + b);
}

#if SPECDEC_X86
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* w) {
  return _mm256_loadu_ps(w);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const c10::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// reduce16 in registers, the same adds in the same order (IEEE addition is exact to reorder only
// between its two operands, which is all this does): t = lo + hi is t[i] = l[i] + l[i + 8];
// u[i] = t[i] + t[i + 4]; v[0] = u[0] + u[2], v[1] = u[1] + u[3]; v[0] + v[1].
__attribute__((target("avx2,fma,f16c"))) inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// The end of one output element from its lanes in registers (see finish).
template <typename WT>
__attribute__((target("avx2,fma,f16c"))) inline float finish(
    __m256 lo, __m256 hi, const float* xr, const WT* wr, int64_t K16, int64_t K,
    const float* bias, int64_t j) {
  float s = reduce16(lo, hi);
  for (int64_t k = K16; k < K; ++k) s = std::fma(xr[k], to_float(wr[k]), s);
  if (bias != nullptr) s += bias[j];
  return canonical_nan(s);
}

// Half h (lanes 8h .. 8h + 7) of one 16-lane step at k: the same per-lane order as the portable
// path.  The two halves go to separate registers, so each weight row runs two independent
// chains; one half at a time keeps the live registers at 2 * mr * nr accumulators + nr weights + 1.
template <int64_t mr, int64_t nr, typename WT>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void half_step(
    __m256 (&acc)[mr][nr][2], const float* x, const WT* w, int64_t K, int64_t i0, int64_t j0,
    int64_t k, int h) {
  __m256 wv[nr];
  for (int64_t b = 0; b < nr; ++b) wv[b] = load8(w + (j0 + b) * K + k + 8 * h);
  for (int64_t a = 0; a < mr; ++a) {
    __m256 xv = _mm256_loadu_ps(x + (i0 + a) * K + k + 8 * h);
    if constexpr (nr > 1) asm("" : "+x"(xv));  // one load of x for all nr rows (tile_avx512)
    for (int64_t b = 0; b < nr; ++b) acc[a][b][h] = _mm256_fmadd_ps(xv, wv[b], acc[a][b][h]);
  }
}

template <int64_t mr, int64_t nr, typename WT>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  __m256 acc[mr][nr][2];
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b) acc[a][b][0] = acc[a][b][1] = _mm256_setzero_ps();
  const int64_t K16 = K - K % kLanes;
  // With many x rows the loop body is long, so out-of-order execution alone keeps few weight
  // cache lines in flight; prefetching kPrefetchBytes ahead on every weight row keeps the
  // memory stream busy while the FMAs run (past a row's end it fetches the next tile's rows,
  // which are next in memory).
  constexpr int64_t pf = kPrefetchBytes / int64_t{sizeof(WT)};
  for (int64_t k = 0; k < K16; k += kLanes) {
    for (int64_t b = 0; b < nr; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j0 + b) * K + k + pf), _MM_HINT_T0);
    }
    half_step<mr, nr, WT>(acc, x, w, K, i0, j0, k, 0);
    half_step<mr, nr, WT>(acc, x, w, K, i0, j0, k, 1);
  }
  for (int64_t a = 0; a < mr; ++a) {
    for (int64_t b = 0; b < nr; ++b) {
      y[(i0 + a) * N + j0 + b] = finish(acc[a][b][0], acc[a][b][1], x + (i0 + a) * K,
                                        w + (j0 + b) * K, K16, K, bias, j0 + b);
    }
  }
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// AVX-512: a weight row's 16 lanes in one register.
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 load16(const float* w) {
  return _mm512_loadu_ps(w);
}
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 load16(const c10::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// y[i, j] for i in [i0, i0 + mr), j in [j0, j0 + nr): per output element exactly the arithmetic
// of tile_avx2 / tile_portable (16 lanes over k in steps of 16, reduce16, the tail, the bias).
template <int64_t mr, int64_t nr, typename WT>
__attribute__((target("avx512f,avx2,fma,f16c"))) void tile_avx512(
    const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  __m512 acc[mr][nr];
  for (int64_t a = 0; a < mr; ++a)
    for (int64_t b = 0; b < nr; ++b) acc[a][b] = _mm512_setzero_ps();
  const int64_t K16 = K - K % kLanes;
  constexpr int64_t pf = kPrefetchBytes / int64_t{sizeof(WT)};
  for (int64_t k = 0; k < K16; k += kLanes) {
    __m512 wv[nr];
    for (int64_t b = 0; b < nr; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j0 + b) * K + k + pf), _MM_HINT_T0);
      wv[b] = load16(w + (j0 + b) * K + k);
    }
    for (int64_t a = 0; a < mr; ++a) {
      __m512 xv = _mm512_loadu_ps(x + (i0 + a) * K + k);
      // Load x once into a register for all nr weight rows: without this GCC folds the load
      // into each FMA, and nr loads of x per weight vector made 9 rows 20% slower.
      if constexpr (nr > 1) asm("" : "+v"(xv));
      for (int64_t b = 0; b < nr; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int64_t a = 0; a < mr; ++a) {
    for (int64_t b = 0; b < nr; ++b) {
      const __m512 v = acc[a][b];
      y[(i0 + a) * N + j0 + b] = finish(
          _mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
          x + (i0 + a) * K, w + (j0 + b) * K, K16, K, bias, j0 + b);
    }
  }
}

bool cpu_has_avx512() {
  static const bool has = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f");
  return has;
}

// Weight rows per AVX-512 tile, and x rows per pass over them (24 accumulators, 2 weights and
// one x vector of the 32 registers).  Two weight rows share each x load (the Zen 5 VM, the
// target's matrices: with one weight row per tile 9 x rows took 29.4 ms, with two 21.7 ms).
constexpr int64_t kAvx512TileRows = 2;
constexpr int64_t kMaxRowsAvx512 = 12;

template <int64_t nr, typename WT, int64_t mr = kMaxRowsAvx512>
void tile_avx512_dispatch(
    int64_t m, const float* x, const WT* w, const float* bias, float* y,
    int64_t K, int64_t N, int64_t i0, int64_t j0) {
  if constexpr (mr >= 1) {
    if (m == mr) {
      tile_avx512<mr, nr, WT>(x, w, bias, y, K, N, i0, j0);
      return;
    }
    if constexpr (mr > 1) {
      tile_avx512_dispatch<nr, WT, mr - 1>(m, x, w, bias, y, K, N, i0, j0);
    }
  }
}
#endif

// Which code path runs; every path gives the same bits.
enum class Isa { kPortable, kAvx2, kAvx512 };

// Accumulator pairs per AVX2 tile: mr * nr <= 6, so 12 accumulators, nr weights and one x
// vector fit the 16 AVX2 registers.
constexpr int64_t kAvx2Pairs = 6;

// Runs tile<mr, nr> with a run-time mr in [1, kAvx2Pairs / nr].
template <int64_t nr, typename WT, int64_t mr = kAvx2Pairs / nr>
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

// All M rows of y for weight rows [j0, j0 + nr).  With M <= kAvx2Pairs / nr the weight tile is
// read from memory in one pass while every x row uses it; for more rows it is re-read from L1.
template <int64_t nr, typename WT>
void column_tile(
    bool avx2, const float* x, const WT* w, const float* bias, float* y,
    int64_t M, int64_t K, int64_t N, int64_t j0) {
  constexpr int64_t max_mr = kAvx2Pairs / nr;
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
  specdec::parallel_for(0, tiles + (N % nr != 0), grain, [&](int64_t begin, int64_t end) {
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
// All of y on the AVX-512 path: tiles of nr weight rows split over threads, each used by up to
// kMaxRowsAvx512 x rows per pass; the last N % nr weight rows in tiles of one.
template <int64_t nr, typename WT>
void run_tiles_avx512(
    const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = N / nr;
  const int64_t grain =
      std::max<int64_t>(1, kMinWeightBytesPerTask / (nr * K * int64_t{sizeof(WT)}));
  specdec::parallel_for(0, tiles + (N % nr != 0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i0 = 0; i0 < M; i0 += kMaxRowsAvx512) {
        const int64_t m = std::min(kMaxRowsAvx512, M - i0);
        if (t < tiles) {
          tile_avx512_dispatch<nr, WT>(m, x, w, bias, y, K, N, i0, t * nr);
        } else {
          for (int64_t j = tiles * nr; j < N; ++j) tile_avx512_dispatch<1, WT>(m, x, w, bias, y, K, N, i0, j);
        }
      }
    }
  });
}
#endif

// Weight rows per AVX2 tile for fp16 weights and M x rows (kAvx2Pairs / nr x rows per pass).
// Measured against the 8-lane kernel (tiles of 4 weight rows for M <= 3, 2 at M = 4, the AVX-512
// path from 5), both built side by side, 1 thread, the Zen 5 VM, all layers of the draft model
// (hidden 192) / of the feature draft (hidden 576) but their output layers, hot in cache, us:
// M = 1 31 / 104 against 34 / 116; 2 45 / 145 against 42 / 139; 3 51 / 173 against 70 / 303;
// 4 70 / 256 against 72 / 279; 5 79 / 292 against 76 / 272; 6 86 / 319 against 89 / 313.  One-row
// tiles at M = 5-6 were 10-25% slower, tiles of 4 at M = 2 (two passes) 10-20% slower.
int64_t fp16_tile_rows(int64_t M) {
  if (M == 1) return 4;
  if (M <= 6) return 2;
  return 1;
}

// The paths this CPU supports, for error messages.
std::string skinny_linear_isas() {
  std::string out = "portable";
#if SPECDEC_X86
  if (cpu_has_avx2_fma()) out += ", avx2";
  if (cpu_has_avx512()) out += ", avx512";
#endif
  return out;
}

// From this many x rows on, the AVX-512 path is faster than the AVX2 one; which rows that is
// depends on the core.  Both give the same bits, so switching on M (or on the CPU) keeps a row's
// result independent of M.
// - AMD (and any CPU not Intel's): 7.  bench/cpu/bench_skinny_linear.py --isa on a 2-core AMD
//   EPYC Zen 5 VM, 1 thread, the embedded target's layers (2026-12-01): AVX-512 / AVX2 time 1.21
//   at M = 1, 1.27 at 3, 1.20 at 5, 1.06 at 6, 0.90 at 7, 0.68 at 9, 0.58-0.59 at 12-16 (below 7
//   rows the AVX2 path's one weight stream per tile is the faster one there).
// - Intel: 1.  bench_skinny_linear.py --isa on a 2-core Intel Xeon (AVX-512) VM, 2 threads, the
//   same layers (2026-12-06, bench/results/cpu-xeon/skinny_20261206): AVX-512 / AVX2 time 0.87 at
//   M = 1, 0.75 at 2, 0.78 at 3, 0.90 at 5, 0.87 at 9, 0.77 at 16 (the AVX-512 path streams 26-29
//   GB/s from 1 to 3 rows, as fast as MKL's one-row SGEMV).
constexpr int64_t kMinRowsAvx512 = 7;
constexpr int64_t kMinRowsAvx512Intel = 1;

bool cpu_is_intel() {
#if SPECDEC_X86
  static const bool is = __builtin_cpu_is("intel");
  return is;
#else
  return false;
#endif
}

int64_t min_rows_avx512() { return cpu_is_intel() ? kMinRowsAvx512Intel : kMinRowsAvx512; }

// The fastest path this CPU supports for M x rows.
Isa best_isa(int64_t M) {
#if SPECDEC_X86
  if (M >= min_rows_avx512() && cpu_has_avx512()) return Isa::kAvx512;
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
      weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kHalf ||
          weight.scalar_type() == at::kChar,
      "skinny_linear: weight must be float32, float16 or int8, got ", weight.scalar_type());
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
      for (int64_t j = 0; j < N; ++j) y_ptr[i * N + j] = bias_ptr ? canonical_nan(bias_ptr[j]) : 0.0f;
    return y;
  }
  const float* x_ptr = x_c.const_data_ptr<float>();

  const Isa isa = path.has_value() ? *path : best_isa(M);
  auto run = [&](auto* w_ptr) {
    using WT = std::remove_const_t<std::remove_pointer_t<decltype(w_ptr)>>;
#if SPECDEC_X86
    if (isa == Isa::kAvx512) {
      run_tiles_avx512<kAvx512TileRows, WT>(x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
      return;
    }
#endif
    const bool avx2 = isa == Isa::kAvx2;
    if (!std::is_same_v<WT, float> && !one_row_tiles) {
      // fp16 (and int8) weights: half (a quarter of) the bytes per FMA, so one weight row's
      // chains of dependent FMAs (K / 16 each), not the memory, can set the time; tiles of
      // several weight rows run independent chains side by side (fp16_tile_rows).
      switch (fp16_tile_rows(M)) {
        case 4:
          run_tiles<4, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
          return;
        case 2:
          run_tiles<2, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
          return;
        default:
          break;
      }
    }
    run_tiles<1, WT>(avx2, x_ptr, w_ptr, bias_ptr, y_ptr, M, K, N);
  };
  if (w_c.scalar_type() == at::kHalf) {
    run(w_c.const_data_ptr<c10::Half>());
  } else if (w_c.scalar_type() == at::kChar) {
    run(w_c.const_data_ptr<int8_t>());
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
// "avx2_1row": the AVX2 path with fp16 weights in tiles of one weight row instead of
// fp16_tile_rows' (the same bits; to compare the two side by side).
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

// The path "auto" takes for `rows` x rows on this CPU: "portable", "avx2" or "avx512".
std::string skinny_linear_auto_isa(int64_t rows) {
  TORCH_CHECK(rows >= 1, "skinny_linear_auto_isa: rows must be >= 1, got ", rows);
  switch (best_isa(rows)) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("skinny_linear_auto_isa(int rows) -> str", &skinny_linear_auto_isa);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_portable", &skinny_linear_portable);
  m.impl("skinny_linear_isa", &skinny_linear_isa);
}

}  // namespace specdec
