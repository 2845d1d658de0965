#pragma once
/// Optional multithreading over heads. Off unless the user opts in: define KVEVICT_OPENMP and compile with OpenMP
/// (-fopenmp; the CMake option KVEVICT_OPENMP does both for this tree's targets). Each parallel loop gives every
/// index its own outputs and a fixed order of work, so results are bit-identical to single-threaded ones for any
/// thread count. Inside an enclosing parallel region (an engine already threading over layers) loops run serially.

#include <exception>

#include "kvevict/core/config.hpp"
#include "kvevict/core/views.hpp"

#if defined(KVEVICT_OPENMP)
#if !defined(_OPENMP)
#error "KVEVICT_OPENMP is defined but OpenMP is not enabled: compile with -fopenmp (CMake: OpenMP::OpenMP_CXX)"
#endif
#include <omp.h>
#endif

namespace kvevict::detail {
inline namespace KVEVICT_ABI_NAMESPACE {

/// Calls f(i, scratch) for i in [0, n): on OpenMP threads when enabled, else in order. Each thread default-constructs
/// one Scratch and reuses it for all its indices (work buffers allocated once per thread, not per index). If calls
/// throw, the exception of the lowest such i is rethrown after every call has finished (never std::terminate from
/// inside a parallel region).
template <class Scratch, class F>
void parallel_for_with(Index n, F&& f) {
#if defined(KVEVICT_OPENMP)
  if (n > 1 && !omp_in_parallel()) {
    std::exception_ptr error;
    Index error_at = n;
#pragma omp parallel
    {
      Scratch scratch;
#pragma omp for schedule(static)
      for (Index i = 0; i < n; ++i) {
        try {
          f(i, scratch);
        } catch (...) {
#pragma omp critical(kvevict_parallel_for_error)
          if (i < error_at) {
            error_at = i;
            error = std::current_exception();
          }
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  Scratch scratch;
  for (Index i = 0; i < n; ++i) f(i, scratch);
}

/// parallel_for_with without scratch: f(i).
template <class F>
void parallel_for(Index n, F&& f) {
  struct None {};
  parallel_for_with<None>(n, [&](Index i, None&) { f(i); });
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::detail
