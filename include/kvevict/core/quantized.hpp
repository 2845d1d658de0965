#pragma once
/// Quantized KV caches (docs/algorithms.md#quantized): fp8 storage (e4m3 and e5m2, the two formats of vLLM's fp8
/// KV cache) and int8 storage, read through dequantisation scales. Entry j of KV head h holds the value
///   float(stored) * (tensor * token(h, j))      in float arithmetic, the factor rounded first,
/// and every stage selects exactly as it would on float storage holding those values.

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "kvevict/core/views.hpp"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvevict {

/// fp8 E4M3 as stored (OCP FP8, torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7) and 3 mantissa bits; no
/// infinities, S.1111.111 is NaN, the largest finite value is 448. Converts to float exactly.
struct float8_e4m3 {
  std::uint8_t bits = 0;
  static float8_e4m3 from_bits(std::uint8_t b) { return float8_e4m3{b}; }
  explicit operator float() const;
};

/// fp8 E5M2 as stored (OCP FP8, torch.float8_e5m2): 1 sign, 5 exponent (bias 15) and 2 mantissa bits, with IEEE
/// infinities and NaNs (the upper byte of an IEEE half). Converts to float exactly.
struct float8_e5m2 {
  std::uint8_t bits = 0;
  static float8_e5m2 from_bits(std::uint8_t b) { return float8_e5m2{b}; }
  explicit operator float() const;
};

/// Whether T is a quantized storage type (read through a KVScale): std::int8_t, float8_e4m3, float8_e5m2.
template <class T>
inline constexpr bool is_quantized_v =
    std::is_same_v<std::remove_const_t<T>, std::int8_t> || std::is_same_v<std::remove_const_t<T>, float8_e4m3> ||
    std::is_same_v<std::remove_const_t<T>, float8_e5m2>;

/// The dequantisation scales of a quantized cache's keys or values (LayerInputs::keys_scale, values_scale):
///   tensor  one factor for the whole tensor (vLLM's k_scale / v_scale; 1 when the cache has none)
///   token   optional [Hkv, >= L_h, 1] factors per entry: per_token_scales() (one per token, shared by the KV heads)
///           or per_head_token_scales() (one per KV head and token). Empty: none.
/// Entry j of head h reads float(stored) * (tensor * token(h, j)). Float, double, half and bfloat16 caches take no
/// scale (a given one is refused).
struct KVScale {
  float tensor = 1.0f;
  HeadsView<const float> token;

  bool has_token() const { return token.heads() * token.rows() * token.cols() > 0; }
  /// Whether anything differs from "no scale".
  bool given() const { return tensor != 1.0f || has_token(); }
};

/// [L] factors, one per token, shared by the `kv_heads` KV heads (a view with head stride 0).
inline HeadsView<const float> per_token_scales(const float* scales, Index kv_heads, Index tokens) {
  return HeadsView<const float>(scales, kv_heads, tokens, 1, 0, 1);
}
/// [Hkv, L] factors stored heads-major (row h: head h's tokens).
inline HeadsView<const float> per_head_token_scales(const float* scales, Index kv_heads, Index tokens) {
  return HeadsView<const float>(scales, kv_heads, tokens, 1, tokens, 1);
}
/// [L, Hkv] factors stored tokens-major (row j: token j of every head), as a token-major cache stores them.
inline HeadsView<const float> per_head_token_scales_tokens_major(const float* scales, Index tokens, Index kv_heads) {
  return HeadsView<const float>(scales, kv_heads, tokens, 1, 1, kv_heads);
}

namespace detail {

/// Every value of an 8-bit code, as float: decode(b) for b in [0, 256).
template <class Decode>
std::array<float, 256> code_table(Decode decode) {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[static_cast<std::size_t>(b)] = decode(static_cast<std::uint8_t>(b));
  return t;
}

inline float e4m3_value(std::uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if (e == 0xF && m == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -9);  // subnormal: m / 8 * 2^-6
  else
    v = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m / 8) * 2^(e - 7)
  return (b & 0x80) ? -v : v;
}

inline float e5m2_value(std::uint8_t b) {
  const int e = (b >> 2) & 0x1F, m = b & 3;
  float v;
  if (e == 0x1F)
    v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -16);  // subnormal: m / 4 * 2^-14
  else
    v = std::ldexp(static_cast<float>(4 + m), e - 17);  // (1 + m / 4) * 2^(e - 15)
  return (b & 0x80) ? -v : v;
}

inline const float* e4m3_table() {
  static const std::array<float, 256> table = code_table(e4m3_value);
  return table.data();
}
inline const float* e5m2_table() {
  static const std::array<float, 256> table = code_table(e5m2_value);
  return table.data();
}

/// The dequantisation factors of one KV head's rows, from row `first` on: row r reads tensor * token(head, first + r)
/// (the factor alone when there is no token scale). An unpaged token view is read through a pointer and a stride
/// (once per dequantized row: the hot path of int8 caches); a paged one through the view.
struct RowScale {
  float tensor = 1.0f;
  const float* token = nullptr;  // unpaged: row r's factor at token[r * stride]
  Index stride = 0;
  HeadsView<const float> pages;  // paged token scales (token null)
  Index head = 0, first = 0;

  float operator()(Index r) const {
    if (token) return tensor * token[r * stride];
    return pages.heads() > 0 ? tensor * *pages.row(head, first + r) : tensor;
  }
  RowScale from(Index r) const {
    RowScale s = *this;
    if (token)
      s.token += r * stride;
    else
      s.first += r;
    return s;
  }
};

inline RowScale row_scale(const KVScale& s, Index h) {
  if (!s.has_token()) return RowScale{s.tensor, nullptr, 0, {}, 0, 0};
  if (s.token.paged()) return RowScale{s.tensor, nullptr, 0, s.token, h, 0};
  return RowScale{s.tensor, s.token.row(h, 0), s.token.row_stride(), {}, 0, 0};
}

/// out[0, n) = in[0, n) * factor, dequantized in float: float(code) exactly, then one rounding of the product, so
/// the vector paths below (8 codes at a time) and the scalar tails give the same bits.
inline void dequantize(const std::int8_t* in, float factor, float* out, Index n) {
  Index i = 0;
#if defined(__AVX2__)
  const __m256 f = _mm256_set1_ps(factor);
  for (; i + 8 <= n; i += 8) {
    const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), f));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]) * factor;
}

#if defined(__F16C__)
/// 8 codes, zero-extended to 16 bits.
inline __m128i load8_u16(const void* p) { return _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p))); }
#endif

/// e4m3 through half: the code's exponent and mantissa fields, shifted left by 7, are a half of 2^-8 times the
/// code's value (normal and subnormal codes alike: half has the same 3 leading mantissa bits and 1 more exponent
/// bit), so value = half(bits) * 256 exactly; the NaN codes S.1111.111 get a NaN exponent.
inline void dequantize(const float8_e4m3* in, float factor, float* out, Index n) {
  Index i = 0;
#if defined(__F16C__)
  const __m256 f = _mm256_set1_ps(factor), two8 = _mm256_set1_ps(256.0f);
  const __m128i magnitude_mask = _mm_set1_epi16(0x7F), sign_mask = _mm_set1_epi16(0x80),
                nan_exponent = _mm_set1_epi16(0x7E00);
  for (; i + 8 <= n; i += 8) {
    const __m128i codes = load8_u16(in + i);
    const __m128i magnitude = _mm_and_si128(codes, magnitude_mask);
    const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(magnitude, magnitude_mask), nan_exponent);
    const __m128i half = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(magnitude, 7), nan),
                                      _mm_slli_epi16(_mm_and_si128(codes, sign_mask), 8));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(half), two8), f));
  }
#endif
  const float* table = e4m3_table();
  for (; i < n; ++i) out[i] = table[in[i].bits] * factor;
}

/// e5m2 through half: the code is the upper byte of a half of the same value (infinities and NaNs included).
inline void dequantize(const float8_e5m2* in, float factor, float* out, Index n) {
  Index i = 0;
#if defined(__F16C__)
  const __m256 f = _mm256_set1_ps(factor);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_slli_epi16(load8_u16(in + i), 8)), f));
#endif
  const float* table = e5m2_table();
  for (; i < n; ++i) out[i] = table[in[i].bits] * factor;
}

}  // namespace detail

inline float8_e4m3::operator float() const { return detail::e4m3_table()[bits]; }
inline float8_e5m2::operator float() const { return detail::e5m2_table()[bits]; }

}  // namespace kvevict

namespace kvevict::detail {
/// Eigen maps of fp8 storage (views only: the library never computes in fp8; it dequantizes rows to float).
template <class T>
struct Float8NumTraits : Eigen::GenericNumTraits<T> {
  enum {
    IsInteger = 0,
    IsSigned = 1,
    IsComplex = 0,
    RequireInitialization = 0,
    ReadCost = 1,
    AddCost = 1,
    MulCost = 1
  };
};
}  // namespace kvevict::detail

namespace Eigen {
template <>
struct NumTraits<kvevict::float8_e4m3> : kvevict::detail::Float8NumTraits<kvevict::float8_e4m3> {};
template <>
struct NumTraits<kvevict::float8_e5m2> : kvevict::detail::Float8NumTraits<kvevict::float8_e5m2> {};
}  // namespace Eigen
