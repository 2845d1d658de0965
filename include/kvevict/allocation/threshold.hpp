#pragma once
/// Stage "allocation" under a threshold budget (docs/algorithms.md#threshold-budgets): the scores, not a count,
/// decide how many entries each KV head keeps. An entry passes when its score reaches tau or its tier ranks above the
/// scored one; the count of each scope (a head, a layer's map, every map) is the entries that pass, clamped to the
/// budget's bounds, and the best that many of the scope are kept (the order of docs/algorithms.md#ties).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict::detail {

/// The count bounds of a threshold budget in the entries of the maps allocated: tokens, or blocks of `block` rows
/// (lower bound rounded up, upper bound down; a shared group's tail rows are kept as always).
struct CountBounds {
  double tau = 0.0;
  Index lower = 0;
  Index upper = 0;
  Budget::Scope scope = Budget::Scope::head;

  static CountBounds of(const Budget& budget, Index block = 1) {
    CountBounds c;
    c.tau = budget.value();
    c.scope = budget.bounds_scope();
    c.lower = static_cast<Index>((budget.lower() + block - 1) / block);
    c.upper = budget.upper() == std::numeric_limits<std::int64_t>::max() ? std::numeric_limits<Index>::max()
                                                                         : static_cast<Index>(budget.upper() / block);
    return c;
  }
  Index clamp(Index passing, Index entries) const {
    return std::min(entries, std::max(lower, std::min(upper, passing)));
  }
};

/// Whether flat entry f of `map` passes tau: a tier above `scored`, or a score >= tau (compared in double).
template <class S>
bool passes(const extend::ScoreMap<S>& map, std::size_t f, double tau) {
  return map.tier[f] > extend::Tier::scored ||
         (map.tier[f] == extend::Tier::scored && static_cast<double>(map.score[f]) >= tau);
}

/// Per-(map, KV head) counts [maps][kv_heads] of a threshold budget over the maps of one call (a model's layers, or
/// its unit maps): per head each head's count; per layer each map's count, spread over its heads by one top-k; per
/// model the count of every map together, spread by one top-k across maps (allocate_layer_global's order).
template <class S>
std::vector<std::vector<Index>> threshold_budgets(const std::vector<extend::ScoreMap<S>*>& maps,
                                                  const CountBounds& bounds) {
  std::vector<std::vector<Index>> budgets(maps.size());
  Index model_passing = 0, model_entries = 0;
  for (std::size_t m = 0; m < maps.size(); ++m) {
    const extend::ScoreMap<S>& map = *maps[m];
    budgets[m].assign(static_cast<std::size_t>(map.heads), 0);
    Index layer_passing = 0, layer_entries = 0;
    for (Index h = 0; h < map.heads; ++h) {
      Index passing = 0;
      for (Index j = 0; j < map.length(h); ++j) passing += passes(map, map.flat(h, j), bounds.tau) ? 1 : 0;
      budgets[m][static_cast<std::size_t>(h)] = bounds.clamp(passing, map.length(h));
      layer_passing += passing;
      layer_entries += map.length(h);
    }
    if (bounds.scope == Budget::Scope::layer)
      budgets[m] = extend::top_k_counts(map, bounds.clamp(layer_passing, layer_entries));
    model_passing += layer_passing;
    model_entries += layer_entries;
  }
  if (bounds.scope == Budget::Scope::model) {
    std::vector<const extend::ScoreMap<S>*> all(maps.begin(), maps.end());
    budgets = extend::allocate_layer_global(all, bounds.clamp(model_passing, model_entries));
  }
  return budgets;
}

}  // namespace kvevict::detail
