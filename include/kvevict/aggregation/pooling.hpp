#pragma once
/// Stage "pooling" (docs/algorithms.md#pooling): 1-D pooling along the tokens (kernel k odd, stride 1, padding k/2).

#include <algorithm>

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

enum class Pooling {
  avg,  ///< sum of the in-range neighbourhood / k (padding counts as zeros, count_include_pad)
  max   ///< max over the in-range neighbourhood
};

inline const char* to_string(Pooling p) { return p == Pooling::avg ? "avg" : "max"; }

}  // namespace kvevict

namespace kvevict::extend {

/// out[j] = pool(in[j - k/2 .. j + k/2] clipped to [0, n)), j in [0, n); in and out must not alias.
/// Each out[j] is the left-to-right sum (then / k) or maximum of its neighbourhood, in that order. O(n k): kernels
/// are small (5 and 7 in the papers); the interior entries are computed k shifted vectors at a time (the same
/// operations in the same order for each entry, so the same bits as one entry at a time).
template <class S>
void pool1d(const S* in, Index n, Index kernel, Pooling pooling, S* out) {
  KVEVICT_ASSERT(kernel >= 1 && kernel % 2 == 1 && in != out);
  const Index half = kernel / 2;
  const auto one_entry = [&](Index j) {
    const Index lo = std::max<Index>(0, j - half), hi = std::min<Index>(n - 1, j + half);
    S acc = in[lo];
    for (Index t = lo + 1; t <= hi; ++t) acc = pooling == Pooling::avg ? acc + in[t] : std::max(acc, in[t]);
    out[j] = pooling == Pooling::avg ? acc / static_cast<S>(kernel) : acc;
  };
  const Index interior = n - 2 * half;  // entries j in [half, n - half): all k neighbours in range
  if (interior <= 0) {
    for (Index j = 0; j < n; ++j) one_entry(j);
    return;
  }
  for (Index j = 0; j < half; ++j) one_entry(j);
  for (Index j = n - half; j < n; ++j) one_entry(j);
  using Vector = Eigen::Array<S, Eigen::Dynamic, 1>;
  Eigen::Map<Vector> acc(out + half, interior);  // acc[i] = pool of in[i .. i + k - 1] = out[i + half]
  acc = Eigen::Map<const Vector>(in, interior);
  for (Index t = 1; t < kernel; ++t) {
    const Eigen::Map<const Vector> next(in + t, interior);
    if (pooling == Pooling::avg)
      acc += next;
    else
      acc = (acc < next).select(next, acc);  // std::max(acc, next): acc unless next is larger
  }
  if (pooling == Pooling::avg) acc /= static_cast<S>(kernel);
}

}  // namespace kvevict::extend
