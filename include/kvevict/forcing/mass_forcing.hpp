#pragma once
/// Stage 2.6, cumulative-attention-mass forcing (DefensiveKV, arXiv 2510.13334): each KV head always keeps the
/// smallest set of prefix tokens holding tau of its (unpooled) attention mass, up to a cap.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kvevict/observation/window_attention.hpp"

namespace kvevict {

/// Accumulates, one query head at a time, what the mass forcing needs:
///   p[h]        [P]  sum over the G query heads and w rows of A[q][i, :P] (normalised in forced_tokens)
///   window_bias      mean over query heads and rows of the mass the window puts on itself (corrected), or,
///                    under reference_quirks, of the mass on the prefix tokens [P - w, P) (the reference slices
///                    the window off before summing)
template <class S>
class MassStatistics {
 public:
  MassStatistics(const LayerShape& shape, bool reference_quirks)
      : shape_(shape), quirks_(reference_quirks), mass_(RowMatrix<S>::Zero(shape.kv_heads, shape.prefix)) {}

  void add(Index q, const RowMatrix<S>& rows) {
    const Index P = shape_.prefix, w = shape_.window;
    mass_.row(q / shape_.group) += rows.leftCols(P).colwise().sum();
    if (quirks_) {
      const Index first = std::max<Index>(0, P - w);
      bias_sum_ += static_cast<double>(rows.middleCols(first, P - first).sum());
    } else {
      bias_sum_ += static_cast<double>(rows.rightCols(w).sum());
    }
  }

  /// Mean over query heads and window rows of the window's self-mass (or the quirk's prefix-tail mass).
  double window_bias() const {
    return bias_sum_ / static_cast<double>(shape_.query_heads * shape_.window);
  }

  /// Forced prefix tokens of head h: sort p[h] / sum(p[h]) descending (ties: the more recent token first); with c
  /// the cumulative sum, k = the first index where c >= tau (0 if never; the token there is not included);
  /// k = min(k, cap). A negative k (only under reference_quirks, where cap = int(P (1 - cr) - w)) means "all but
  /// the last |k|" of the sorted order, as Python slicing does.
  std::vector<Index> forced_tokens(Index h, double tau, Index cap) const {
    const Index P = shape_.prefix;
    std::vector<Index> order(static_cast<std::size_t>(P));
    std::iota(order.begin(), order.end(), Index{0});
    const auto p = mass_.row(h);
    std::sort(order.begin(), order.end(), [&](Index a, Index b) { return p(a) != p(b) ? p(a) > p(b) : a > b; });
    const S total = p.sum();
    Index k = 0;
    if (total > S(0)) {
      S c = 0;
      for (k = 0; k < P; ++k) {
        c += p(order[static_cast<std::size_t>(k)]) / total;
        if (static_cast<double>(c) >= tau) break;
      }
      if (k == P) k = 0;  // never reached
    }
    k = std::min(k, cap);
    if (k < 0) k = std::max<Index>(0, P + k);
    order.resize(static_cast<std::size_t>(k));
    return order;
  }

 private:
  LayerShape shape_;
  bool quirks_;
  RowMatrix<S> mass_;
  double bias_sum_ = 0;
};

}  // namespace kvevict
