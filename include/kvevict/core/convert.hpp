#pragma once
/// Storage conversion: rows of half or bfloat16 keys and values to float, in the tight loops the compiler
/// vectorises (bfloat16: a 16-bit shift; half: F16C when the target has it). Eigen's cast converts one scalar at a
/// time (~2.4 ns per bfloat16 element here), which costs more than the product it feeds. Exact either way: every
/// half and bfloat16 value is a float.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "kvevict/core/quantized.hpp"
#include "kvevict/core/views.hpp"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvevict::detail {

/// out[0, n) = in[0, n) as float.
inline void to_float(const Eigen::bfloat16* in, float* out, Index n) {
  for (Index i = 0; i < n; ++i) {
    const std::uint32_t bits = static_cast<std::uint32_t>(Eigen::numext::bit_cast<std::uint16_t>(in[i])) << 16;
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

inline void to_float(const Eigen::half* in, float* out, Index n) {
  Index i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

/// dst = src (a block of a view: unit inner stride) in the arithmetic type S; dst [rows, cols] already sized (a
/// block of a row-major matrix).
template <class S, class Src, class Dst>
void convert_rows_to(const Src& src, Dst&& dst) {
  static_assert(!is_quantized_v<typename Src::Scalar>, "convert_rows_to: quantized storage is read with read_rows_to");
  using T = std::remove_const_t<typename Src::Scalar>;
  if constexpr (std::is_same_v<S, float> && (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>)) {
    for (Index r = 0; r < src.rows(); ++r) to_float(src.row(r).data(), dst.row(r).data(), src.cols());
  } else {
    dst = src.template cast<S>();
  }
}

/// dst = the values of src (a block of rows of one KV head: unit inner stride) in S, dst already sized: quantized
/// storage dequantized in float, row r times scale(r) (docs/algorithms.md#quantized), then widened to S; any other
/// storage converted as it is (convert_rows_to; `scale` unused).
template <class S, class Src, class Dst>
void read_rows_to(const Src& src, const RowScale& scale, Dst&& dst) {
  using T = std::remove_const_t<typename Src::Scalar>;
  if constexpr (is_quantized_v<T>) {
    if constexpr (std::is_same_v<S, float>) {
      for (Index r = 0; r < src.rows(); ++r) dequantize(src.row(r).data(), scale(r), dst.row(r).data(), src.cols());
    } else {
      Eigen::Matrix<float, 1, Eigen::Dynamic> row(src.cols());
      for (Index r = 0; r < src.rows(); ++r) {
        dequantize(src.row(r).data(), scale(r), row.data(), src.cols());
        dst.row(r) = row.template cast<S>();
      }
    }
  } else {
    convert_rows_to<S>(src, dst);
  }
}

/// Rows [0, rows) of head `head` of a keys or values view, with the factors that dequantize them: what the stages
/// read a KV head through, a block of rows at a time, so that a paged view (docs/algorithms.md#paged) and a strided
/// one read alike.
template <class T>
struct HeadRows {
  HeadsView<const T> view;
  Index head = 0;
  Index rows = 0;
  RowScale scale;

  Index cols() const { return view.cols(); }
};

/// Head h's first `rows` rows of `view` (all of them when rows < 0), read through `scale` when quantized.
template <class T>
HeadRows<T> head_rows(const HeadsView<const T>& view, Index h, Index rows = -1, const KVScale& scale = {}) {
  return HeadRows<T>{view, h, rows < 0 ? view.rows() : rows, row_scale(scale, h)};
}

/// A block of rows in S as Eigen reads it: a map of the storage, or a buffer it was converted into.
template <class S>
using RowsRef = Eigen::Ref<const RowMatrix<S>, 0, Eigen::OuterStride<>>;

/// dst [n, cols] = rows [j0, j0 + n) of `rows` in S (read_rows_to), one run within a page at a time.
template <class S, class T>
void read_block(const HeadRows<T>& rows, Index j0, Index n, RowMatrix<S>& dst) {
  KVEVICT_ASSERT(j0 >= 0 && n >= 0 && j0 + n <= rows.rows);
  dst.resize(n, rows.cols());
  // An unpaged view's block is one run: read straight into dst. (Measured: int8 SnapKV at 32k 234 -> 199 ms against
  // the per-run loop below, which does the same reads; docs/results/performance.md#paged.)
  if (!rows.view.paged()) {
    read_rows_to<S>(rows.view.run(rows.head, j0, n), rows.scale.from(j0), dst);
    return;
  }
  for (Index r = j0; r < j0 + n;) {
    const Index m = std::min(rows.view.run_rows(r), j0 + n - r);
    read_rows_to<S>(rows.view.run(rows.head, r, m), rows.scale.from(r), dst.middleRows(r - j0, m));
    r += m;
  }
}

/// Rows [j0, j0 + n) of `rows` in S: a map of the view when it stores S and the rows lie in one run (no copy),
/// else read_block into `buffer`. A half, bfloat16, int8 or fp8 cache, or a paged one, is never copied whole.
/// Either way Eigen's products over the block round alike (the tests compare paged and strided views bit for bit).
template <class S, class T>
RowsRef<S> block_in(const HeadRows<T>& rows, Index j0, Index n, RowMatrix<S>& buffer) {
  if constexpr (std::is_same_v<std::remove_const_t<T>, S>) {
    if (n == 0 || rows.view.run_rows(j0) >= n) return RowsRef<S>(rows.view.run(rows.head, j0, n));
  }
  read_block<S>(rows, j0, n, buffer);
  return RowsRef<S>(buffer);
}

}  // namespace kvevict::detail
