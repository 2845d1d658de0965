#pragma once
/// H2O (arXiv 2306.14048): the heavy hitters, entries that received the most attention from every query so far,
/// plus the most recent entries (docs/algorithms.md#h2o).

#include <cmath>
#include <vector>

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/observation/accumulated_attention.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// Prefix entry j of KV head h scores the attention it has received: LayerInputs::accumulated(h, j) when given (the
/// sums an engine carries across steps), else the attention received from the window queries
/// (extend::attention_received); pooled along tokens with the common kernel. The last r = max(w,
/// floor(recent_share * n_kept)) entries of each head (all of them when it holds fewer) rank with the window, above
/// every scored entry (under reference_quirks they carry the layer's maximum, as the window does); each head keeps
/// its top budgets[h].
struct H2OSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "H2OSelector";
  struct Params {
    double recent_share = 0.5;  ///< the share of n_kept given to the most recent entries (H2O: half)
    void validate(const char* where) const {
      detail::require(recent_share >= 0.0 && recent_share <= 1.0, where, "recent_share must be in [0, 1], got ",
                      recent_share);
    }
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]
  };

  H2OSelector() = default;
  explicit H2OSelector(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }
  bool reads_values() const { return false; }
  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  /// The most recent entries each head keeps whatever their scores under a budget of n_kept per head.
  Index recent(std::int64_t n_kept, Index window) const {
    return std::max(window, static_cast<Index>(std::floor(params_.recent_share * static_cast<double>(n_kept))));
  }

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& budget, const char* where) const {
    const RowMatrix<S> received =
        has_accumulated(in)
            ? detail::read_entry_column<S>(in.accumulated, shape, where, "accumulated", "the received attention")
            : extend::attention_received(extend::observe<S>(in, shape, where));
    RowMatrix<S> prefix = RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]: head h's first P_h
    for (Index h = 0; h < shape.kv_heads; ++h)
      extend::pool1d(received.row(h).data(), shape.prefix_of(h), common.kernel, common.pooling, prefix.row(h).data());
    Layer<S> layer{extend::scores_with_window(prefix, shape, common.reference_quirks)};
    // The recent entries join the window: its tier, or under reference_quirks its score, the layer's maximum.
    const S layer_max = extend::max_prefix_score(prefix, shape);
    const Index r = recent(budget.n_kept, shape.window);
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = std::max<Index>(0, shape.length(h) - r); j < shape.prefix_of(h); ++j)
        if (common.reference_quirks)
          layer.allocation.at(h, j) = layer_max;
        else
          layer.allocation.promote(h, j, extend::Tier::window);
    layer.allocation.require_finite(where);
    return layer;
  }

 private:
  template <class In>
  static bool has_accumulated(const In& in) {
    return in.accumulated.heads() * in.accumulated.rows() * in.accumulated.cols() > 0;
  }

  Params params_;
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
