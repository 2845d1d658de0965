#pragma once
/// Stage 2.3, mean aggregation (SnapKV, AdaKV, CriticalKV): mean over window rows, pool, mean over the GQA group.

#include <vector>

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict {

/// Scores [Hkv, P] of the prefix tokens: s_q = mean_i A[q][i, :P]; s_q = pool(s_q); s[h] = mean over the G query
/// heads of group h. Streams over query heads (extra memory O(w L + P)).
template <class S, class T>
RowMatrix<S> mean_scores(const WindowObservation<S, T>& obs, Index kernel, Pooling pooling) {
  const LayerShape& s = obs.shape();
  RowMatrix<S> scores = RowMatrix<S>::Zero(s.kv_heads, s.prefix);
  Eigen::Matrix<S, 1, Eigen::Dynamic> row_mean(s.prefix), pooled(s.prefix);
  obs.for_each_head([&](Index q, const RowMatrix<S>& rows) {
    row_mean.noalias() = rows.leftCols(s.prefix).colwise().sum() / static_cast<S>(s.window);
    pool1d(row_mean.data(), s.prefix, kernel, pooling, pooled.data());
    scores.row(q / s.group) += pooled;
  });
  scores /= static_cast<S>(s.group);
  return scores;
}

}  // namespace kvevict
