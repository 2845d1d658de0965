// The vector paths of the storage conversions (core/convert.hpp, core/quantized.hpp), compiled with AVX2 and F16C
// (this executable only: the other tests build for the baseline ISA, where only the scalar paths exist). Every
// path must give the bits of the scalar definition: float(code) * factor for int8 and fp8 codes (NaN codes NaN),
// the exact float value of every half and bfloat16. Lengths 0..40 and offsets 0..7 cover the 8-wide bodies and
// the scalar tails.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__F16C__)
#error "tests/simd is compiled with -mavx2 -mf16c"
#endif

namespace {

using kvevict::Index;

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// Same float, bit for bit; any NaN equals any NaN (payloads are not part of the contract).
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

/// The scalar definition of a code's value: int8 as an integer, fp8 by the exact table (which
/// tests/test_quantized_storage.cpp checks against the formats' definitions).
template <class T>
float value_of(T c) {
  return static_cast<float>(c);
}

template <class T>
T code(int b) {
  if constexpr (std::is_same_v<T, std::int8_t>)
    return static_cast<std::int8_t>(static_cast<std::uint8_t>(b));
  else
    return T::from_bits(static_cast<std::uint8_t>(b));
}

/// Every code, three times over, in a rotating order so that each code meets each lane position.
template <class T>
std::vector<T> all_codes() {
  std::vector<T> codes;
  for (int rep = 0; rep < 3; ++rep)
    for (int b = 0; b < 256; ++b) codes.push_back(code<T>((b * 7 + rep * 3) & 0xFF));
  return codes;
}

template <class T>
void check_dequantize() {
  const std::vector<T> codes = all_codes<T>();
  const float max = std::numeric_limits<float>::max(), min_normal = std::numeric_limits<float>::min();
  for (float factor : {1.0f, 0.37f, -2.5f, 3.0e-5f, min_normal, 1.0e-40f, max / 300.0f, max, 0.0f}) {
    std::vector<float> out(codes.size());
    kvevict::detail::dequantize(codes.data(), factor, out.data(), static_cast<Index>(codes.size()));
    for (std::size_t i = 0; i < codes.size(); ++i) {
      const float expected = value_of(codes[i]) * factor;
      if (!same(out[i], expected))
        FAIL_CHECK("index " << i << " factor " << factor << ": " << out[i] << " != " << expected);
    }
  }
  // Lengths around the 8-wide body, at every offset: nothing written past n, tails by the scalar path.
  for (Index offset = 0; offset < 8; ++offset)
    for (Index n = 0; n <= 40; ++n) {
      std::vector<float> out(static_cast<std::size_t>(n) + 4, -7.0f);
      kvevict::detail::dequantize(codes.data() + 101 + offset, 0.75f, out.data(), n);
      for (Index i = 0; i < n; ++i)
        CHECK(same(out[static_cast<std::size_t>(i)],
                   value_of(codes[static_cast<std::size_t>(101 + offset + i)]) * 0.75f));
      for (std::size_t i = static_cast<std::size_t>(n); i < out.size(); ++i) CHECK(out[i] == -7.0f);
    }
}

template <class H>
void check_to_float() {
  std::vector<H> all(65536 + 13);
  for (std::size_t i = 0; i < all.size(); ++i)
    all[i] = Eigen::numext::bit_cast<H>(static_cast<std::uint16_t>((i * 40503u) & 0xFFFFu));
  std::vector<float> out(all.size());
  kvevict::detail::to_float(all.data(), out.data(), static_cast<Index>(all.size()));
  int wrong = 0;
  for (std::size_t i = 0; i < all.size(); ++i) wrong += same(out[i], static_cast<float>(all[i])) ? 0 : 1;
  CHECK(wrong == 0);
}

}  // namespace

TEMPLATE_TEST_CASE("simd: int8 and fp8 codes dequantize to float(code) * factor, bit for bit, at every length",
                   "[simd][quantized]", std::int8_t, kvevict::float8_e4m3, kvevict::float8_e5m2) {
  check_dequantize<TestType>();
}

TEST_CASE("simd: every half and bfloat16 converts to its exact float", "[simd][views]") {
  check_to_float<Eigen::half>();
  check_to_float<Eigen::bfloat16>();
}
