#pragma once
/// The error type of the safetensors reader and writer, and the text helpers its messages are built with.
///
/// Every message is one line, "<source>: [tensor '<name>': ]<what is wrong>; expected <what>". Text taken from
/// untrusted input (tensor names, metadata keys, JSON tokens) goes through printable() or quote(), which escape
/// control characters and bound the length, so a hostile file cannot break a message over lines or make it huge.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace safetensors {

class error : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

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

/// "[d0, d1, ...]", cut after 16 dimensions.
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

}  // namespace detail
}  // namespace safetensors
