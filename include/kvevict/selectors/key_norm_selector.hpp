#pragma once
/// K-norm (arXiv 2406.11430, kvpress KnormPress): keys with a low L2 norm draw high attention, so a cache keeps
/// them. Reads the keys alone: no queries, no attention, no values (docs/algorithms.md#key-only).

#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/observation/key_rows.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// Prefix token j of KV head h scores -||K[h][j]||_2; the window ranks above every prefix token; each head keeps its
/// top budgets[h].
struct KeyNormSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "KeyNormSelector";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]
  };

  KeyNormSelector() = default;
  explicit KeyNormSelector(const Params&) {}
  /// Key-only: a policy over this selector needs no window queries or attention (and ignores them when given).
  static constexpr bool reads_observation() { return false; }
  bool reads_values() const { return false; }
  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    detail::require_finite_entries(in.keys, shape, where, "keys", in.keys_scale);
    RowMatrix<S> prefix = RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]
    extend::for_each_key_block<S>(in, shape, [&](Index h, Index j0, const RowMatrix<S>& rows) {
      for (Index r = 0; r < rows.rows() && j0 + r < shape.prefix_of(h); ++r) prefix(h, j0 + r) = -rows.row(r).norm();
    });
    Layer<S> layer{extend::scores_with_window(prefix, shape, common.reference_quirks)};
    layer.allocation.require_finite(where);
    return layer;
  }
};

}  // namespace kvevict
