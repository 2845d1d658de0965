#pragma once
/// Scores from the engine (docs/algorithms.md#engine-scores): a score per cached entry that only the engine can
/// compute (KVzip's context reconstruction, Q-Filters' calibrated directions, ...), given as LayerInputs::scores
/// [Hkv, >= L_h, 1]. The library ranks, allocates and lays them out as any other selector's scores.

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// Prefix entry j of KV head h scores LayerInputs::scores(h, j), pooled along tokens with the common kernel (1 in the
/// presets: the engine's scores are final); the last w entries of each head are the window tier, above every scored
/// entry (w = 0: every entry competes by its score). Reads no queries, attention, keys' values or W_o.
struct EngineScoreSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "EngineScoreSelector";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]
  };

  EngineScoreSelector() = default;
  explicit EngineScoreSelector(const Params&) {}
  /// The engine did the observing: a policy over this selector needs no window queries or attention.
  static constexpr bool reads_observation() { return false; }
  static constexpr bool reads_scores() { return true; }
  bool reads_values() const { return false; }
  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    detail::require(in.scores.heads() * in.scores.rows() * in.scores.cols() > 0, where,
                    "needs LayerInputs::scores [kv_heads, >= entries, 1], the score the engine computed for each "
                    "cached entry; none were given");
    const RowMatrix<S> given =
        detail::read_entry_column<S>(in.scores, shape, where, "scores", "the engine's scores");  // [Hkv, L]
    RowMatrix<S> prefix = RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]: head h's first P_h
    for (Index h = 0; h < shape.kv_heads; ++h)
      extend::pool1d(given.row(h).data(), shape.prefix_of(h), common.kernel, common.pooling, prefix.row(h).data());
    Layer<S> layer{extend::scores_with_window(prefix, shape, common.reference_quirks)};
    layer.allocation.require_finite(where);
    return layer;
  }
};

}  // namespace kvevict
