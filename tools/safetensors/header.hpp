#pragma once
/// The JSON header of a safetensors file: its limits, the tensor entries it describes, and the streaming (SAX)
/// parser that validates it.
///
/// File layout: 8-byte little-endian unsigned header length N, N bytes of JSON header (an object: optional
/// "__metadata__" -> {string: string}, every other key a tensor name -> {"dtype", "shape", "data_offsets"}), then
/// the data section; data_offsets are [begin, end) relative to the start of the data section.
///
/// The parser builds no JSON DOM, detects duplicate keys at every level, and sizes no allocation by an untrusted
/// number (shapes are capped at max_rank dimensions, and byte ranges must lie inside the data section actually
/// read). Unknown fields inside a tensor entry are ignored, as the reference implementation does.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtype.hpp"
#include "text.hpp"

namespace safetensors {

/// Largest accepted JSON header, in bytes (same limit as the reference implementation).
inline constexpr std::uint64_t max_header_size = 100000000;
/// Largest accepted tensor rank.
inline constexpr std::size_t max_rank = 1024;

/// One tensor entry of a header.
struct tensor_info {
  std::string name;
  dtype type = dtype::F32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;  // byte range [begin, end) relative to the data section

  /// Element count; throws error on a negative dimension or overflow.
  std::int64_t numel() const {
    std::int64_t n = 0;
    std::string why;
    if (!detail::checked_numel(shape, n, why)) throw error("tensor " + detail::quote(name) + ": " + why);
    return n;
  }
};

namespace detail {

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
        fail_tensor("unknown dtype " + quote(s) +
                    "; expected one of F64, F32, F16, BF16, I64, I32, U8, BOOL, I8, F8_E4M3, F8_E5M2");
      has_dtype_ = true;
      state_ = state::tensor_key;
      return true;
    }
    return unexpected(kind::string_value);
  }

  bool start_object(std::size_t /*elements*/) {
    switch (state_) {
      case state::root:
        state_ = state::root_key;
        return true;
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
      case state::skip:
        ++skip_depth_;
        return true;
      default:
        break;
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
        case field::dtype:
          break;
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
      case state::skip:
        return true;
      default:
        return internal();
    }
  }

  bool end_object() {
    switch (state_) {
      case state::root_key:
        state_ = state::done;
        return true;
      case state::meta_key:
        state_ = state::root_key;
        return true;
      case state::tensor_key:
        finish_tensor();
        state_ = state::root_key;
        return true;
      case state::skip:
        return end_skipped();
      default:
        return internal();
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
      case state::skip:
        return end_skipped();
      default:
        return internal();
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
      case kind::null_value:
        return "null";
      case kind::boolean_value:
        return "a boolean";
      case kind::number_value:
        return "a number";
      case kind::string_value:
        return "a string";
      case kind::object_value:
        return "an object";
      case kind::array_value:
        return "an array";
      case kind::binary_value:
        return "binary data";
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
      case state::skip:
        return true;
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
      default:
        return internal();
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

/// Parses and validates the JSON header text [first, last) of `source`, whose data section has `data_size` bytes,
/// appending its tensors (in header order) and metadata. Throws error.
inline void parse_header(const char* first, const char* last, const std::string& source, std::uint64_t data_size,
                         std::vector<tensor_info>& tensors, std::map<std::string, std::string>& metadata) {
  header_handler handler(source, data_size, tensors, metadata);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(first, last, &handler, nlohmann::json::input_format_t::json, true, false);
  } catch (const nlohmann::json::exception& ex) {
    throw error(source + ": header is not valid JSON (" + json_error_text(ex.what()) + "); expected a JSON object");
  }
  if (!ok || !handler.finished())
    throw error(source + ": header JSON ended unexpectedly; expected a complete JSON object");
}

}  // namespace detail
}  // namespace safetensors
