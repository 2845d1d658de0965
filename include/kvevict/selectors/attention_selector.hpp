#pragma once
/// The default selector (SnapKV, AdaKV): mean-aggregated window attention, window kept first.

#include <vector>

#include "kvevict/aggregation/mean.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// Scores prefix token j of KV head h by s[h][j] (ALGORITHMS.md 2.3, mean); the window ranks above every prefix
/// token; each head keeps its top budgets[h].
struct AttentionSelector {
  static constexpr const char* type_name = "AttentionSelector";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  template <class S>
  struct Layer {
    ScoreMap<S> allocation;
  };

  AttentionSelector() = default;
  explicit AttentionSelector(const Params&) {}
  bool reads_values() const { return false; }

  void adjust_budget(LayerBudget& /*budget*/, const LayerShape& /*shape*/, const CommonParams& /*common*/,
                     const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const LayerShape& shape, const CommonParams& common, const LayerBudget& /*budget*/,
                 const char* where) const {
    const auto obs = observe<S>(in, shape, where);
    Layer<S> layer{scores_with_window(mean_scores(obs, common.kernel, common.pooling), shape.window,
                                      common.reference_quirks)};
    layer.allocation.require_finite(where);
    return layer;
  }

  template <class S>
  void select(const Layer<S>& layer, const std::vector<Index>& budgets, KeepFlags& keep) const {
    select_top_per_head(layer.allocation, budgets, keep);
  }
};

}  // namespace kvevict
