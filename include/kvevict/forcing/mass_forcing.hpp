#pragma once
/// Stage "forcing" (docs/algorithms.md#forcing), cumulative-attention-mass forcing (DefensiveKV, arXiv 2510.13334):
/// each KV head always keeps the smallest set of prefix tokens holding tau of its unpooled attention mass, up to a cap.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {

/// Accumulates, one query head at a time, what the mass forcing needs:
///   p[h]        [P]  sum over the G query heads and w rows of A[q][i, :P] (normalised in forced_tokens)
///   window_bias      mean over query heads and rows of the mass the window puts on itself (corrected), or,
///                    under reference_quirks, of the mass on the prefix tokens [P - w, P) (the reference slices
///                    the window off before summing)
template <class S>
class MassStatistics {
 public:
  MassStatistics(const LayerShape& shape, bool reference_quirks)
      : shape_(shape),
        quirks_(reference_quirks),
        mass_(RowMatrix<S>::Zero(shape.kv_heads, shape.prefix)),
        bias_(static_cast<std::size_t>(shape.query_heads), 0.0) {}

  /// rows [w, L_h]: the softmax rows of query head q. Writes only row q / G of p and entry q of the bias sums
  /// (WindowObservation::for_each_head may add different KV heads concurrently).
  void add(Index q, const RowMatrix<S>& rows) {
    const Index w = shape_.window, P = rows.cols() - w;
    mass_.row(q / shape_.group).head(P) += rows.leftCols(P).colwise().sum();
    const Index first = quirks_ ? std::max<Index>(0, P - w) : P, last = quirks_ ? P : P + w;
    bias_[static_cast<std::size_t>(q)] = static_cast<double>(rows.middleCols(first, last - first).sum());
  }

  /// Mean over query heads and window rows of the window's self-mass (or the quirk's prefix-tail mass), summed in
  /// query-head order whatever the order of add().
  double window_bias() const {
    double sum = 0;
    for (double b : bias_) sum += b;
    return sum / static_cast<double>(shape_.query_heads * shape_.window);
  }
  /// The terms window_bias() sums [H]: query head q's.
  const std::vector<double>& window_bias_terms() const { return bias_; }

  /// Forced prefix tokens of head h: sort p[h] / sum(p[h]) descending (ties: the more recent token first); with c
  /// the cumulative sum, k = the first index where c >= tau (0 if never; the token there is not included);
  /// k = min(k, cap). A negative k (only under reference_quirks, where cap = int(P (1 - cr) - w)) means "all but
  /// the last |k|" of the sorted order, as Python slicing does.
  std::vector<Index> forced_tokens(Index h, double tau, Index cap) const {
    const Index P = shape_.prefix_of(h);
    const auto p = mass_.row(h).head(P);
    RankedPrefix ranked(p.data(), P);
    const S total = p.sum();
    Index k = 0;
    if (total > S(0)) {
      // c only grows (terms >= 0), so tau is reached iff the final c reaches it. When an error bound on the float
      // sum decides that up front, the walk stops at the cap: ranking cap tokens instead of P.
      const Index limit = surely_reached(p, total, tau) ? std::max<Index>(0, std::min(cap, P)) : P;
      S c = 0;
      for (k = 0; k < limit; ++k) {
        c += p(ranked.at(k)) / total;
        if (static_cast<double>(c) >= tau) break;
      }
      if (k == limit && limit == P) k = 0;  // never reached (when surely reached, k >= cap and min(k, cap) = cap)
    }
    k = std::min(k, cap);
    if (k < 0) k = std::max<Index>(0, P + k);
    return ranked.first(k);
  }

 private:
  /// True when sum_j fl(p_j / total), added in float in any order, certainly ends >= tau: the exact sum T (in
  /// double) minus the bound gamma_P * T on the rounding error of a P-term float sum.
  template <class Row>
  static bool surely_reached(const Row& p, S total, double tau) {
    double exact = 0;
    for (Index j = 0; j < p.size(); ++j) exact += static_cast<double>(p(j) / total);
    const double nu = static_cast<double>(p.size()) * std::numeric_limits<S>::epsilon() / 2;
    if (nu >= 0.5) return false;
    const double gamma = nu / (1 - nu);
    return exact - 2 * gamma * exact - 1e-9 >= tau;  // 2 gamma: the double sum has its own (smaller) error
  }

  /// The tokens [0, P) ranked by mass p descending, ties to the more recent token, produced lazily: each new
  /// chunk (growing 4x) is nth_element + sort of the rest, so reading the first n costs O(P + n log n)
  /// instead of a full sort of P (the mass threshold is usually reached long before P).
  class RankedPrefix {
   public:
    RankedPrefix(const S* p, Index P) : order_(static_cast<std::size_t>(P)), before_{p} {
      std::iota(order_.begin(), order_.end(), Index{0});
    }
    /// The token of rank r (r < P).
    Index at(Index r) {
      if (r >= ranked_) rank_up_to(std::max<Index>({r + 1, 4 * ranked_, 256}));
      return order_[static_cast<std::size_t>(r)];
    }
    /// The n best tokens, in ranking order.
    std::vector<Index> first(Index n) {
      rank_up_to(n);
      return {order_.begin(), order_.begin() + n};
    }

   private:
    void rank_up_to(Index n) {
      n = std::min<Index>(n, static_cast<Index>(order_.size()));
      if (n <= ranked_) return;
      const auto first = order_.begin() + ranked_, mid = order_.begin() + n;
      if (mid != order_.end()) std::nth_element(first, mid, order_.end(), before_);
      std::sort(first, mid, before_);
      ranked_ = n;
    }
    struct Before {
      const S* p;
      bool operator()(Index a, Index b) const { return p[a] != p[b] ? p[a] > p[b] : a > b; }
    };
    std::vector<Index> order_;
    Before before_;
    Index ranked_ = 0;
  };

  LayerShape shape_;
  bool quirks_;
  RowMatrix<S> mass_;
  std::vector<double> bias_;  // [H] the mass each query head's window rows put on the bias columns
};

}  // namespace kvevict::extend
