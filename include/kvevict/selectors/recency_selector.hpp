#pragma once
/// RecencySelector: StreamingLLM's scoring (arXiv 2309.17453), positional. Each KV head's entries rank by their
/// original position, its first min(sinks, b_h) entries forced (the attention sinks), where b_h = min(n_kept, L_h):
/// a head keeping b entries keeps its sinks and its most recent b - sinks (docs/algorithms.md#allocation). Reads
/// only the keys' shape, lengths and positions: no window, no queries, no values.

#include <algorithm>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/policy/scoring_params.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict {

class RecencySelector {
 public:
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "RecencySelector";
  struct Params {
    Index sinks = 4;  ///< the first entries of each head, kept first (up to the head's budget)
    void validate(const char* where) const { detail::require(sinks >= 0, where, "sinks must be >= 0, got ", sinks); }
  };

  RecencySelector() = default;
  explicit RecencySelector(const Params& params) : sinks_(params.sinks) {}

  /// Positional: a policy over it reads no observation and keeps no window (its window is 0).
  static constexpr bool reads_observation() { return false; }
  static constexpr bool has_window() { return false; }
  bool reads_values() const { return false; }

  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]: each entry's position as its score, the sinks forced
  };

  void adjust_budget(extend::LayerBudget&, const extend::LayerShape&, const ScoringParams&, const char*) const {}

  /// The recency map of the layer of `shape` (the policy's window is 0: Policy checks it).
  template <class S, class In>
  Layer<S> score(const In&, const extend::LayerShape& shape, const ScoringParams&, const extend::LayerBudget& budget,
                 const char*) const {
    Layer<S> layer{extend::ScoreMap<S>(shape)};
    extend::ScoreMap<S>& m = layer.allocation;
    for (Index h = 0; h < shape.kv_heads; ++h) {
      const Index L = shape.length(h), kept = std::min(static_cast<Index>(budget.n_kept), L);
      for (Index j = 0; j < L; ++j) m.at(h, j) = static_cast<S>(shape.position(h, j));
      for (Index j = 0; j < std::min(sinks_, kept); ++j) m.promote(h, j, extend::Tier::forced);
    }
    return layer;
  }

  /// Each head keeps its top budgets[h] entries of the map. On a recency map (the per-head token map, or a unit map
  /// that stayed one) that is its forced prefix and its last rows, flagged in closed form: O(L), no ranking.
  template <class S>
  void select(const Layer<S>& layer, const std::vector<Index>& budgets, extend::KeepFlags& keep) const {
    const extend::ScoreMap<S>& m = layer.allocation;
    keep.assign(m.score.size(), 0);
    for (Index h = 0; h < m.heads; ++h) {
      const Index b = budgets[static_cast<std::size_t>(h)];
      if (!keep_recent(m, h, b, keep)) extend::top_k_of_head(m, h, b, keep);
    }
  }

 private:
  /// Flags head h's top b entries of `m` when its ranking is recency's: a forced prefix of at most b entries, then
  /// scored entries whose scores never decrease and whose positions increase along the rows (the top-k's order, ties
  /// to the more recent, is then the rows' reverse order). Returns false, flagging nothing, otherwise (a unit map of
  /// a shared group, say, where a reduced score can decrease).
  template <class S>
  static bool keep_recent(const extend::ScoreMap<S>& m, Index h, Index b, extend::KeepFlags& keep) {
    const Index L = m.length(h);
    Index forced = 0;
    while (forced < L &&
           (m.tier_of(h, forced) == extend::Tier::forced || m.tier_of(h, forced) == extend::Tier::protected_prefix))
      ++forced;
    if (forced > b || b > L) return false;
    for (Index j = forced; j < L; ++j) {
      if (m.tier_of(h, j) != extend::Tier::scored) return false;
      if (j > forced && (m.at(h, j) < m.at(h, j - 1) || m.position_of(m.flat(h, j)) <= m.position_of(m.flat(h, j - 1))))
        return false;
    }
    for (Index j = 0; j < forced; ++j) keep[m.flat(h, j)] = 1;
    for (Index j = L - (b - forced); j < L; ++j) keep[m.flat(h, j)] = 1;
    return true;
  }

  Index sinks_ = 4;
};

}  // namespace kvevict
