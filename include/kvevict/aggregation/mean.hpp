#pragma once
/// Stage "aggregation" (docs/algorithms.md#aggregation), mean aggregation (SnapKV, AdaKV, CriticalKV): mean over window
/// rows, pool, mean over the GQA group.

#include <vector>

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {

/// Accumulates scores [Hkv, P] of the prefix tokens one query head at a time:
///   s_q = mean_i A[q][i, :P]; s_q = pool(s_q); s[h] = mean over the G query heads of group h.
/// On a ragged layer head h's row holds its P_h scores, then zeros (docs/algorithms.md#ragged).
template <class S>
class MeanAggregator {
 public:
  MeanAggregator(const LayerShape& shape, Index kernel, Pooling pooling)
      : shape_(shape), kernel_(kernel), pooling_(pooling), scores_(RowMatrix<S>::Zero(shape.kv_heads, shape.prefix)) {}

  /// rows [w, L_h]: the softmax rows of query head q. Writes only row q / G (WindowObservation::for_each_head may
  /// add different KV heads concurrently).
  void add(Index q, const RowMatrix<S>& rows) {
    const Index P = rows.cols() - shape_.window;
    const Vector row_mean = rows.leftCols(P).colwise().sum() / static_cast<S>(shape_.window);
    Vector pooled(P);
    pool1d(row_mean.data(), P, kernel_, pooling_, pooled.data());
    scores_.row(q / shape_.group).head(P) += pooled;
  }
  /// Scores [Hkv, P] once every query head was added.
  RowMatrix<S> finish() { return scores_ / static_cast<S>(shape_.group); }

 private:
  LayerShape shape_;
  Index kernel_;
  Pooling pooling_;
  using Vector = Eigen::Matrix<S, 1, Eigen::Dynamic>;
  RowMatrix<S> scores_;
};

/// Mean-aggregated scores [Hkv, P] of a layer (streams over query heads: extra memory O(w L + P)).
template <class S, class KV, class Q>
RowMatrix<S> mean_scores(const WindowObservation<S, KV, Q>& obs, Index kernel, Pooling pooling) {
  MeanAggregator<S> agg(obs.shape(), kernel, pooling);
  obs.for_each_head([&](Index q, const RowMatrix<S>& rows) { agg.add(q, rows); });
  return agg.finish();
}

}  // namespace kvevict::extend
