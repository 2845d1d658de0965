#pragma once
/// Stage "allocation" (docs/algorithms.md#allocation), uniform allocation (SnapKV, arXiv 2404.14469): every KV head
/// keeps n_kept tokens.

#include <algorithm>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict {

/// Uniform allocation: b_h = n_kept for every KV head. With the window in the window tier, each head keeps the
/// window plus its top (n_kept - w) prefix tokens; with n_kept < w, its most recent n_kept window tokens. On a
/// ragged layer b_h = min(n_kept, L_h) (docs/algorithms.md#ragged).
struct UniformAllocation {
  static constexpr const char* type_name = "UniformAllocation";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  UniformAllocation() = default;
  explicit UniformAllocation(const Params&) {}

  /// Per-head budgets [kv_heads]. No ranking across heads: `top_k` (extend::LocalTopK) is not called.
  template <class S, class TopK = extend::LocalTopK>
  std::vector<Index> allocate(extend::ScoreMap<S>& scores, const extend::LayerBudget& budget,
                              const TopK& /*top_k*/ = TopK{}) const {
    std::vector<Index> b(static_cast<std::size_t>(scores.heads));
    for (Index h = 0; h < scores.heads; ++h)
      b[static_cast<std::size_t>(h)] = std::min(static_cast<Index>(budget.n_kept), scores.length(h));
    return b;
  }
};

}  // namespace kvevict
