#pragma once
/// What an allocator distributes for one layer.

#include <cstdint>
#include <limits>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict::extend {

/// n_kept per KV head on average (window included), the total to distribute (Hkv * n_kept per layer unless a
/// reference quirk says otherwise), the window size, and the compression ratio when the budget was given as one
/// (NaN otherwise; only the reference quirks' formulas read it), and whether the budget is shared across layers.
struct LayerBudget {
  std::int64_t n_kept = 0;
  Index total = 0;
  Index window = 0;
  double compression_ratio = std::numeric_limits<double>::quiet_NaN();
  /// True when one top-k over all layers allocates (LayerGlobalPolicy), so scores are compared across layers.
  bool shared_across_layers = false;
};

/// The budget of one layer of `shape`: n_kept from `budget` (throws unless 1 <= n_kept <= L; on a ragged layer,
/// resolved against the mean entries per head, docs/algorithms.md section 6), total Hkv * n_kept. With
/// `shared_across_layers` (a layer-global plan) a token budget is not bounded by the layer: the plan checks that the
/// model total fits the model's entries, so a layer may hold less than its share (section 7).
inline LayerBudget layer_budget(const LayerShape& shape, const Budget& budget, const char* where = "select",
                                bool shared_across_layers = false) {
  LayerBudget b;
  b.shared_across_layers = shared_across_layers;
  if (shared_across_layers && budget.kind() == Budget::Kind::tokens)
    b.n_kept = static_cast<std::int64_t>(budget.value());
  else if (shape.ragged())
    b.n_kept = budget.n_kept(shape.entries(), shape.kv_heads, where);
  else
    b.n_kept = budget.n_kept(shape.tokens, where);
  b.total = shape.kv_heads * static_cast<Index>(b.n_kept);
  b.window = shape.window;
  if (budget.kind() == Budget::Kind::compression_ratio) b.compression_ratio = budget.value();
  return b;
}

}  // namespace kvevict::extend
