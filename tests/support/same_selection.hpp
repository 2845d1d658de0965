// Equality of selections as the tests compare them: the same kept rows per head (indices and offsets).
#ifndef KVEVICT_TESTS_SUPPORT_SAME_SELECTION_HPP
#define KVEVICT_TESTS_SUPPORT_SAME_SELECTION_HPP

#include <kvevict/core/selection.hpp>

#include <cstddef>
#include <vector>

namespace kvevict_test {

/// The same kept rows of every head: indices and offsets (not positions: see test_ragged.cpp for those too).
inline bool same(const kvevict::Selection& a, const kvevict::Selection& b) {
  return a.indices() == b.indices() && a.offsets() == b.offsets();
}

/// The same, layer by layer.
inline bool same(const std::vector<kvevict::Selection>& a, const std::vector<kvevict::Selection>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same(a[i], b[i])) return false;
  return true;
}

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_SAME_SELECTION_HPP
