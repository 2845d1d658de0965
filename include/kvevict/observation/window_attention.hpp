#pragma once
/// Stage 2.1, observation: softmax rows of the window queries over the whole context, one query head at a time
/// (extra memory O(w L), never O(H w L)).

#include <cmath>
#include <limits>
#include <type_traits>

#include "kvevict/core/inputs.hpp"
#include "kvevict/core/parallel.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

namespace detail {

/// Throws kvevict::invalid_argument naming the first NaN or Inf entry of `v` ([heads, rows, cols]).
template <class T>
void require_finite(const HeadsView<const T>& v, const char* where, const char* name) {
  using A = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;
  for (Index h = 0; h < v.heads(); ++h) {
    // x * 0 is 0 for a finite x and NaN for NaN or +-Inf, so the sum is finite iff every entry is; Eigen
    // vectorises the sum (allFinite() tests one coefficient at a time, slower than the window-attention GEMM).
    if (std::isfinite((v.head(h).template cast<A>().array() * A(0)).sum())) continue;
    for (Index r = 0; r < v.rows(); ++r)
      for (Index c = 0; c < v.cols(); ++c)
        if (!std::isfinite(v.row(h, r)[c]))
          throw invalid_argument(concat("kvevict::", where, ": ", name, "[", h, ", ", r, ", ", c, "] is not finite (",
                                        v.row(h, r)[c], "); the inputs contain NaN or Inf values"));
  }
}

/// rows [w, L] = softmax(q_win k^T / sqrt(d)) with the causal mask inside the window; q_win [w, d], k [L, d] in S.
template <class S, class QMat, class KMat>
void softmax_window_rows(const QMat& q_win, const KMat& k, RowMatrix<S>& rows) {
  const Index w = q_win.rows(), L = k.rows(), P = L - w;
  rows.resize(w, L);
  rows.noalias() = q_win * k.transpose();
  const S scale = std::sqrt(static_cast<S>(k.cols()));
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

}  // namespace detail

/// Window attention of query head q: `rows` [w, L] receives softmax(Q_win[q] K[q/G]^T / sqrt(d)) with the causal
/// mask inside the window (row i, at absolute position L-w+i, sees keys j <= L-w+i; masked entries are 0).
/// S is the arithmetic type (float or wider), T the storage type.
template <class S, class T>
void window_attention(const HeadsView<const T>& queries, const KVView<const T>& keys, Index q, Index group,
                      RowMatrix<S>& rows) {
  static_assert(std::is_floating_point_v<S>, "window_attention: arithmetic type must be float or double");
  const Index h = q / group;
  if constexpr (std::is_same_v<S, T>) {
    detail::softmax_window_rows<S>(queries.head(q), keys.head(h), rows);
  } else {
    const RowMatrix<S> k = keys.head(h).template cast<S>();
    detail::softmax_window_rows<S>(queries.head(q).template cast<S>(), k, rows);
  }
}

/// The observation of one layer: the [w, L] softmax rows of every query head, from window queries or from
/// attention rows the engine already has. Rows of head q are produced on demand into a reused buffer.
template <class S, class T>
class WindowObservation {
 public:
  /// Throws kvevict::invalid_argument if the tensors it reads (queries and keys, or attention) hold NaN or Inf:
  /// a non-finite input can vanish in the softmax (a -Inf logit) or behind a max pooling, so scores alone cannot
  /// be trusted to reveal it. O(size of those tensors), once.
  WindowObservation(const LayerInputs<T>& in, const LayerShape& shape)
      : in_(in), shape_(shape), from_queries_(in.queries.heads() * in.queries.rows() * in.queries.cols() > 0) {
    if (from_queries_) {
      detail::require_finite(in_.queries, "select", "queries");
      detail::require_finite(in_.keys, "select", "keys");
    } else {
      detail::require_finite(in_.attention, "select", "attention");
    }
  }

  const LayerShape& shape() const { return shape_; }

  /// Calls f(q, rows) for every query head q; rows is [w, L] (full softmax rows, prefix then window). The G query
  /// heads of a KV head are visited in order, on one thread; with KVEVICT_OPENMP (core/parallel.hpp) different KV
  /// heads run concurrently, so f may only touch state of KV head q / G. Extra memory O(w L) per thread.
  template <class F>
  void for_each_head(F&& f) const {
    const Index G = shape_.group;
    struct Scratch {
      RowMatrix<S> rows, keys;  // [w, L]; the KV head's keys in S [L, d] when stored otherwise
    };
    detail::parallel_for_with<Scratch>(shape_.kv_heads, [&](Index h, Scratch& scratch) {
      RowMatrix<S>& rows = scratch.rows;
      if constexpr (!std::is_same_v<S, T>) {
        if (from_queries_) {  // convert the KV head's keys once for its G query heads
          scratch.keys = in_.keys.head(h).template cast<S>();
          for (Index q = h * G; q < (h + 1) * G; ++q) {
            detail::softmax_window_rows<S>(in_.queries.head(q).template cast<S>(), scratch.keys, rows);
            f(q, static_cast<const RowMatrix<S>&>(rows));
          }
          return;
        }
      }
      for (Index q = h * G; q < (h + 1) * G; ++q) {
        head_rows(q, rows);
        f(q, static_cast<const RowMatrix<S>&>(rows));
      }
    });
  }

  /// Rows [w, L] of query head q.
  void head_rows(Index q, RowMatrix<S>& rows) const {
    if (from_queries_) {  // the same rule as validate_inputs: a view with a zero extent is not given
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
  bool from_queries_;
};

}  // namespace kvevict
