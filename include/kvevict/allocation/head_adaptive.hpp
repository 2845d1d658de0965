#pragma once
/// Stage "allocation" (docs/algorithms.md#allocation), head-adaptive allocation (Ada-KV, arXiv 2407.11550): the layer's
/// budget is shared across KV heads by one top-k over all of them, with a per-head safeguard.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict {

struct HeadAdaptiveAllocation {
  static constexpr const char* type_name = "HeadAdaptiveAllocation";
  enum class Variant {
    kvpress,  ///< kvpress AdaKVPress: safeguard forcing, then one flat top-k of the layer total (the default)
    original  ///< the original AdaKV repo: b_h = round(count_h (1 - alpha) + floor(alpha (n_kept - w))) + w
  };
  struct Params {
    double alpha = 0.2;  ///< safeguard fraction: each head is guaranteed int(n_kept * alpha) of its top tokens
    Variant variant = Variant::kvpress;
    void validate(const char* where) const {
      detail::require(std::isfinite(alpha) && alpha >= 0.0 && alpha <= 1.0, where, "alpha must be in [0, 1], got ",
                      alpha);
    }
  };
  HeadAdaptiveAllocation() = default;
  explicit HeadAdaptiveAllocation(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }

  /// Per-head budgets [kv_heads], summing to budget.total (kvpress variant). The kvpress variant promotes each
  /// head's top int(n_kept * alpha) entries to the safeguard tier of `scores`, so that the per-head selection that
  /// follows reproduces the flat top-k exactly. `top_k` ranks across the layer's heads (extend::LocalTopK; over
  /// tensor-parallel ranks, shard::LayerTopK).
  template <class S, class TopK = extend::LocalTopK>
  std::vector<Index> allocate(extend::ScoreMap<S>& scores, const extend::LayerBudget& budget,
                              const TopK& top_k = TopK{}) const {
    if (params_.variant == Variant::original) return allocate_original(scores, budget, top_k);
    const auto n_safe = static_cast<Index>(static_cast<double>(budget.n_kept) * params_.alpha);
    if (n_safe > 0) {
      extend::KeepFlags safe(scores.score.size(), 0);
      for (Index h = 0; h < scores.heads; ++h)
        extend::top_k_of_head(scores, h, std::min(n_safe, scores.length(h)), safe);
      for (std::size_t f = 0; f < safe.size(); ++f)
        if (safe[f])
          scores.promote(static_cast<Index>(f) / scores.tokens, static_cast<Index>(f) % scores.tokens,
                         extend::Tier::safeguard);
    }
    return top_k(scores, budget.total, [](std::size_t) { return true; });
  }

 private:
  template <class S, class TopK>
  std::vector<Index> allocate_original(const extend::ScoreMap<S>& scores, const extend::LayerBudget& budget,
                                       const TopK& top_k) const {
    if (budget.protected_prefix > 0)
      throw invalid_argument(
          "kvevict::HeadAdaptiveAllocation (variant original): a protected prefix is not supported (its formula "
          "divides the scored prefix and adds the window); use the kvpress variant");
    const Index w = budget.window;
    const auto n_kept = static_cast<Index>(budget.n_kept);
    if (n_kept <= w) return std::vector<Index>(static_cast<std::size_t>(scores.heads), n_kept);  // L_h > w
    const Index prefix_budget = n_kept - w;
    std::vector<Index> b = top_k(scores, top_k.heads(scores) * prefix_budget,
                                 [&](std::size_t f) { return scores.tier[f] == extend::Tier::scored; });
    const double floor_share = std::floor(params_.alpha * static_cast<double>(prefix_budget));
    for (Index h = 0; h < scores.heads; ++h) {  // std::nearbyint rounds half to even in the default rounding mode
      Index& count = b[static_cast<std::size_t>(h)];
      count = static_cast<Index>(std::nearbyint(static_cast<double>(count) * (1.0 - params_.alpha) + floor_share)) + w;
      // A ragged head never keeps more than it holds (docs/algorithms.md#ragged).
      count = std::min(count, scores.length(h));
    }
    return b;
  }

  Params params_;
};

}  // namespace kvevict
