#pragma once
/// Stage "window attention" (docs/algorithms.md#window-attention), observation: softmax rows of the window queries over
/// the whole context, one query head at a time (extra memory O(w L), never O(H w L)).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/core/convert.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/parallel.hpp"
#include "kvevict/core/quantized.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict::detail {

/// Whether every entry of `m` (a block of a view: unit inner stride) is finite.
template <class M>
bool all_finite(const M& m) {
  using T = std::remove_const_t<typename M::Scalar>;
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    // On the bits: an all-ones exponent is Inf or NaN. Integer lanes the compiler vectorises; Eigen's
    // conversion to float would cost ~2 ns per entry (5x the check of a float cache).
    constexpr std::uint16_t exponent = std::is_same_v<T, Eigen::half> ? 0x7C00 : 0x7F80;
    const auto is_non_finite = [](std::uint16_t bits) { return (bits & exponent) == exponent; };
    for (Index r = 0; r < m.rows(); ++r) {
      const T* row = m.row(r).data();
      std::uint16_t any = 0;
      Index c = 0;
      for (; c + 32 <= m.cols(); c += 32) {  // a fixed trip count, which -O2 vectorises too
        std::uint16_t bits[32];
        std::memcpy(bits, row + c, sizeof bits);
        for (int i = 0; i < 32; ++i) any = static_cast<std::uint16_t>(any | is_non_finite(bits[i]));
      }
      for (; c < m.cols(); ++c) {
        std::uint16_t bits;
        std::memcpy(&bits, row + c, sizeof bits);
        any = static_cast<std::uint16_t>(any | is_non_finite(bits));
      }
      if (any) return false;
    }
    return true;
  } else {
    // x * 0 is 0 for a finite x and NaN for NaN or +-Inf, so the sum is finite iff every entry is; Eigen
    // vectorises the sum (allFinite() tests one coefficient at a time, slower than the window-attention GEMM).
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    return std::isfinite((m.template cast<A>().array() * A(0)).sum());
  }
}

/// Throws kvevict::invalid_argument naming the first NaN or Inf entry of `v` ([heads, rows, cols]), reading only
/// rows [0, rows_of(h)) and columns [0, cols_of(h)) of head h (the live entries of a ragged layer).
/// `positioned` (h, r) is appended to the entry's name: empty, or its token position on a layer with positions.
template <class T, class Rows, class Cols, class Positioned>
void require_finite(const HeadsView<const T>& v, const char* where, const char* name, Rows rows_of, Cols cols_of,
                    Positioned positioned) {
  for (Index h = 0; h < v.heads(); ++h) {
    const Index rows = rows_of(h), cols = cols_of(h);
    bool finite = true;
    for (Index r = 0; r < rows && finite; r += v.run_rows(r))  // one run of rows at a time (a paged view's page)
      finite = all_finite(v.run(h, r, std::min(v.run_rows(r), rows - r)).leftCols(cols));
    if (finite) continue;
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c)
        if (!std::isfinite(v.row(h, r)[c]))
          throw invalid_argument(concat("kvevict::", where, ": ", name, "[", h, ", ", r, ", ", c, "]", positioned(h, r),
                                        " is not finite (", v.row(h, r)[c], "); the inputs contain NaN or Inf values"));
  }
}
/// The same over the whole view.
template <class T>
void require_finite(const HeadsView<const T>& v, const char* where, const char* name) {
  require_finite(
      v, where, name, [&](Index) { return v.rows(); }, [&](Index) { return v.cols(); },
      [](Index, Index) { return std::string(); });
}
/// Keys enter the window-attention product in blocks of kKeyBlock rows (the last block takes the remainder, up to
/// 2 kKeyBlock - 1 rows). Keys stored in another type than S are converted one block at a time into a [block, d]
/// buffer that stays in cache, never as a whole [L, d] copy (a half or bfloat16 cache costs no extra pass over
/// memory); keys stored as S go through the same blocks, so that every storage type holding the same values gives
/// the same products bit for bit (a GEMM's rounding can depend on where a column falls in the product).
constexpr Index kKeyBlock = 256;

/// The same over the live entries of a KV view of the layer of `shape`: rows [0, L_h) of head h, each named by its
/// row and, on a layer with positions (a ragged or compacted cache), by its token position too. A quantized view is
/// checked as the values it holds (docs/algorithms.md#quantized): a NaN code, or a scale that is not finite or
/// overflows a value, is named with the entry.
template <class T>
void require_finite_entries(const KVView<const T>& v, const extend::LayerShape& shape, const char* where,
                            const char* name, const KVScale& scale = {}) {
  const auto positioned = [&](Index h, Index r) {
    return shape.positions.heads() > 0 ? concat(" (token position ", shape.position(h, r), ")") : std::string();
  };
  if constexpr (is_quantized_v<T>) {
    RowMatrix<float> rows;
    for (Index h = 0; h < v.heads(); ++h) {
      const HeadRows<T> head = head_rows(v, h, shape.length(h), scale);
      for (Index j0 = 0; j0 < head.rows; j0 += kKeyBlock) {  // a cache-sized block at a time
        const Index n = std::min(kKeyBlock, head.rows - j0);
        read_block<float>(head, j0, n, rows);
        if (std::isfinite((rows.array() * 0.0f).sum())) continue;
        for (Index r = 0; r < n; ++r)
          for (Index c = 0; c < v.cols(); ++c)
            if (!std::isfinite(rows(r, c)))
              throw invalid_argument(concat("kvevict::", where, ": ", name, "[", h, ", ", j0 + r, ", ", c, "]",
                                            positioned(h, j0 + r), " is not finite (", rows(r, c), " = stored ",
                                            static_cast<float>(v.row(h, j0 + r)[c]), " x scale ", head.scale(j0 + r),
                                            "); the inputs contain NaN or Inf values"));
      }
    }
  } else {
    require_finite(
        v, where, name, [&](Index h) { return shape.length(h); }, [&](Index) { return v.cols(); }, positioned);
  }
}

/// logits [w, L] = q_win k^T, q_win [w, d] in S, k the L rows of one KV head in its storage type (block_in:
/// converted or dequantized a block at a time); `buffer` is reused scratch.
template <class S, class QMat, class KV>
void window_logits(const QMat& q_win, const HeadRows<KV>& k, RowMatrix<S>& logits, RowMatrix<S>& buffer) {
  const Index L = k.rows;
  logits.resize(q_win.rows(), L);
  for (Index j0 = 0; j0 < L;) {
    const Index n = L - j0 < 2 * kKeyBlock ? L - j0 : kKeyBlock;
    logits.middleCols(j0, n).noalias() = q_win * block_in<S>(k, j0, n, buffer).transpose();
    j0 += n;
  }
}

/// rows [w, L] = softmax(rows / sqrt(d)) with the causal mask inside the window, in place on the logits.
template <class S>
void causal_softmax(RowMatrix<S>& rows, Index d) {
  const Index w = rows.rows(), L = rows.cols(), P = L - w;
  const S scale = std::sqrt(static_cast<S>(d));
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

/// rows [w, L] = softmax(q_win k^T / sqrt(d)) with the causal mask inside the window; q_win [w, d] in S, k the L
/// rows of one KV head in its storage type (converted block by block, window_logits).
template <class S, class QMat, class KV>
void softmax_window_rows(const QMat& q_win, const HeadRows<KV>& k, RowMatrix<S>& rows, RowMatrix<S>& buffer) {
  window_logits<S>(q_win, k, rows, buffer);
  causal_softmax(rows, k.cols());
}

/// The logits of the G query heads of one KV head whose keys are stored in another type than S: each block of keys
/// is converted once (read_block) and multiplied by every head's queries, so the conversion is paid once per KV
/// head, not G times. rows[g] [w, L] receives q_win(g) k^T, with the same block products as window_logits (bit for
/// bit the same logits); q_win(g) is query head g of the group, [w, d] in S.
template <class S, class QOf, class KV>
void group_window_logits(QOf&& q_win, Index G, const HeadRows<KV>& k, std::vector<RowMatrix<S>>& rows,
                         RowMatrix<S>& buffer) {
  const Index L = k.rows;
  rows.resize(static_cast<std::size_t>(G));
  for (Index g = 0; g < G; ++g) rows[static_cast<std::size_t>(g)].resize(q_win(g).rows(), L);
  for (Index j0 = 0; j0 < L;) {
    const Index n = L - j0 < 2 * kKeyBlock ? L - j0 : kKeyBlock;
    read_block<S>(k, j0, n, buffer);
    for (Index g = 0; g < G; ++g)
      rows[static_cast<std::size_t>(g)].middleCols(j0, n).noalias() = q_win(g) * buffer.transpose();
    j0 += n;
  }
}

/// `m` in the arithmetic type S: itself when stored as S, else a lazy conversion (Eigen maps nest by value).
template <class S, class M>
decltype(auto) as_arithmetic(M&& m) {
  if constexpr (std::is_same_v<typename std::decay_t<M>::Scalar, S>)
    return std::forward<M>(m);
  else
    return m.template cast<S>();
}

}  // namespace kvevict::detail

namespace kvevict::extend {
inline namespace KVEVICT_ABI_NAMESPACE {

/// Window attention of query head q: `rows` [w, L] receives softmax(Q_win[q] K[q/G]^T / sqrt(d)) with the causal
/// mask inside the window (row i, at absolute position L-w+i, sees keys j <= L-w+i; masked entries are 0).
/// L is `length` (the KV head's own entries on a ragged layer, docs/algorithms.md#ragged), or all the keys' rows.
/// S is the arithmetic type (float or wider); Q and KV the storage types of the queries and the keys; `keys_scale`
/// dequantizes int8 and fp8 keys (docs/algorithms.md#quantized).
template <class S, class Q, class KV>
void window_attention(const HeadsView<const Q>& queries, const KVView<const KV>& keys, Index q, Index group,
                      RowMatrix<S>& rows, Index length = -1, const KVScale& keys_scale = {}) {
  static_assert(std::is_floating_point_v<S>, "window_attention: arithmetic type must be float or double");
  const Index h = q / group, L = length < 0 ? keys.rows() : length;
  RowMatrix<S> buffer;
  const detail::HeadRows<KV> k = detail::head_rows(keys, h, L, keys_scale);
  if constexpr (std::is_same_v<std::remove_const_t<Q>, S>) {
    detail::softmax_window_rows<S>(queries.head(q), k, rows, buffer);
  } else {
    const RowMatrix<S> q_win = queries.head(q).template cast<S>();
    detail::softmax_window_rows<S>(q_win, k, rows, buffer);
  }
}

/// The observation of one layer: the [w, L] softmax rows of every query head, from window queries or from
/// attention rows the engine already has. Rows of head q are produced on demand into a reused buffer.
/// S is the arithmetic type; KV and Q the storage types of the keys and of the queries (or attention rows).
template <class S, class KV, class Q = KV>
class WindowObservation {
 public:
  /// Throws kvevict::invalid_argument if the tensors it reads (queries and keys, or attention) hold NaN or Inf:
  /// a non-finite input can vanish in the softmax (a -Inf logit) or behind a max pooling, so scores alone cannot
  /// be trusted to reveal it. O(size of those tensors), once.
  template <class W>
  WindowObservation(const LayerInputs<KV, Q, W>& in, const LayerShape& shape, const char* where = "select")
      : queries_(in.queries),
        attention_(in.attention),
        keys_(in.keys),
        keys_scale_(in.keys_scale),
        shape_(shape),
        from_queries_(in.queries.heads() * in.queries.rows() * in.queries.cols() > 0) {
    if (from_queries_) {
      detail::require_finite(queries_, where, "queries");
      detail::require_finite_entries(keys_, shape_, where, "keys", keys_scale_);
    } else {  // query head q reads the columns of its KV head's entries
      detail::require_finite(
          attention_, where, "attention", [&](Index) { return attention_.rows(); },
          [&](Index q) { return shape_.length(q / shape_.group); }, [](Index, Index) { return std::string(); });
    }
  }

  const LayerShape& shape() const { return shape_; }

  /// Calls f(q, rows) for every query head q; rows is [w, L_h] (full softmax rows over the entries of KV head
  /// h = q / G, prefix then window; L_h = L on a dense layer). The G query
  /// heads of a KV head are visited in order, on one thread; with KVEVICT_OPENMP (core/parallel.hpp) different KV
  /// heads run concurrently, so f may only touch state of KV head q / G. Extra memory O(w L) per thread; keys
  /// stored in another type than S (half, bfloat16, int8, fp8) or paged are converted or gathered once per KV head
  /// for its G query heads (group_window_logits), which holds the G heads' rows at once: O(G w L) per thread.
  template <class F>
  void for_each_head(F&& f) const {
    const Index G = shape_.group;
    struct Scratch {
      RowMatrix<S> rows, queries, buffer;  // [w, L]; [w, d] in S when stored otherwise; a block of keys in S
      std::vector<RowMatrix<S>> group_rows, group_queries;  // G x [w, L], G x [w, d] (keys stored otherwise)
    };
    detail::parallel_for_with<Scratch>(shape_.kv_heads, [&](Index h, Scratch& scratch) {
      RowMatrix<S>& rows = scratch.rows;
      // Keys read into a buffer (stored otherwise, or paged): each block once for the group's G query heads.
      if (from_queries_ && (!std::is_same_v<std::remove_const_t<KV>, S> || keys_.paged())) {
        const auto keys = detail::head_rows(keys_, h, shape_.length(h), keys_scale_);
        const auto group_logits = [&](auto&& q_win) {
          detail::group_window_logits<S>(q_win, G, keys, scratch.group_rows, scratch.buffer);
        };
        if constexpr (std::is_same_v<std::remove_const_t<Q>, S>) {
          group_logits([&](Index g) { return queries_.head(h * G + g); });
        } else {
          scratch.group_queries.resize(static_cast<std::size_t>(G));
          for (Index g = 0; g < G; ++g)
            scratch.group_queries[static_cast<std::size_t>(g)] = queries_.head(h * G + g).template cast<S>();
          group_logits(
              [&](Index g) -> const RowMatrix<S>& { return scratch.group_queries[static_cast<std::size_t>(g)]; });
        }
        for (Index g = 0; g < G; ++g) {
          RowMatrix<S>& head = scratch.group_rows[static_cast<std::size_t>(g)];
          detail::causal_softmax(head, keys_.cols());
          f(h * G + g, static_cast<const RowMatrix<S>&>(head));
        }
        return;
      }
      for (Index q = h * G; q < (h + 1) * G; ++q) {
        if (!from_queries_) {
          head_rows(q, rows);
        } else if constexpr (std::is_same_v<std::remove_const_t<Q>, S>) {
          detail::softmax_window_rows<S>(queries_.head(q), detail::head_rows(keys_, h, shape_.length(h), keys_scale_),
                                         rows, scratch.buffer);
        } else {
          scratch.queries = queries_.head(q).template cast<S>();
          detail::softmax_window_rows<S>(scratch.queries, detail::head_rows(keys_, h, shape_.length(h), keys_scale_),
                                         rows, scratch.buffer);
        }
        f(q, static_cast<const RowMatrix<S>&>(rows));
      }
    });
  }

  /// Rows [w, L_h] of query head q (h = q / G).
  void head_rows(Index q, RowMatrix<S>& rows) const {
    const Index length = shape_.length(q / shape_.group);
    if (from_queries_) {  // the same rule as validate_inputs: a view with a zero extent is not given
      window_attention<S, Q, KV>(queries_, keys_, q, shape_.group, rows, length, keys_scale_);
    } else {
      rows = detail::as_arithmetic<S>(attention_.head(q).leftCols(length));
    }
  }

 private:
  HeadsView<const Q> queries_, attention_;
  KVView<const KV> keys_;
  KVScale keys_scale_;
  LayerShape shape_;
  bool from_queries_;
};

/// Deduces the storage types: WindowObservation<S, KV, Q> from LayerInputs<KV, Q, W>.
template <class S, class KV, class Q, class W>
WindowObservation<S, KV, Q> observe(const LayerInputs<KV, Q, W>& in, const LayerShape& shape,
                                    const char* where = "select") {
  return WindowObservation<S, KV, Q>(in, shape, where);
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::extend
