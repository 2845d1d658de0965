#pragma once
/// Safetensors reader/writer for the kvevict command-line tools (header-only, C++17).
///
/// File layout: 8-byte little-endian unsigned header length N, N bytes of JSON header (an object: optional
/// "__metadata__" -> {string: string}, every other key a tensor name -> {"dtype", "shape", "data_offsets"}), then
/// the data section; data_offsets are [begin, end) relative to the start of the data section.
///
/// Reading validates everything and reports any malformed input as kvevict::safetensors::error with a one-line
/// message "<source>: [tensor '<name>': ]<what is wrong>; expected <what>". The header is parsed with a streaming
/// (SAX) handler, so no JSON DOM is built, duplicate keys are detected at every level, and no allocation is sized
/// by an untrusted number (the header is capped at 100 MB, shapes at 1024 dimensions, and tensor byte ranges must
/// lie inside the bytes actually read). Unknown fields inside a tensor entry are ignored, as the reference
/// implementation does. Gaps between tensors are allowed; overlapping byte ranges are not.
///
/// The writer lays tensors out contiguously in order of decreasing element size (stable, so the given order is
/// kept within a size), which keeps every tensor naturally aligned, and pads the header with spaces to a multiple
/// of 8 bytes. F16 and BF16 values are rounded from double directly (round to nearest, ties to even; no double
/// rounding through float).
///
/// Requires a little-endian host with IEEE-754 float and double.

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvevict::safetensors {

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvevict::safetensors assumes a little-endian host");
#endif
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4, "IEEE-754 binary32 float required");
static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "IEEE-754 binary64 double required");

class error : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class dtype { F64, F32, F16, BF16, I64, I32, U8, BOOL };

/// Largest accepted JSON header, in bytes (same limit as the reference implementation).
inline constexpr std::uint64_t max_header_size = 100000000;
/// Largest accepted tensor rank.
inline constexpr std::size_t max_rank = 1024;

inline std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::F64: return 8;
    case dtype::F32: return 4;
    case dtype::F16: return 2;
    case dtype::BF16: return 2;
    case dtype::I64: return 8;
    case dtype::I32: return 4;
    case dtype::U8: return 1;
    case dtype::BOOL: return 1;
  }
  throw error("invalid dtype enumerator " + std::to_string(static_cast<int>(t)) +
              "; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL");
}

inline const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::F64: return "F64";
    case dtype::F32: return "F32";
    case dtype::F16: return "F16";
    case dtype::BF16: return "BF16";
    case dtype::I64: return "I64";
    case dtype::I32: return "I32";
    case dtype::U8: return "U8";
    case dtype::BOOL: return "BOOL";
  }
  return "<invalid dtype>";
}

struct tensor_info {
  std::string name;
  dtype type = dtype::F32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;  // byte range [begin, end) relative to the data section
  std::int64_t numel() const;      // throws error on a negative dimension or overflow
};

struct tensor_out {
  std::string name;
  dtype type = dtype::F32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  // little-endian element data, numel * dtype_size(type) bytes
};

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

/// Escapes control characters (and, for text shown inside quotes, quotes and backslashes) and truncates at a UTF-8
/// boundary, so that text taken from untrusted input keeps error messages on one line and of bounded length.
inline std::string printable(const std::string& s, std::size_t max_len = 200, bool escape_quotes = true) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (out.size() >= max_len && (c & 0xC0u) != 0x80u) {
      out += "...";
      break;
    }
    if (c < 0x20u || c == 0x7Fu) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 0xFu];
    } else if (escape_quotes && (c == '\'' || c == '\\')) {
      out += '\\';
      out += ch;
    } else {
      out += ch;
    }
  }
  return out;
}

inline std::string quote(const std::string& s) { return "'" + printable(s) + "'"; }

/// nlohmann's exception text without its "[json.exception.<kind>.<id>] " prefix.
inline std::string json_error_text(const char* what) {
  std::string s = what;
  if (s.rfind("[json.exception.", 0) == 0) {
    const std::size_t close = s.find("] ");
    if (close != std::string::npos) s.erase(0, close + 2);
  }
  return printable(s, 300, false);
}

inline std::string format_shape(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i == 16) {
      out += ", ... (" + std::to_string(shape.size()) + " dims)";
      break;
    }
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

inline bool parse_dtype(const std::string& s, dtype& out) {
  static const std::pair<const char*, dtype> table[] = {
      {"F64", dtype::F64}, {"F32", dtype::F32}, {"F16", dtype::F16}, {"BF16", dtype::BF16},
      {"I64", dtype::I64}, {"I32", dtype::I32}, {"U8", dtype::U8},   {"BOOL", dtype::BOOL}};
  for (const auto& entry : table) {
    if (s == entry.first) {
      out = entry.second;
      return true;
    }
  }
  return false;
}

inline bool valid_dtype(dtype t) {
  switch (t) {
    case dtype::F64:
    case dtype::F32:
    case dtype::F16:
    case dtype::BF16:
    case dtype::I64:
    case dtype::I32:
    case dtype::U8:
    case dtype::BOOL: return true;
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

// ---- floating-point conversions (hand-written, exact) ----

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

inline std::uint16_t double_to_half_bits(double v) { return static_cast<std::uint16_t>(encode_ieee<5, 10>(v)); }
inline std::uint16_t double_to_bf16_bits(double v) { return static_cast<std::uint16_t>(encode_ieee<8, 7>(v)); }

inline float float_from_bits(std::uint32_t bits) {
  float f = 0;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline std::uint32_t float_bits(float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// IEEE binary16 -> binary32 (exact; subnormals normalized, inf and NaN payload preserved).
inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (static_cast<std::uint32_t>(h) >> 10) & 0x1Fu;
  std::uint32_t man = static_cast<std::uint32_t>(h) & 0x3FFu;
  if (exp == 0x1Fu) return float_from_bits(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return float_from_bits(sign);
    std::uint32_t e = 127 - 14;  // biased binary32 exponent of 2^-14, decremented while normalizing
    while (!(man & 0x400u)) {
      man <<= 1;
      --e;
    }
    return float_from_bits(sign | (e << 23) | ((man & 0x3FFu) << 13));
  }
  return float_from_bits(sign | ((exp + (127 - 15)) << 23) | (man << 13));
}

/// bfloat16 -> binary32 (exact: bfloat16 is the top half of a binary32).
inline float bf16_bits_to_float(std::uint16_t b) { return float_from_bits(static_cast<std::uint32_t>(b) << 16); }

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

// ---- streaming header parser ----

/// SAX handler for the JSON header: validates the structure while parsing and collects tensors and metadata.
class header_handler {
 public:
  using json = nlohmann::json;

  header_handler(const std::string& source, std::uint64_t data_size, std::vector<tensor_info>& tensors,
                 std::map<std::string, std::string>& metadata)
      : source_(source), data_size_(data_size), tensors_(tensors), metadata_(metadata) {}

  bool finished() const { return state_ == state::done; }

  bool null() { return unexpected(kind::null_value); }
  bool boolean(bool /*value*/) { return unexpected(kind::boolean_value); }
  bool binary(json::binary_t& /*value*/) { return unexpected(kind::binary_value); }

  bool number_integer(json::number_integer_t v) {
    if (v >= 0) return number_unsigned(static_cast<json::number_unsigned_t>(v));
    if (state_ == state::shape_elem || state_ == state::offsets_elem) bad_element(std::to_string(v), "is negative");
    return unexpected(kind::number_value);
  }

  bool number_unsigned(json::number_unsigned_t v) {
    if (state_ == state::shape_elem) {
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        bad_element(std::to_string(v), "is out of range");
      if (shape_.size() >= max_rank)
        fail_tensor("'shape' has more than " + std::to_string(max_rank) + " dimensions; expected at most " +
                    std::to_string(max_rank));
      shape_.push_back(static_cast<std::int64_t>(v));
      return true;
    }
    if (state_ == state::offsets_elem) {
      if (n_offsets_ >= 2)
        fail_tensor("'data_offsets' has more than 2 elements; expected exactly 2 integers [begin, end]");
      offsets_[n_offsets_++] = v;
      return true;
    }
    return unexpected(kind::number_value);
  }

  bool number_float(json::number_float_t /*value*/, const json::string_t& text) {
    if (state_ == state::shape_elem || state_ == state::offsets_elem) bad_element(text, "is not an integer");
    return unexpected(kind::number_value);
  }

  bool string(json::string_t& s) {
    if (state_ == state::meta_value) {
      metadata_.emplace(meta_key_, s);
      state_ = state::meta_key;
      return true;
    }
    if (state_ == state::tensor_value && field_ == field::dtype) {
      if (!parse_dtype(s, type_))
        fail_tensor("unknown dtype " + quote(s) + "; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL");
      has_dtype_ = true;
      state_ = state::tensor_key;
      return true;
    }
    return unexpected(kind::string_value);
  }

  bool start_object(std::size_t /*elements*/) {
    switch (state_) {
      case state::root: state_ = state::root_key; return true;
      case state::root_value:
        if (name_ == "__metadata__") {
          state_ = state::meta_key;
        } else {
          fields_.clear();
          shape_.clear();
          has_dtype_ = has_shape_ = has_offsets_ = false;
          n_offsets_ = 0;
          state_ = state::tensor_key;
        }
        return true;
      case state::tensor_value:
        if (field_ == field::other) {
          state_ = state::skip;
          skip_depth_ = 1;
          return true;
        }
        break;
      case state::skip: ++skip_depth_; return true;
      default: break;
    }
    return unexpected(kind::object_value);
  }

  bool start_array(std::size_t /*elements*/) {
    if (state_ == state::tensor_value) {
      switch (field_) {
        case field::shape:
          shape_.clear();
          state_ = state::shape_elem;
          return true;
        case field::offsets:
          n_offsets_ = 0;
          state_ = state::offsets_elem;
          return true;
        case field::other:
          state_ = state::skip;
          skip_depth_ = 1;
          return true;
        case field::dtype: break;
      }
    } else if (state_ == state::skip) {
      ++skip_depth_;
      return true;
    }
    return unexpected(kind::array_value);
  }

  bool key(json::string_t& k) {
    switch (state_) {
      case state::root_key:
        if (!names_.insert(k).second) {
          if (k == "__metadata__") fail("duplicate '__metadata__' entry in header; expected at most one");
          fail("duplicate tensor name " + quote(k) + " in header; expected unique tensor names");
        }
        name_ = k;
        state_ = state::root_value;
        return true;
      case state::meta_key:
        if (metadata_.count(k)) fail("duplicate __metadata__ key " + quote(k) + "; expected unique metadata keys");
        meta_key_ = k;
        state_ = state::meta_value;
        return true;
      case state::tensor_key:
        if (!fields_.insert(k).second) fail_tensor("duplicate field " + quote(k) + "; expected each field once");
        field_ = k == "dtype"          ? field::dtype
                 : k == "shape"        ? field::shape
                 : k == "data_offsets" ? field::offsets
                                       : field::other;
        state_ = state::tensor_value;
        return true;
      case state::skip: return true;
      default: return internal();
    }
  }

  bool end_object() {
    switch (state_) {
      case state::root_key: state_ = state::done; return true;
      case state::meta_key: state_ = state::root_key; return true;
      case state::tensor_key:
        finish_tensor();
        state_ = state::root_key;
        return true;
      case state::skip: return end_skipped();
      default: return internal();
    }
  }

  bool end_array() {
    switch (state_) {
      case state::shape_elem:
        has_shape_ = true;
        state_ = state::tensor_key;
        return true;
      case state::offsets_elem:
        if (n_offsets_ != 2)
          fail_tensor("'data_offsets' has " + std::to_string(n_offsets_) +
                      " element(s); expected exactly 2 integers [begin, end]");
        has_offsets_ = true;
        state_ = state::tensor_key;
        return true;
      case state::skip: return end_skipped();
      default: return internal();
    }
  }

  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/, const json::exception& ex) {
    fail(std::string("header is not valid JSON (") + json_error_text(ex.what()) + "); expected a JSON object");
  }

 private:
  enum class state {
    root,
    root_key,
    root_value,
    meta_key,
    meta_value,
    tensor_key,
    tensor_value,
    shape_elem,
    offsets_elem,
    skip,
    done
  };
  enum class field { dtype, shape, offsets, other };
  enum class kind { null_value, boolean_value, number_value, string_value, object_value, array_value, binary_value };

  static const char* describe(kind k) {
    switch (k) {
      case kind::null_value: return "null";
      case kind::boolean_value: return "a boolean";
      case kind::number_value: return "a number";
      case kind::string_value: return "a string";
      case kind::object_value: return "an object";
      case kind::array_value: return "an array";
      case kind::binary_value: return "binary data";
    }
    return "an unknown value";
  }

  [[noreturn]] void fail(const std::string& what) const { throw error(source_ + ": " + what); }
  [[noreturn]] void fail_tensor(const std::string& what) const {
    throw error(source_ + ": tensor " + quote(name_) + ": " + what);
  }
  [[noreturn]] bool internal() const { fail("internal error: unexpected JSON event; expected a valid header"); }

  [[noreturn]] void bad_element(const std::string& text, const char* problem) const {
    if (state_ == state::shape_elem)
      fail_tensor("'shape' element " + printable(text, 40) + " " + problem +
                  "; expected an array of non-negative integers <= 9223372036854775807");
    fail_tensor("'data_offsets' element " + printable(text, 40) + " " + problem +
                "; expected exactly 2 non-negative integers [begin, end]");
  }

  bool end_skipped() {
    if (--skip_depth_ == 0) state_ = state::tensor_key;
    return true;
  }

  // A value event (scalar or container start) that the current state does not accept.
  bool unexpected(kind k) {
    const std::string got = std::string("got ") + describe(k);
    switch (state_) {
      case state::skip: return true;
      case state::tensor_value:
        if (field_ == field::other) {
          state_ = state::tensor_key;
          return true;
        }
        if (field_ == field::dtype)
          fail_tensor("'dtype' must be a string; " + got + "; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL");
        if (field_ == field::shape) fail_tensor("'shape' must be an array; " + got + "; expected an array of integers");
        fail_tensor("'data_offsets' must be an array; " + got + "; expected [begin, end]");
      case state::root:
        fail("header is not a JSON object (" + got + "); expected an object mapping tensor names to entries");
      case state::root_value:
        if (name_ == "__metadata__")
          fail("'__metadata__' is not an object (" + got + "); expected an object of string to string");
        fail_tensor("entry is not an object (" + got + "); expected {\"dtype\", \"shape\", \"data_offsets\"}");
      case state::meta_value:
        fail("__metadata__ value for key " + quote(meta_key_) + " is not a string (" + got +
             "); expected an object of string to string");
      case state::shape_elem:
        fail_tensor("'shape' element is not an integer (" + got + "); expected an array of non-negative integers");
      case state::offsets_elem:
        fail_tensor("'data_offsets' element is not an integer (" + got +
                    "); expected exactly 2 non-negative integers [begin, end]");
      default: return internal();
    }
  }

  void finish_tensor() {
    if (!has_dtype_) fail_tensor("missing field 'dtype'; expected {\"dtype\", \"shape\", \"data_offsets\"}");
    if (!has_shape_) fail_tensor("missing field 'shape'; expected {\"dtype\", \"shape\", \"data_offsets\"}");
    if (!has_offsets_) fail_tensor("missing field 'data_offsets'; expected {\"dtype\", \"shape\", \"data_offsets\"}");
    std::int64_t numel = 0;
    std::string why;
    if (!checked_numel(shape_, numel, why)) fail_tensor(why);
    std::uint64_t nbytes = 0;
    if (!checked_mul(static_cast<std::uint64_t>(numel), dtype_size(type_), std::numeric_limits<std::uint64_t>::max(),
                     nbytes))
      fail_tensor("byte size of shape " + format_shape(shape_) + " x " + dtype_name(type_) +
                  " overflows; expected a representable size");
    const std::uint64_t begin = offsets_[0], end = offsets_[1];
    const std::string range = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
    if (begin > end) fail_tensor("data_offsets " + range + " has begin > end; expected begin <= end");
    if (end > data_size_)
      fail_tensor("data_offsets " + range + " end lies beyond the data section of " + std::to_string(data_size_) +
                  " bytes; expected end <= " + std::to_string(data_size_) + " (file truncated?)");
    if (end - begin != nbytes)
      fail_tensor("data_offsets " + range + " span " + std::to_string(end - begin) + " bytes; expected " +
                  std::to_string(nbytes) + " bytes for shape " + format_shape(shape_) + " x " + dtype_name(type_));
    tensor_info t;
    t.name = name_;
    t.type = type_;
    t.shape = shape_;
    t.begin = static_cast<std::size_t>(begin);  // <= data_size_, which is a size_t
    t.end = static_cast<std::size_t>(end);
    tensors_.push_back(std::move(t));
  }

  const std::string& source_;
  std::uint64_t data_size_;
  std::vector<tensor_info>& tensors_;
  std::map<std::string, std::string>& metadata_;

  state state_ = state::root;
  std::set<std::string> names_;   // top-level keys seen
  std::string name_;              // current top-level key
  std::string meta_key_;          // current __metadata__ key
  std::set<std::string> fields_;  // fields seen in the current tensor entry
  field field_ = field::other;
  dtype type_ = dtype::F32;
  std::vector<std::int64_t> shape_;
  std::uint64_t offsets_[2] = {0, 0};
  std::size_t n_offsets_ = 0;
  bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
  std::size_t skip_depth_ = 0;
};

}  // namespace detail

inline std::int64_t tensor_info::numel() const {
  std::int64_t n = 0;
  std::string why;
  if (!detail::checked_numel(shape, n, why)) throw error("tensor " + detail::quote(name) + ": " + why);
  return n;
}

class file {
 public:
  /// Reads the whole file into memory and validates it. Throws error.
  static file open(const std::string& path);
  /// Validates `bytes` as a safetensors file; `source_name` prefixes error messages. Throws error.
  static file parse(std::vector<unsigned char> bytes, std::string source_name);

  const tensor_info* find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }

  const tensor_info& at(const std::string& name) const {
    const tensor_info* t = find(name);
    if (!t) throw error("missing tensor " + detail::quote(name) + " in " + source_);
    return *t;
  }

  /// Tensors in order of data offset.
  const std::vector<tensor_info>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }

  /// Converts F64/F32/F16/BF16 element-wise to S (float or double); F64 -> float rounds to nearest even.
  template <class S>
  std::vector<S> read_floats(const tensor_info& t) const;
  /// I64 (and I32, widened) elements.
  std::vector<std::int64_t> read_i64(const tensor_info& t) const;
  /// Pointer to the first byte of the tensor's data (little-endian, possibly unaligned).
  const unsigned char* raw(const tensor_info& t) const { return data(t); }

 private:
  file() = default;

  [[noreturn]] void fail_tensor(const tensor_info& t, const std::string& what) const {
    throw error(source_ + ": tensor " + detail::quote(t.name) + ": " + what);
  }

  // Bounds-checks `t` against this file (it may come from elsewhere) and returns its first byte.
  const unsigned char* data(const tensor_info& t) const {
    if (!detail::valid_dtype(t.type)) fail_tensor(t, "invalid dtype enumerator; expected a tensor of this file");
    const std::size_t data_size = bytes_.size() - data_offset_;
    if (t.begin > t.end || t.end > data_size || (t.end - t.begin) % dtype_size(t.type) != 0)
      fail_tensor(t, "byte range [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                         "] does not fit the data section of " + std::to_string(data_size) +
                         " bytes; expected a tensor of this file");
    return bytes_.data() + data_offset_ + t.begin;
  }

  std::string source_;
  std::vector<unsigned char> bytes_;
  std::size_t data_offset_ = 0;
  std::vector<tensor_info> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

inline file file::parse(std::vector<unsigned char> bytes, std::string source_name) {
  file f;
  f.source_ = std::move(source_name);
  f.bytes_ = std::move(bytes);
  const std::string& src = f.source_;
  detail::require_little_endian(src);
  const std::size_t size = f.bytes_.size();
  if (size < 8)
    throw error(src + ": file is " + std::to_string(size) +
                " bytes, shorter than 8 bytes; expected an 8-byte header length followed by a JSON header");
  const std::uint64_t n = detail::load_u64(f.bytes_.data());
  if (n > max_header_size)
    throw error(src + ": header length " + std::to_string(n) + " exceeds the limit of " +
                std::to_string(max_header_size) + " bytes; expected a safetensors file (corrupt length prefix?)");
  if (n > size - 8)
    throw error(src + ": header length " + std::to_string(n) + " exceeds the file size (" + std::to_string(size) +
                " bytes); expected at most " + std::to_string(size - 8) + " (file truncated?)");
  f.data_offset_ = 8 + static_cast<std::size_t>(n);
  const std::uint64_t data_size = size - f.data_offset_;

  detail::header_handler handler(src, data_size, f.tensors_, f.metadata_);
  const char* first = reinterpret_cast<const char*>(f.bytes_.data() + 8);
  const char* last = reinterpret_cast<const char*>(f.bytes_.data() + f.data_offset_);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(first, last, &handler, nlohmann::json::input_format_t::json, true, false);
  } catch (const nlohmann::json::exception& ex) {
    throw error(src + ": header is not valid JSON (" + detail::json_error_text(ex.what()) +
                "); expected a JSON object");
  }
  if (!ok || !handler.finished())
    throw error(src + ": header JSON ended unexpectedly; expected a complete JSON object");

  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const tensor_info& a, const tensor_info& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  // Overlap check: among non-empty ranges sorted by begin, each must start at or after the furthest end so far.
  const tensor_info* furthest = nullptr;
  for (const tensor_info& t : f.tensors_) {
    if (t.begin == t.end) continue;
    if (furthest && t.begin < furthest->end)
      throw error(src + ": tensor " + detail::quote(t.name) + ": data_offsets [" + std::to_string(t.begin) + ", " +
                  std::to_string(t.end) + "] overlap those of tensor " + detail::quote(furthest->name) + " [" +
                  std::to_string(furthest->begin) + ", " + std::to_string(furthest->end) +
                  "]; expected disjoint byte ranges");
    if (!furthest || t.end > furthest->end) furthest = &t;
  }
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

inline file file::open(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) throw error(path + ": cannot open (" + ec.message() + "); expected a readable safetensors file");
  if (std::filesystem::is_directory(status)) throw error(path + ": is a directory; expected a safetensors file");
  if (!std::filesystem::is_regular_file(status))
    throw error(path + ": not a regular file; expected a safetensors file");

  struct closer {
    void operator()(std::FILE* fp) const { std::fclose(fp); }
  };
  errno = 0;
  std::unique_ptr<std::FILE, closer> fp(std::fopen(path.c_str(), "rb"));
  if (!fp) {
    const int e = errno;
    throw error(path + ": cannot open (" + (e ? std::generic_category().message(e) : std::string("unknown error")) +
                "); expected a readable safetensors file");
  }
  // Read straight into the buffer when the size is known, then keep reading in case the file grew meanwhile.
  std::vector<unsigned char> bytes;
  const auto expected_size = std::filesystem::file_size(path, ec);
  if (!ec && expected_size > 0 && expected_size <= std::numeric_limits<std::size_t>::max() / 2) {
    bytes.resize(static_cast<std::size_t>(expected_size));
    bytes.resize(std::fread(bytes.data(), 1, bytes.size(), fp.get()));
  }
  if (!std::ferror(fp.get())) {
    std::vector<unsigned char> chunk(std::size_t{1} << 16);
    for (;;) {
      const std::size_t got = std::fread(chunk.data(), 1, chunk.size(), fp.get());
      bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(got));
      if (got < chunk.size()) break;
    }
  }
  if (std::ferror(fp.get())) {
    const int e = errno;
    throw error(path + ": read error (" + (e ? std::generic_category().message(e) : std::string("unknown error")) +
                "); expected a readable safetensors file");
  }
  fp.reset();
  return parse(std::move(bytes), path);
}

template <class S>
std::vector<S> file::read_floats(const tensor_info& t) const {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "read_floats: S must be float or double");
  if (!detail::is_float_dtype(t.type))
    fail_tensor(t,
                std::string("dtype ") + dtype_name(t.type) + " is not floating point; expected F64, F32, F16 or BF16");
  const unsigned char* p = data(t);
  const std::size_t size = dtype_size(t.type);
  const std::size_t n = (t.end - t.begin) / size;  // bounded by the bytes in memory
  std::vector<S> out(n);
  switch (t.type) {
    case dtype::F64:
      for (std::size_t i = 0; i < n; ++i, p += 8) {
        double d = 0;
        std::memcpy(&d, p, sizeof d);
        if constexpr (std::is_same_v<S, double>) {
          out[i] = d;
        } else {
          out[i] = detail::narrow_to_float(d);
        }
      }
      break;
    case dtype::F32:
      for (std::size_t i = 0; i < n; ++i, p += 4) {
        float f = 0;
        std::memcpy(&f, p, sizeof f);
        out[i] = static_cast<S>(f);
      }
      break;
    case dtype::F16:
      for (std::size_t i = 0; i < n; ++i, p += 2)
        out[i] = static_cast<S>(detail::half_bits_to_float(detail::load_u16(p)));
      break;
    case dtype::BF16:
      for (std::size_t i = 0; i < n; ++i, p += 2)
        out[i] = static_cast<S>(detail::bf16_bits_to_float(detail::load_u16(p)));
      break;
    default: break;  // excluded above
  }
  return out;
}

inline std::vector<std::int64_t> file::read_i64(const tensor_info& t) const {
  if (t.type != dtype::I64 && t.type != dtype::I32)
    fail_tensor(t, std::string("dtype ") + dtype_name(t.type) + " is not an integer type; expected I64 or I32");
  const unsigned char* p = data(t);
  const std::size_t size = dtype_size(t.type);
  const std::size_t n = (t.end - t.begin) / size;
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i, p += size) {
    if (t.type == dtype::I64) {
      std::memcpy(&out[i], p, sizeof(std::int64_t));
    } else {
      std::int32_t v = 0;
      std::memcpy(&v, p, sizeof v);
      out[i] = v;
    }
  }
  return out;
}

// ---- writer ----

namespace detail {

inline std::size_t checked_element_count(const std::string& who, const std::string& name,
                                         const std::vector<std::int64_t>& shape) {
  std::int64_t n = 0;
  std::string why;
  if (!checked_numel(shape, n, why)) throw error(who + ": tensor " + quote(name) + ": " + why);
  if (static_cast<std::uint64_t>(n) > std::numeric_limits<std::size_t>::max())
    throw error(who + ": tensor " + quote(name) + ": shape " + format_shape(shape) +
                " is too large for this platform; expected fewer elements");
  return static_cast<std::size_t>(n);
}

}  // namespace detail

inline tensor_out make_tensor(std::string name, const std::vector<std::int64_t>& shape,
                              const std::vector<double>& values, dtype type) {
  const std::string who = "make_tensor";
  if (!detail::is_float_dtype(type))
    throw error(who + ": tensor " + detail::quote(name) + ": dtype " + dtype_name(type) +
                " is not floating point; expected F64, F32, F16 or BF16 (use make_tensor_i64 for I64)");
  const std::size_t n = detail::checked_element_count(who, name, shape);
  if (values.size() != n)
    throw error(who + ": tensor " + detail::quote(name) + ": got " + std::to_string(values.size()) +
                " values; expected " + std::to_string(n) + " for shape " + detail::format_shape(shape));
  tensor_out t;
  t.type = type;
  t.shape = shape;
  t.bytes.resize(n * dtype_size(type));  // n == values.size(), so this is bounded by memory already in use
  unsigned char* p = t.bytes.data();
  for (const double v : values) {
    switch (type) {
      case dtype::F64:
        std::memcpy(p, &v, 8);
        p += 8;
        break;
      case dtype::F32: {
        const float f = detail::narrow_to_float(v);
        std::memcpy(p, &f, 4);
        p += 4;
        break;
      }
      case dtype::F16:
        detail::store_u16(p, detail::double_to_half_bits(v));
        p += 2;
        break;
      case dtype::BF16:
        detail::store_u16(p, detail::double_to_bf16_bits(v));
        p += 2;
        break;
      default: break;  // excluded above
    }
  }
  t.name = std::move(name);
  return t;
}

inline tensor_out make_tensor_i64(std::string name, const std::vector<std::int64_t>& shape,
                                  const std::vector<std::int64_t>& values) {
  const std::size_t n = detail::checked_element_count("make_tensor_i64", name, shape);
  if (values.size() != n)
    throw error("make_tensor_i64: tensor " + detail::quote(name) + ": got " + std::to_string(values.size()) +
                " values; expected " + std::to_string(n) + " for shape " + detail::format_shape(shape));
  tensor_out t;
  t.type = dtype::I64;
  t.shape = shape;
  t.bytes.resize(n * 8);
  if (n) std::memcpy(t.bytes.data(), values.data(), n * 8);
  t.name = std::move(name);
  return t;
}

inline std::vector<unsigned char> serialize(const std::vector<tensor_out>& tensors,
                                            const std::map<std::string, std::string>& metadata = {}) {
  const std::string who = "safetensors writer";
  detail::require_little_endian(who);
  std::set<std::string> names;
  for (const tensor_out& t : tensors) {
    const std::string tag = who + ": tensor " + detail::quote(t.name) + ": ";
    if (t.name == "__metadata__") throw error(tag + "name is reserved; expected any other tensor name");
    if (!names.insert(t.name).second) throw error(tag + "duplicate tensor name; expected unique tensor names");
    if (!detail::valid_dtype(t.type))
      throw error(tag + "invalid dtype enumerator; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL");
    const std::size_t n = detail::checked_element_count(who, t.name, t.shape);
    if (n > std::numeric_limits<std::size_t>::max() / dtype_size(t.type) || t.bytes.size() != n * dtype_size(t.type))
      throw error(tag + "has " + std::to_string(t.bytes.size()) + " bytes; expected " + std::to_string(n) + " x " +
                  std::to_string(dtype_size(t.type)) + " bytes for shape " + detail::format_shape(t.shape) + " " +
                  dtype_name(t.type));
  }
  // Data layout: decreasing element size (stable), so every tensor is naturally aligned after the padded header.
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return dtype_size(tensors[a].type) > dtype_size(tensors[b].type);
  });

  using ojson = nlohmann::ordered_json;
  ojson header = ojson::object();
  if (!metadata.empty()) {
    ojson meta = ojson::object();
    for (const auto& kv : metadata) meta[kv.first] = kv.second;
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t offset = 0;
  for (const std::size_t i : order) {
    const tensor_out& t = tensors[i];
    ojson entry = ojson::object();
    entry["dtype"] = dtype_name(t.type);
    entry["shape"] = t.shape;
    entry["data_offsets"] = ojson::array({offset, offset + t.bytes.size()});
    header[t.name] = std::move(entry);
    offset += t.bytes.size();
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& ex) {
    throw error(who + ": cannot encode header (" + detail::json_error_text(ex.what()) +
                "); expected tensor names and metadata in valid UTF-8");
  }
  while (text.size() % 8 != 0) text.push_back(' ');
  if (text.size() > max_header_size)
    throw error(who + ": header of " + std::to_string(text.size()) + " bytes exceeds the limit of " +
                std::to_string(max_header_size) + " bytes; expected fewer tensors or less metadata");

  std::vector<unsigned char> out;
  out.reserve(8 + text.size() + static_cast<std::size_t>(offset));
  const std::uint64_t n = text.size();
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<unsigned char>((n >> (8 * b)) & 0xFFu));
  out.insert(out.end(), text.begin(), text.end());
  for (const std::size_t i : order) out.insert(out.end(), tensors[i].bytes.begin(), tensors[i].bytes.end());
  return out;
}

/// Serializes and writes to `path` (truncating it). On failure throws error and removes a partially written
/// regular file.
inline void write(const std::string& path, const std::vector<tensor_out>& tensors,
                  const std::map<std::string, std::string>& metadata = {}) {
  const std::vector<unsigned char> bytes = serialize(tensors, metadata);
  const auto describe = [](int e) { return e ? std::generic_category().message(e) : std::string("unknown error"); };
  errno = 0;
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  if (!fp) {
    const int e = errno;
    throw error(path + ": cannot open for writing (" + describe(e) + "); expected a writable path");
  }
  errno = 0;
  const std::size_t written = bytes.empty() ? 0 : std::fwrite(bytes.data(), 1, bytes.size(), fp);
  int e = written == bytes.size() ? 0 : errno;
  bool failed = written != bytes.size();
  if (std::fflush(fp) != 0 && !failed) {
    failed = true;
    e = errno;
  }
  if (std::fclose(fp) != 0 && !failed) {
    failed = true;
    e = errno;
  }
  if (failed) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) std::remove(path.c_str());
    throw error(path + ": write failed after " + std::to_string(written) + " of " + std::to_string(bytes.size()) +
                " bytes (" + describe(e) + "); expected the whole file to be written");
  }
}

}  // namespace kvevict::safetensors
