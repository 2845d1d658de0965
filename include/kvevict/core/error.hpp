#pragma once
/// kvevict::invalid_argument and the checks every public entry point uses.

#include <cassert>
#include <sstream>
#include <stdexcept>
#include <string>

#include "kvevict/core/config.hpp"

namespace kvevict {

/// Thrown by every public entry point on bad shapes, budgets or parameters.
/// The message names the entry point, the field, the rule and the value, e.g.
/// `kvevict::SnapKV::select: window (40) must be smaller than the context length (32)`.
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

/// Throws kvevict::invalid_argument("kvevict::<where>: <message parts...>") when `ok` is false.
template <class... Parts>
void require(bool ok, const char* where, const Parts&... parts) {
  if (!ok) throw invalid_argument(concat("kvevict::", where, ": ", parts...));
}

}  // namespace detail
}  // namespace kvevict

/// Internal invariant (never user input); compiles out under NDEBUG.
#define KVEVICT_ASSERT(cond) assert(cond)
