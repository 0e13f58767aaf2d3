// at::parallel_for for this extension's CPU kernels, on torch's intra-op thread count.
//
// at::parallel_for is a header template: with torch's OpenMP backend its `#pragma omp parallel`
// is compiled into this extension (setup.py passes -fopenmp) and uses the OpenMP runtime this
// extension is linked against.  setup.py links the libgomp torch ships (libgomp.so.1 in its CPU
// wheels, libgomp-<hash>.so.1 in some CUDA ones), whose team size torch.set_num_threads sets.
// Built against another libgomp (none found in torch/lib), the extension would have a second
// runtime that never hears of torch.set_num_threads and would start one thread per core.  So the
// team size is set here from torch's own count before each parallel loop (a no-op when they agree).
#pragma once

#include <ATen/Parallel.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>

namespace specdec {

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef _OPENMP
  const int n = at::get_num_threads();
  if (!at::in_parallel_region() && omp_get_max_threads() != n) omp_set_num_threads(n);
#endif
  at::parallel_for(begin, end, grain, f);
}

}  // namespace specdec
