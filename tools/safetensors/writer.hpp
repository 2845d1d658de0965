#pragma once
/// Safetensors writer: tensors built from double or int64 values (or raw bytes), serialized to a buffer or a file.
///
/// The writer lays tensors out contiguously in order of decreasing element size (stable, so the given order is
/// kept within a size), which keeps every tensor naturally aligned, and pads the header with spaces to a multiple
/// of 8 bytes. F16 and BF16 values are rounded from double directly (round to nearest, ties to even; no double
/// rounding through float: see convert.hpp).

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert.hpp"
#include "dtype.hpp"
#include "header.hpp"
#include "text.hpp"

namespace safetensors {

struct tensor_out {
  std::string name;
  dtype type = dtype::F32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  // little-endian element data, numel * dtype_size(type) bytes
};

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
      default:
        break;  // excluded above
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

}  // namespace safetensors
