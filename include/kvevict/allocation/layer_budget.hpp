#pragma once
/// What an allocator distributes for one layer.

#include <cstdint>

#include "kvevict/core/views.hpp"

namespace kvevict {

/// n_kept per KV head on average (window included), the layer total to distribute (Hkv * n_kept unless a
/// reference quirk says otherwise) and the window size.
struct LayerBudget {
  std::int64_t n_kept = 0;
  Index total = 0;
  Index window = 0;
};

}  // namespace kvevict
