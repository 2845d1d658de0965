#pragma once
/// The element types of a safetensors file: names, sizes, parsing from the header's "dtype" strings, and the
/// overflow-checked element count of a shape.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "text.hpp"

namespace safetensors {

/// I8, F8_E4M3 and F8_E5M2: the codes of a quantized KV cache (read as raw bytes; select_run.hpp dequantizes them).
enum class dtype { F64, F32, F16, BF16, I64, I32, U8, BOOL, I8, F8_E4M3, F8_E5M2 };

inline std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::F64:
    case dtype::I64:
      return 8;
    case dtype::F32:
    case dtype::I32:
      return 4;
    case dtype::F16:
    case dtype::BF16:
      return 2;
    case dtype::U8:
    case dtype::BOOL:
    case dtype::I8:
    case dtype::F8_E4M3:
    case dtype::F8_E5M2:
      return 1;
  }
  throw error("invalid dtype enumerator " + std::to_string(static_cast<int>(t)) +
              "; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL, I8, F8_E4M3, F8_E5M2");
}

inline const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::F64:
      return "F64";
    case dtype::F32:
      return "F32";
    case dtype::F16:
      return "F16";
    case dtype::BF16:
      return "BF16";
    case dtype::I64:
      return "I64";
    case dtype::I32:
      return "I32";
    case dtype::U8:
      return "U8";
    case dtype::BOOL:
      return "BOOL";
    case dtype::I8:
      return "I8";
    case dtype::F8_E4M3:
      return "F8_E4M3";
    case dtype::F8_E5M2:
      return "F8_E5M2";
  }
  return "<invalid dtype>";
}

namespace detail {

/// The dtype named `s` (exact, case-sensitive match); false if there is none.
inline bool parse_dtype(const std::string& s, dtype& out) {
  static const std::pair<const char*, dtype> table[] = {
      {"F64", dtype::F64}, {"F32", dtype::F32},         {"F16", dtype::F16},        {"BF16", dtype::BF16},
      {"I64", dtype::I64}, {"I32", dtype::I32},         {"U8", dtype::U8},          {"BOOL", dtype::BOOL},
      {"I8", dtype::I8},   {"F8_E4M3", dtype::F8_E4M3}, {"F8_E5M2", dtype::F8_E5M2}};
  for (const auto& entry : table) {
    if (s == entry.first) {
      out = entry.second;
      return true;
    }
  }
  return false;
}

/// False for a value cast into the enum that names none of its enumerators.
inline bool valid_dtype(dtype t) {
  switch (t) {
    case dtype::F64:
    case dtype::F32:
    case dtype::F16:
    case dtype::BF16:
    case dtype::I64:
    case dtype::I32:
    case dtype::U8:
    case dtype::BOOL:
    case dtype::I8:
    case dtype::F8_E4M3:
    case dtype::F8_E5M2:
      return true;
  }
  return false;
}

inline bool is_float_dtype(dtype t) {
  return t == dtype::F64 || t == dtype::F32 || t == dtype::F16 || t == dtype::BF16;
}

/// a * b without overflow; false if the product exceeds `limit`.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return out <= limit;
}

/// Element count of `shape`. Fails (with a reason) on a negative dimension or when the product of the non-zero
/// dimensions exceeds INT64_MAX (rejected even when another dimension is 0, so that strides stay representable).
inline bool checked_numel(const std::vector<std::int64_t>& shape, std::int64_t& out, std::string& why) {
  const auto limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t product = 1;
  bool has_zero = false;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      why = "shape " + format_shape(shape) + " has negative dimension " + std::to_string(shape[i]) + " at index " +
            std::to_string(i) + "; expected non-negative dimensions";
      return false;
    }
    if (shape[i] == 0) {
      has_zero = true;
      continue;
    }
    if (!checked_mul(product, static_cast<std::uint64_t>(shape[i]), limit, product)) {
      why = "shape " + format_shape(shape) +
            " element count overflows; expected a product of dimensions <= " + std::to_string(limit);
      return false;
    }
  }
  out = has_zero ? 0 : static_cast<std::int64_t>(product);
  return true;
}

}  // namespace detail
}  // namespace safetensors
