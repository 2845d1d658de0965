#pragma once
/// Storage conversion: rows of half or bfloat16 keys and values to float, in the tight loops the compiler
/// vectorises (bfloat16: a 16-bit shift; half: F16C when the target has it). Eigen's cast converts one scalar at a
/// time (~2.4 ns per bfloat16 element here), which costs more than the product it feeds. Exact either way: every
/// half and bfloat16 value is a float.

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

/// dst [rows, cols] = src (a block of a view: unit inner stride) in the arithmetic type S.
template <class S, class Src>
void convert_rows(const Src& src, RowMatrix<S>& dst) {
  static_assert(!is_quantized_v<typename Src::Scalar>, "convert_rows: quantized storage is read with read_rows");
  using T = std::remove_const_t<typename Src::Scalar>;
  dst.resize(src.rows(), src.cols());
  if constexpr (std::is_same_v<S, float> && (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>)) {
    for (Index r = 0; r < src.rows(); ++r) to_float(src.row(r).data(), dst.row(r).data(), src.cols());
  } else {
    dst = src.template cast<S>();
  }
}

/// dst [rows, cols] = the values of src (a block of rows of one KV head: unit inner stride) in S: quantized storage
/// dequantized in float, row r times scale(r) (docs/algorithms.md#quantized), then widened to S; any other storage
/// converted as it is (convert_rows; `scale` unused).
template <class S, class Src>
void read_rows(const Src& src, const RowScale& scale, RowMatrix<S>& dst) {
  using T = std::remove_const_t<typename Src::Scalar>;
  if constexpr (is_quantized_v<T>) {
    dst.resize(src.rows(), src.cols());
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
    convert_rows<S>(src, dst);
  }
}

}  // namespace kvevict::detail
