#pragma once
/// Stage "allocation", pyramid allocation (PyramidKV, arXiv 2406.02069): per-layer budgets on a line that decreases
/// with depth, the model total unchanged; within a layer every KV head keeps the same number
/// (docs/algorithms.md#allocation).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/ranking/score_map.hpp"

namespace kvevict {

/// Layer l of N keeps n_l = w + s_l per KV head, where s_l is its prefix share (window excluded) of the model's
/// N p, p = n_kept - w, on the pyramid's line t_l = hi - l (hi - lo) / (N - 1), lo = p / beta, hi = 2 p - lo:
/// s_l = floor(t_l), plus 1 for the R = N p - sum floor(t_l) layers of largest t_l - floor(t_l) (the shallower first
/// on ties). The shares sum to N p exactly, never increase with depth and stay within 1 of the line; the line
/// depends on the budget and the depth only, so every layer of a model computes the same one whatever it holds. A
/// layer holding fewer entries than n_l keeps them all (b_h = min(n_l, L_h)): the model keeps at most N Hkv n_kept.
/// With N = 1 or n_kept <= w every layer keeps n_kept. With blocks larger than the window, w is one block, so that
/// every layer keeps one. Needs the layer's place (LayerBudget::layer, layers).
struct PyramidAllocation {
  static constexpr const char* type_name = "PyramidAllocation";
  struct Params {
    double beta = 20.0;  ///< steepness: the last layer's prefix share is 1 / beta of the mean (beta >= 1)
    void validate(const char* where) const {
      detail::require(std::isfinite(beta) && beta >= 1.0, where, "beta must be a finite number >= 1, got ", beta);
    }
  };
  PyramidAllocation() = default;
  explicit PyramidAllocation(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }

  /// Replaces the model's mean budget in `budget` (n_kept, total) by layer budget.layer's share of it, at most the
  /// longest head of the layer.
  void schedule(extend::LayerBudget& budget, const extend::LayerShape& shape, const char* where) const {
    detail::require(budget.layers >= 1 && budget.layer >= 0 && budget.layer < budget.layers, where,
                    "PyramidAllocation needs the layer's place in the model (layer ", budget.layer, " of ",
                    budget.layers,
                    "): call select(in, budget, layer, layers), select_layers(policy, layers, budget) or "
                    "plan(budget, layers)");
    Index longest = 0;
    for (Index h = 0; h < shape.kv_heads; ++h) longest = std::max(longest, shape.length(h));
    // Every layer keeps its protected prefix, then its window and one block.
    const Index least = budget.protected_prefix + std::max(budget.window, budget.block);
    budget.n_kept = std::min<std::int64_t>(layer_share(budget.n_kept, least, budget.layer, budget.layers), longest);
    budget.total = shape.kv_heads * static_cast<Index>(budget.n_kept);
  }

  /// n_l of the class comment, before the cap by what the layer holds: the tokens per KV head that layer `layer` of
  /// `layers` keeps for a mean of n_kept and a floor of w (the window, or one block if larger).
  std::int64_t layer_share(std::int64_t n_kept, Index w, Index layer, Index layers) const {
    const std::int64_t p = n_kept - w;
    if (layers == 1 || p <= 0) return n_kept;
    const double lo = static_cast<double>(p) / params_.beta, hi = 2.0 * static_cast<double>(p) - lo;
    const double step = (hi - lo) / static_cast<double>(layers - 1);
    std::vector<std::int64_t> floors(static_cast<std::size_t>(layers));
    std::vector<double> rest(static_cast<std::size_t>(layers));
    std::int64_t remainder = layers * p;
    for (Index l = 0; l < layers; ++l) {
      const double t = hi - static_cast<double>(l) * step;
      const auto i = static_cast<std::size_t>(l);
      floors[i] = static_cast<std::int64_t>(std::floor(t));
      rest[i] = t - std::floor(t);
      remainder -= floors[i];
    }
    // Layer `layer` gets the extra token when fewer than `remainder` layers come before it in (rest desc, depth).
    const auto me = static_cast<std::size_t>(layer);
    Index before = 0;
    for (std::size_t i = 0; i < rest.size(); ++i)
      if (rest[i] > rest[me] || (rest[i] == rest[me] && i < me)) ++before;
    return static_cast<std::int64_t>(w) + floors[me] + (before < remainder ? 1 : 0);
  }

  /// Per-head budgets [kv_heads]: the layer's n_kept each (at most L_h on a ragged layer), as UniformAllocation
  /// (`top_k`: as UniformAllocation's).
  template <class S, class TopK = extend::LocalTopK>
  std::vector<Index> allocate(extend::ScoreMap<S>& scores, const extend::LayerBudget& budget,
                              const TopK& top_k = TopK{}) const {
    return UniformAllocation{}.allocate(scores, budget, top_k);
  }

 private:
  Params params_;
};

}  // namespace kvevict
