#pragma once
/// ScoringParams: the parameters every scored policy has (the observation window, the pooling along tokens, the
/// reference code's quirks, the redundancy weight) over the layout's (sharing, reduction, blocks). Every selector's
/// Params derives from it.

#include <cmath>

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/layout/params.hpp"

namespace kvevict {

/// Parameters every scored policy has (docs/algorithms.md#window-attention and docs/algorithms.md#pooling:
/// defaults of the kvpress family).
struct ScoringParams : LayoutParams {
  Index window = 32;               ///< w, the observation window (the last w prompt positions)
  Pooling pooling = Pooling::avg;  ///< smoothing along tokens (SnapKV's LongBench setting: max, kernel 7)
  Index kernel = 5;                ///< pooling kernel, odd
  bool reference_quirks = false;   ///< reproduce the reference code's quirks (docs/algorithms.md#forcing)
  /// rho, the weight of the key-redundancy term (R-KV, docs/algorithms.md#redundancy): every scored entry's score s
  /// becomes (1 - rho) s - rho R; 0 (every preset but RKV): off.
  double redundancy = 0.0;

  /// `min_window`: 1 for a policy that observes a window, 0 for one that reads no observation (StreamingLLM).
  void validate(const char* where, Index min_window = 1) const {
    LayoutParams::validate(where);
    detail::require(!reference_quirks || per_head_tokens(), where,
                    "reference_quirks reproduces the reference code, which has neither sharing nor blocks: it needs "
                    "share = per_head and block = 1, got share = ",
                    to_string(share), ", block = ", block);
    detail::require(window >= min_window, where, "window must be >= ", min_window, ", got ", window);
    detail::require(kernel >= 1 && kernel % 2 == 1, where, "kernel must be an odd number >= 1, got ", kernel);
    detail::require(std::isfinite(redundancy) && redundancy >= 0.0 && redundancy < 1.0, where,
                    "redundancy must be in [0, 1), got ", redundancy);
  }
};

}  // namespace kvevict
