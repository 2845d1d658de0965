#pragma once
/// The default selector (SnapKV, AdaKV): mean-aggregated window attention, window kept first.

#include <vector>

#include "kvevict/aggregation/mean.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// Scores prefix token j of KV head h by s[h][j] (docs/algorithms.md#aggregation, mean); the window ranks above every
/// prefix token; each head keeps its top budgets[h].
struct AttentionSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "AttentionSelector";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;
  };

  AttentionSelector() = default;
  explicit AttentionSelector(const Params&) {}
  bool reads_values() const { return false; }

  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    const auto obs = extend::observe<S>(in, shape, where);
    Layer<S> layer{extend::scores_with_window(extend::mean_scores(obs, common.kernel, common.pooling), shape,
                                              common.reference_quirks)};
    layer.allocation.require_finite(where);
    return layer;
  }
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
