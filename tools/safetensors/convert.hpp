#pragma once
/// Floating-point conversions between double/float and the F16 (IEEE binary16) and BF16 (bfloat16) element types,
/// and little-endian loads and stores of the raw bytes.
///
/// Decoding goes through Eigen's Eigen::half and Eigen::bfloat16, which widen to float exactly (subnormals
/// normalized, infinities kept, NaN sign and payload kept). Where Eigen converts half with the F16C instruction
/// (Eigen 3.4 does under clang with -mf16c, or -march=native on an x86 that has it; not under g++), a signaling-NaN
/// half comes back with its quiet bit set; every other pattern decodes to the same float either way.
///
/// Encoding from double does not go through Eigen: Eigen::half(double) and Eigen::bfloat16(double) first round the
/// double to float and then round that float again, and the two roundings can land on the wrong neighbour (a
/// double just above a half/bf16 tie becomes the tie itself as a float, which then goes to even). encode_ieee
/// rounds the double directly, to nearest with ties to even.
///
/// Requires a little-endian host with IEEE-754 float and double.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "text.hpp"

namespace safetensors {

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors assumes a little-endian host");
#endif
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4, "IEEE-754 binary32 float required");
static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "IEEE-754 binary64 double required");

namespace detail {

inline bool host_is_little_endian() {
  const std::uint16_t probe = 1;
  unsigned char first = 0;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

inline void require_little_endian(const std::string& who) {
  if (!host_is_little_endian()) throw error(who + ": big-endian host; expected a little-endian host");
}

// ---- decoding (Eigen) ----

/// IEEE binary16 -> binary32 (exact).
inline float half_bits_to_float(std::uint16_t h) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h)); }

/// bfloat16 -> binary32 (exact: bfloat16 is the top half of a binary32).
inline float bf16_bits_to_float(std::uint16_t b) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(b));
}

// ---- encoding (direct from double, exact rounding) ----

inline int msb_index(std::uint64_t v) {  // v != 0
  int r = 0;
  for (int step = 32; step > 0; step /= 2) {
    if (v >> step) {
      v >>= step;
      r += step;
    }
  }
  return r;
}

/// Encodes `value` into an IEEE-754 binary format with E exponent bits and M mantissa bits (sign at bit E+M), with
/// round to nearest, ties to even; overflow gives infinity, underflow gives (signed) subnormals or zero. NaNs keep
/// their sign and top payload bits and are made quiet.
template <unsigned E, unsigned M>
std::uint32_t encode_ieee(double value) {
  static_assert(E >= 2 && E <= 8 && M >= 1 && M <= 23, "target format must be no wider than binary32");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  const std::uint32_t sign = static_cast<std::uint32_t>(bits >> 63) << (E + M);
  const std::uint32_t exp_all = (1u << E) - 1u;
  const int bias = (1 << (E - 1)) - 1;
  const auto dexp = static_cast<std::uint32_t>((bits >> 52) & 0x7FFu);
  const std::uint64_t dman = bits & ((std::uint64_t{1} << 52) - 1u);
  if (dexp == 0x7FFu) {
    if (dman == 0) return sign | (exp_all << M);  // infinity
    const auto payload = static_cast<std::uint32_t>(dman >> (52 - M)) | (1u << (M - 1));
    return sign | (exp_all << M) | payload;  // quiet NaN
  }
  if (dexp == 0 && dman == 0) return sign;  // signed zero
  // value = sig * 2^e2 exactly
  const std::uint64_t sig = dexp == 0 ? dman : (dman | (std::uint64_t{1} << 52));
  const int e2 = dexp == 0 ? -1074 : static_cast<int>(dexp) - 1075;
  const int log2v = e2 + msb_index(sig);
  const int min_q = 1 - bias - static_cast<int>(M);  // quantum of the subnormals
  int q = std::max(log2v - static_cast<int>(M), min_q);
  const int shift = q - e2;  // >= 29 for every allowed target, since double has more precision and range
  std::uint64_t m = 0;
  if (shift < 64) {
    m = sig >> shift;
    const std::uint64_t rem = sig & ((std::uint64_t{1} << shift) - 1u);
    const std::uint64_t half = std::uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (m & 1u))) ++m;
  }                    // else: value < 2^(q-11), far below half a quantum: rounds to zero
  if (m >> (M + 1)) {  // rounding carried into a new binade
    m >>= 1;
    ++q;
  }
  if (m >> M) {  // normal
    const int biased = q + static_cast<int>(M) + bias;
    if (biased >= static_cast<int>(exp_all)) return sign | (exp_all << M);  // overflow to infinity
    return sign | (static_cast<std::uint32_t>(biased) << M) | (static_cast<std::uint32_t>(m) & ((1u << M) - 1u));
  }
  return sign | static_cast<std::uint32_t>(m);  // subnormal or zero
}

/// double -> binary16 bits, rounded once (see the note at the top: not through float, so not through Eigen::half).
inline std::uint16_t double_to_half_bits(double v) { return static_cast<std::uint16_t>(encode_ieee<5, 10>(v)); }
/// double -> bfloat16 bits, rounded once (not through float, so not through Eigen::bfloat16).
inline std::uint16_t double_to_bf16_bits(double v) { return static_cast<std::uint16_t>(encode_ieee<8, 7>(v)); }

/// double -> float, rounding to nearest even; finite values beyond the float range round to +-FLT_MAX or +-inf
/// as IEEE-754 prescribes (a plain cast would be undefined behaviour there).
inline float narrow_to_float(double d) {
  if (std::isfinite(d) && std::fabs(d) > static_cast<double>(std::numeric_limits<float>::max())) {
    const double tie = 0x1.ffffffp+127;  // FLT_MAX + half an ulp; ties go to even, i.e. to 2^128 = inf
    const float mag = std::fabs(d) >= tie ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::max();
    return std::signbit(d) ? -mag : mag;
  }
  return static_cast<float>(d);
}

// ---- little-endian bytes ----

inline std::uint16_t load_u16(const unsigned char* p) {
  return static_cast<std::uint16_t>(static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8));
}

inline void store_u16(unsigned char* p, std::uint16_t v) {
  p[0] = static_cast<unsigned char>(v & 0xFFu);
  p[1] = static_cast<unsigned char>(v >> 8);
}

inline std::uint64_t load_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace detail
}  // namespace safetensors
