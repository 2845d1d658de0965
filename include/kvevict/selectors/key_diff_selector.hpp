#pragma once
/// KeyDiff (arXiv 2504.18838, kvpress KeyDiffPress): keys that differ most from the head's average key direction are
/// kept. Reads the keys alone: no queries, no attention, no values (docs/algorithms.md#key-only).

#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/observation/key_rows.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// Anchor of KV head h: a_h [d] = the mean of k_j / ||k_j|| over all its entries j in [0, L_h), window included (a
/// zero key adds 0). Prefix token j scores -cos(k_j, a_h) = -((k_j . a_h) / ||k_j||) / ||a_h||, 0 when either norm
/// is 0; the window ranks above every prefix token; each head keeps its top budgets[h].
struct KeyDiffSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "KeyDiffSelector";
  struct Params {
    void validate(const char* /*where*/) const {}
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]
  };

  KeyDiffSelector() = default;
  explicit KeyDiffSelector(const Params&) {}
  /// Key-only: a policy over this selector needs no window queries or attention (and ignores them when given).
  static constexpr bool reads_observation() { return false; }
  bool reads_values() const { return false; }
  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    detail::require_finite_entries(in.keys, shape, where, "keys", in.keys_scale);
    RowMatrix<S> anchor = RowMatrix<S>::Zero(shape.kv_heads, shape.head_dim);  // [Hkv, d]
    extend::for_each_key_block<S>(in, shape, [&](Index h, Index, const RowMatrix<S>& rows) {
      for (Index r = 0; r < rows.rows(); ++r) {
        const S n = rows.row(r).norm();
        if (n > S(0)) anchor.row(h) += rows.row(r) / n;
      }
    });
    for (Index h = 0; h < shape.kv_heads; ++h) anchor.row(h) /= static_cast<S>(shape.length(h));
    RowMatrix<S> prefix = RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]
    extend::for_each_key_block<S>(in, shape, [&](Index h, Index j0, const RowMatrix<S>& rows) {
      const S a = anchor.row(h).norm();
      for (Index r = 0; r < rows.rows() && j0 + r < shape.prefix_of(h); ++r) {
        const S n = rows.row(r).norm();
        prefix(h, j0 + r) = n > S(0) && a > S(0) ? -(rows.row(r).dot(anchor.row(h)) / n) / a : S(0);
      }
    });
    Layer<S> layer{extend::scores_with_window(prefix, shape, common.reference_quirks)};
    layer.allocation.require_finite(where);
    return layer;
  }
};

}  // namespace kvevict
