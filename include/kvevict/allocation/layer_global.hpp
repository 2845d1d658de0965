#pragma once
/// Stage "allocation" (docs/algorithms.md#allocation), layer-global allocation (Layer-DefensiveKV, arXiv 2510.13334):
/// one top-k over the scores of every layer of the model (extend::allocate_layer_global, ranking/topk.hpp) decides how
/// many tokens each (layer, KV head) keeps. Needs all layers' scores first.

#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict {

/// The layer-global allocation (Layer-DefensiveKV): one budget for the whole model, distributed by one top-k over
/// every layer's map (extend::allocate_layer_global). Policy<LayerGlobalAllocation, Selector> (LayerGlobalPolicy)
/// scores every layer first, then allocates across them (docs/algorithms.md#ties).
struct LayerGlobalAllocation {
  static constexpr const char* type_name = "LayerGlobalAllocation";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  LayerGlobalAllocation() = default;
  explicit LayerGlobalAllocation(const Params&) {}

  /// Per-(layer, KV head) budgets from one top-k of `total` entries over every layer's map. `top_k` ranks across
  /// the layers (extend::LocalTopK; layers split across ranks, shard::ModelTopK).
  template <class S, class TopK = extend::LocalTopK>
  std::vector<std::vector<Index>> allocate_model(const std::vector<const extend::ScoreMap<S>*>& layers, Index total,
                                                 const TopK& top_k = TopK{}) const {
    return top_k.across_layers(layers, total);
  }
  /// A model of one layer: its per-head budgets [kv_heads] from the top budget.total entries of the map.
  template <class S>
  std::vector<Index> allocate(extend::ScoreMap<S>& scores, const extend::LayerBudget& budget) const {
    return extend::allocate_layer_global<S>({&scores}, budget.total).front();
  }
};

}  // namespace kvevict
