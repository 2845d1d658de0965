#pragma once
/// Stage "aggregation" (docs/algorithms.md#aggregation), defensive aggregation (DefensiveKV, arXiv 2510.13334): worst
/// case over window queries and the GQA group instead of the mean, with an adaptive prior floor.

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {

/// Accumulates M [Hkv, P] one query head at a time:
///   R[q][i, :] = pool(A[q][i, :P]) * sum(A[q][i, :P]) / sum(pool(A[q][i, :P]))   (pooled, mass renormalised;
///                a row with no pooled mass stays 0)
///   M[h][j]   = max over the G query heads of h and the w rows of R[q][i, j]
///   floor:      M[h][j] = max(M[h][j], mean_j M[h][j])   (skipped when `floor` is false, for ablations)
/// With `score_window` (an open window, docs/algorithms.md#open-window) M also covers head h's own window
/// columns P_h .. L_h - 1: the max over the group and rows of the unpooled A[q][i, j] (causal: column P_h + t is
/// seen by rows t .. w - 1), floored at the same prefix mean; M is then [Hkv, L] instead of [Hkv, P].
template <class S>
class DefensiveAggregator {
 public:
  DefensiveAggregator(const LayerShape& shape, Index kernel, Pooling pooling, bool floor, bool score_window = false)
      : shape_(shape),
        kernel_(kernel),
        pooling_(pooling),
        floor_(floor),
        score_window_(score_window),
        scores_(RowMatrix<S>::Zero(shape.kv_heads, score_window ? shape.tokens : shape.prefix)) {}  // 0: max's identity

  /// rows [w, L_h]: the softmax rows of query head q. Writes only row q / G (see MeanAggregator::add).
  void add(Index q, const RowMatrix<S>& rows) {
    const Index P = rows.cols() - shape_.window;
    auto out = scores_.row(q / shape_.group).head(P);
    Eigen::Matrix<S, 1, Eigen::Dynamic> pooled(P);
    for (Index i = 0; i < shape_.window; ++i) {
      const auto a = rows.row(i).head(P);
      pool1d(a.data(), P, kernel_, pooling_, pooled.data());
      const S pooled_mass = pooled.sum();
      if (pooled_mass > S(0)) pooled *= a.sum() / pooled_mass;
      out = out.cwiseMax(pooled);
    }
    if (score_window_) {
      auto window = scores_.row(q / shape_.group).segment(P, shape_.window);
      for (Index i = 0; i < shape_.window; ++i) window = window.cwiseMax(rows.row(i).tail(shape_.window));
    }
  }
  RowMatrix<S> finish() {
    if (floor_)
      for (Index h = 0; h < shape_.kv_heads; ++h) {  // over the head's own P_h scores (docs/algorithms.md#ragged)
        if (shape_.prefix_of(h) == 0) continue;
        const S mean = scores_.row(h).head(shape_.prefix_of(h)).mean();
        auto own = scores_.row(h).head(score_window_ ? shape_.length(h) : shape_.prefix_of(h));
        own = own.cwiseMax(mean);
      }
    return scores_;
  }

 private:
  LayerShape shape_;
  Index kernel_;
  Pooling pooling_;
  bool floor_;
  bool score_window_;
  RowMatrix<S> scores_;
};

/// Defensive scores [Hkv, P] of a layer (streams over query heads).
template <class S, class KV, class Q>
RowMatrix<S> defensive_scores(const WindowObservation<S, KV, Q>& obs, Index kernel, Pooling pooling, bool floor) {
  DefensiveAggregator<S> agg(obs.shape(), kernel, pooling, floor);
  obs.for_each_head([&](Index q, const RowMatrix<S>& rows) { agg.add(q, rows); });
  return agg.finish();
}

}  // namespace kvevict::extend
