#pragma once
/// What an allocator distributes for one layer.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict::shard {
struct LayerShard;
}  // namespace kvevict::shard

namespace kvevict::extend {

/// n_kept per KV head on average (window included), the total to distribute (Hkv * n_kept per layer unless a
/// reference quirk says otherwise), the window size, and the compression ratio when the budget was given as one
/// (NaN otherwise; only the reference quirks' formulas read it), and whether the budget is shared across layers.
struct LayerBudget {
  std::int64_t n_kept = 0;
  Index total = 0;
  Index window = 0;
  double compression_ratio = std::numeric_limits<double>::quiet_NaN();
  /// True when the budget is the model's: one top-k over all layers allocates (LayerGlobalPolicy), or the allocation
  /// schedules each layer's share (PyramidAllocation).
  bool shared_across_layers = false;
  /// Where the layer sits in the model when the caller says so (select(in, budget, layer, layers), select_layers,
  /// plan(budget, layers)): layer in [0, layers); -1 and 0 when unknown. A scheduled allocation (PyramidAllocation)
  /// needs both.
  Index layer = -1;
  Index layers = 0;
  /// The layout's block size (LayoutParams::block): budgets are kept in whole blocks of it.
  Index block = 1;
  /// The protected prefix per head, min(p, L) (Budget::protect_prefix, docs/algorithms.md#protected-prefix): a
  /// scheduled allocation keeps it in every layer.
  Index protected_prefix = 0;
  /// A threshold budget (Budget::threshold, docs/algorithms.md#threshold-budgets): the scores decide the counts, and
  /// the allocation does not run; n_kept above is what the selectors read.
  std::optional<Budget> threshold;  /// This rank's part of a layer split across ranks (Policy::select(in, budget,
                                    /// shard), docs/algorithms.md#sharded):
  /// a selector that sums across the layer's heads (DefensiveSelector) exchanges its terms through it; null otherwise.
  const shard::LayerShard* shard = nullptr;
};

/// The place of one layer in its model, as a select() call gives it (unknown parts -1 and 0).
struct LayerPlace {
  Index layer = -1;
  Index layers = 0;
};

/// The budget of one layer of `shape`: n_kept from `budget` (throws unless 1 <= n_kept <= L; on a ragged layer,
/// resolved against the mean entries per head, docs/algorithms.md#ragged), total Hkv * n_kept. With
/// `shared_across_layers` (a layer-global plan, a scheduled allocation) a token budget is not bounded by the layer: a
/// layer may hold less than its share (docs/algorithms.md#streaming).
inline LayerBudget layer_budget(const LayerShape& shape, const Budget& budget, const char* where = "select",
                                bool shared_across_layers = false, LayerPlace place = {}) {
  LayerBudget b;
  b.shared_across_layers = shared_across_layers;
  b.layer = place.layer;
  b.layers = place.layers;
  if (shared_across_layers && budget.kind() == Budget::Kind::tokens)
    b.n_kept = static_cast<std::int64_t>(budget.value()) + budget.extra();
  else if (shape.ragged())
    b.n_kept = budget.n_kept(shape.entries(), shape.kv_heads, where);
  else
    b.n_kept = budget.n_kept(shape.tokens, where);
  b.total = shape.kv_heads * static_cast<Index>(b.n_kept);
  b.window = shape.window;
  b.protected_prefix = static_cast<Index>(std::min<std::int64_t>(budget.protected_prefix(), shape.tokens));
  if (budget.kind() == Budget::Kind::compression_ratio) b.compression_ratio = budget.value();
  if (budget.is_threshold()) b.threshold = budget;
  return b;
}

}  // namespace kvevict::extend
