#pragma once
/// Zero-copy strided views over the engine's tensors: keys, values, window queries, attention rows, W_o.

#include <Eigen/Core>
#include <cstdint>
#include <type_traits>

#include "kvevict/core/error.hpp"

namespace kvevict {

using Index = Eigen::Index;

/// Row-major dense matrix used for per-head work buffers.
template <class S>
using RowMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A 3-D view [heads, rows, cols] with contiguous cols and arbitrary head and row strides (in elements).
/// Covers both engine layouts of a KV cache without copying:
///   heads-major (Hugging Face)   [kv_heads, tokens, head_dim]: head_stride = tokens * head_dim, row_stride = head_dim
///   tokens-major (llama.cpp, vLLM) [tokens, kv_heads, head_dim]: head_stride = head_dim, row_stride = kv_heads *
///   head_dim
/// T is the storage type, usually const-qualified: float, double, Eigen::half or Eigen::bfloat16 (engines' KV
/// caches; keys and values also std::int8_t, float8_e4m3 or float8_e5m2 with their scales, core/quantized.hpp);
/// the library converts what it reads to its arithmetic type S (float unless select<double>()).
template <class T>
class HeadsView {
 public:
  using value_type = std::remove_const_t<T>;
  /// One head as an Eigen matrix [rows, cols] sharing the view's storage.
  using HeadMap = Eigen::Map<std::conditional_t<std::is_const_v<T>, const RowMatrix<value_type>, RowMatrix<value_type>>,
                             Eigen::Unaligned, Eigen::OuterStride<>>;

  HeadsView() = default;
  HeadsView(T* data, Index heads, Index rows, Index cols, Index head_stride, Index row_stride)
      : data_(data), heads_(heads), rows_(rows), cols_(cols), head_stride_(head_stride), row_stride_(row_stride) {
    detail::require(heads >= 0 && rows >= 0 && cols >= 0, "HeadsView", "extents must be non-negative, got [", heads,
                    ", ", rows, ", ", cols, "]");
    detail::require(data != nullptr || heads * rows * cols == 0, "HeadsView",
                    "data must not be null for a non-empty view");
    detail::require(row_stride >= cols && head_stride >= 0, "HeadsView", "row_stride (", row_stride,
                    ") must be >= cols (", cols, ") and head_stride (", head_stride, ") >= 0");
  }

  /// [heads, rows, cols] stored contiguously (Hugging Face KV layout, or [H, w, d] queries, [H, w, L] attention).
  static HeadsView heads_major(T* data, Index heads, Index rows, Index cols) {
    return HeadsView(data, heads, rows, cols, rows * cols, cols);
  }
  /// [rows, heads, cols] stored contiguously (token-major KV layout of llama.cpp and vLLM).
  static HeadsView rows_major(T* data, Index rows, Index heads, Index cols) {
    return HeadsView(data, heads, rows, cols, cols, heads * cols);
  }

  T* data() const { return data_; }
  Index heads() const { return heads_; }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  Index head_stride() const { return head_stride_; }
  Index row_stride() const { return row_stride_; }

  T* row(Index h, Index r) const {
    KVEVICT_ASSERT(h >= 0 && h < heads_ && r >= 0 && r < rows_);
    return data_ + h * head_stride_ + r * row_stride_;
  }
  /// Head h as an Eigen map [rows, cols] (no copy).
  HeadMap head(Index h) const {
    KVEVICT_ASSERT(h >= 0 && h < heads_);
    return HeadMap(data_ + h * head_stride_, rows_, cols_, Eigen::OuterStride<>(row_stride_));
  }
  /// Read-only view of the same storage.
  operator HeadsView<const value_type>() const {
    return HeadsView<const value_type>(data_, heads_, rows_, cols_, head_stride_, row_stride_);
  }

 private:
  T* data_ = nullptr;
  Index heads_ = 0, rows_ = 0, cols_ = 0, head_stride_ = 0, row_stride_ = 0;
};

/// The last n rows of every head of `v` (no copy): e.g. the last w of an engine's longer buffer of recent queries,
/// for a policy whose window is w (TOVA's is 1).
template <class T>
HeadsView<T> last_rows(const HeadsView<T>& v, Index n) {
  detail::require(n >= 0 && n <= v.rows(), "last_rows", "n must be in [0, ", v.rows(), "] (the view's rows), got ", n);
  return HeadsView<T>(v.data() == nullptr ? nullptr : v.data() + (v.rows() - n) * v.row_stride(), v.heads(), n,
                      v.cols(), v.head_stride(), v.row_stride());
}

/// Keys or values of one layer: [kv_heads, tokens, head_dim] seen per head as [tokens, head_dim].
template <class T>
using KVView = HeadsView<T>;

/// Builds a KV view over [kv_heads, tokens, head_dim] storage (Hugging Face layout).
template <class T>
KVView<T> kv_heads_major(T* data, Index kv_heads, Index tokens, Index head_dim) {
  return KVView<T>::heads_major(data, kv_heads, tokens, head_dim);
}
/// Builds a KV view over [tokens, kv_heads, head_dim] storage (llama.cpp / vLLM layout).
template <class T>
KVView<T> kv_tokens_major(T* data, Index tokens, Index kv_heads, Index head_dim) {
  return KVView<T>::rows_major(data, tokens, kv_heads, head_dim);
}

/// Original token positions of a cache's entries [kv_heads, rows] (a HeadsView with one column): entry r of head h
/// holds the token at position *row(h, r). Strictly increasing along each head.
using PositionsView = HeadsView<const std::int64_t>;

/// Positions stored [kv_heads, capacity] (one array per head, as the keys of kv_heads_major).
inline PositionsView positions_heads_major(const std::int64_t* data, Index kv_heads, Index capacity) {
  return PositionsView(data, kv_heads, capacity, 1, capacity, 1);
}
/// Positions stored [capacity, kv_heads] (token-major, as the keys of kv_tokens_major).
inline PositionsView positions_tokens_major(const std::int64_t* data, Index capacity, Index kv_heads) {
  return PositionsView(data, kv_heads, capacity, 1, 1, kv_heads);
}

}  // namespace kvevict
