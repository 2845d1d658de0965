#pragma once
/// Stage 2.1, observation: softmax rows of the window queries over the whole context, one query head at a time
/// (extra memory O(w L), never O(H w L)).

#include <cmath>
#include <limits>
#include <type_traits>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// Window attention of query head q: `rows` [w, L] receives softmax(Q_win[q] K[q/G]^T / sqrt(d)) with the causal
/// mask inside the window (row i, at absolute position L-w+i, sees keys j <= L-w+i; masked entries are 0).
/// S is the arithmetic type (float or wider), T the storage type.
template <class S, class T>
void window_attention(const HeadsView<const T>& queries, const KVView<const T>& keys, Index q, Index group,
                      RowMatrix<S>& rows) {
  static_assert(std::is_floating_point_v<S>, "window_attention: arithmetic type must be float or double");
  const Index w = queries.rows(), L = keys.rows(), P = L - w;
  const Index h = q / group;
  rows.resize(w, L);
  if constexpr (std::is_same_v<S, T>) {
    rows.noalias() = queries.head(q) * keys.head(h).transpose();
  } else {
    rows.noalias() = queries.head(q).template cast<S>() * keys.head(h).template cast<S>().transpose();
  }
  const S scale = std::sqrt(static_cast<S>(keys.cols()));
  for (Index i = 0; i < w; ++i) {
    const Index visible = P + i + 1;  // causal: keys [0, P + i]
    auto row = rows.row(i);
    row.head(visible) /= scale;
    const S m = row.head(visible).maxCoeff();
    row.head(visible) = (row.head(visible).array() - m).exp();
    row.head(visible) /= row.head(visible).sum();
    row.tail(L - visible).setZero();
  }
}

/// The observation of one layer: the [w, L] softmax rows of every query head, from window queries or from
/// attention rows the engine already has. Rows of head q are produced on demand into a reused buffer.
template <class S, class T>
class WindowObservation {
 public:
  WindowObservation(const LayerInputs<T>& in, const LayerShape& shape) : in_(in), shape_(shape) {}

  const LayerShape& shape() const { return shape_; }

  /// Calls f(q, rows) for every query head q in order; rows is [w, L] (full softmax rows, prefix then window).
  template <class F>
  void for_each_head(F&& f) const {
    RowMatrix<S> rows;
    for (Index q = 0; q < shape_.query_heads; ++q) {
      head_rows(q, rows);
      f(q, static_cast<const RowMatrix<S>&>(rows));
    }
  }

  /// Rows [w, L] of query head q.
  void head_rows(Index q, RowMatrix<S>& rows) const {
    if (in_.queries.heads() > 0) {
      window_attention<S, T>(in_.queries, in_.keys, q, shape_.group, rows);
    } else if constexpr (std::is_same_v<S, T>) {
      rows = in_.attention.head(q);
    } else {
      rows = in_.attention.head(q).template cast<S>();
    }
  }

 private:
  const LayerInputs<T>& in_;
  LayerShape shape_;
};

}  // namespace kvevict
