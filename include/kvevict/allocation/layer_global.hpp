#pragma once
/// Stage "allocation" (docs/algorithms.md#allocation), layer-global allocation (Layer-DefensiveKV, arXiv 2510.13334):
/// one top-k over the scores of every layer of the model decides how many tokens each (layer, KV head) keeps. Needs all
/// layers' scores first.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict::extend {

/// Per-(layer, KV head) budgets from one top-k of `total` entries over all layers' maps. Order: the tiers of
/// ScoreMap (safeguard, window, forced, scored), score descending within a tier (0 in the window), then the more
/// recent token (higher original position), the lower layer, the lower KV head (docs/algorithms.md#ties): the
/// per-layer order with the layer between the position and the head. Linear expected time.
template <class S>
std::vector<std::vector<Index>> allocate_layer_global(const std::vector<const ScoreMap<S>*>& layers, Index total) {
  struct Entry {
    std::uint32_t layer;
    std::size_t flat;
  };
  std::vector<Entry> cand;
  std::size_t size = 0;
  for (const ScoreMap<S>* m : layers) size += m->score.size();
  cand.reserve(size);
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (std::size_t f = 0; f < layers[l]->score.size(); ++f)
      if (layers[l]->tier[f] != Tier::absent) cand.push_back({static_cast<std::uint32_t>(l), f});
  KVEVICT_ASSERT(total >= 0 && static_cast<std::size_t>(total) <= cand.size());
  auto ranks_before = [&](const Entry& a, const Entry& b) {
    const int c = detail::compare_ranks(*layers[a.layer], a.flat, *layers[b.layer], b.flat);
    if (c != 0) return c < 0;
    return a.layer != b.layer ? a.layer < b.layer : a.flat < b.flat;  // then the lower layer, the lower KV head
  };
  const auto k = static_cast<std::size_t>(total);
  if (k > 0 && k < cand.size())
    std::nth_element(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k - 1), cand.end(), ranks_before);
  std::vector<std::vector<Index>> budgets(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) budgets[l].assign(static_cast<std::size_t>(layers[l]->heads), 0);
  for (std::size_t i = 0; i < k; ++i)
    ++budgets[cand[i].layer][cand[i].flat / static_cast<std::size_t>(layers[cand[i].layer]->tokens)];
  return budgets;
}

}  // namespace kvevict::extend

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

  /// Per-(layer, KV head) budgets from one top-k of `total` entries over every layer's map.
  template <class S>
  std::vector<std::vector<Index>> allocate_model(const std::vector<const extend::ScoreMap<S>*>& layers,
                                                 Index total) const {
    return extend::allocate_layer_global(layers, total);
  }
  /// A model of one layer: its per-head budgets [kv_heads] from the top budget.total entries of the map.
  template <class S>
  std::vector<Index> allocate(extend::ScoreMap<S>& scores, const extend::LayerBudget& budget) const {
    return extend::allocate_layer_global<S>({&scores}, budget.total).front();
  }
};

}  // namespace kvevict
