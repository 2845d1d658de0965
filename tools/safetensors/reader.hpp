#pragma once
/// Safetensors reader: a whole file read into memory and validated, then its tensors read as float, double or
/// int64.
///
/// Any malformed input is reported as safetensors::error with a one-line message "<source>: [tensor '<name>': ]<what
/// is wrong>; expected <what>". The header is capped at max_header_size bytes and parsed by header.hpp's streaming
/// parser; tensor byte ranges must lie inside the bytes actually read. Gaps between tensors are allowed;
/// overlapping byte ranges are not.

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "convert.hpp"
#include "dtype.hpp"
#include "header.hpp"
#include "text.hpp"

namespace safetensors {

/// A whole safetensors file in memory, validated: its tensors by name, its metadata, and readers for its data.
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

  detail::parse_header(reinterpret_cast<const char*>(f.bytes_.data() + 8),
                       reinterpret_cast<const char*>(f.bytes_.data() + f.data_offset_), src, data_size, f.tensors_,
                       f.metadata_);

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
    default:
      break;  // excluded above
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

}  // namespace safetensors
