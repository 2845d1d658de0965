#pragma once
/// Stage 2.2: 1-D pooling along the token axis (kernel k odd, stride 1, padding k/2).

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
/// O(n k): kernels are small (5 and 7 in the papers).
template <class S>
void pool1d(const S* in, Index n, Index kernel, Pooling pooling, S* out) {
  KVEVICT_ASSERT(kernel >= 1 && kernel % 2 == 1 && in != out);
  const Index half = kernel / 2;
  for (Index j = 0; j < n; ++j) {
    const Index lo = std::max<Index>(0, j - half), hi = std::min<Index>(n - 1, j + half);
    S acc = in[lo];
    for (Index t = lo + 1; t <= hi; ++t) acc = pooling == Pooling::avg ? acc + in[t] : std::max(acc, in[t]);
    out[j] = pooling == Pooling::avg ? acc / static_cast<S>(kernel) : acc;
  }
}

}  // namespace kvevict::extend
