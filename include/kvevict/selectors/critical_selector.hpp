#pragma once
/// The CriticalKV selector (arXiv 2502.03805, ICML 2026; kvpress CriticalKVPress / CriticalAdaKVPress): attention
/// alone is not what matters, the output perturbation is. Two stages inside each head's budget.

#include <cmath>
#include <tuple>
#include <vector>

#include "kvevict/aggregation/mean.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// Allocation ranks by the mean attention score s (2.3), so the base method (uniform, head-adaptive with its
/// safeguard, layer-global) allocates exactly as it would alone. Then each head h with budget b_h
///   stage 1: keeps its top int(b_h * first_stage_ratio) tokens by s (window and safeguard entries first);
///   stage 2: fills the rest with the best of s'[h][j] = (s[h][j] + eps) * N[h][j] (2.4, the value term).
/// Under reference_quirks the window does not rank first in stage 2: it competes with
/// s' = (layer max of s + eps) * N, as the reference's padded scores do.
struct CriticalSelector {
  static constexpr const char* type_name = "CriticalSelector";
  struct Params {
    double eps = 1e-4;                     ///< added to s before weighting by the value norm
    double first_stage_ratio = 0.5;        ///< fraction of each head's budget chosen by attention alone
    ValueNorm value_norm = ValueNorm::l1;  ///< l1 (the papers' code) or l2 (Gram form, O(L d^2))
    void validate(const char* where) const {
      detail::require(std::isfinite(eps) && eps >= 0.0, where, "eps must be finite and >= 0, got ", eps);
      detail::require(std::isfinite(first_stage_ratio) && first_stage_ratio >= 0.0 && first_stage_ratio <= 1.0, where,
                      "first_stage_ratio must be in [0, 1], got ", first_stage_ratio);
    }
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< s with the window, [Hkv, L]
    extend::ScoreMap<S> critical;    ///< s' [Hkv, L]
  };

  /// Both maps, for section 8's sharing and blocks.
  template <class L>
  static auto score_maps(L& layer) {
    return std::tie(layer.allocation, layer.critical);
  }

  CriticalSelector() = default;
  explicit CriticalSelector(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }
  bool reads_values() const { return true; }

  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const CommonParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const CommonParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    extend::validate_value_inputs(in, shape, params_.value_norm, where);
    const auto obs = extend::observe<S>(in, shape, where);
    const RowMatrix<S> s = extend::mean_scores(obs, common.kernel, common.pooling);
    Layer<S> layer{extend::scores_with_window(s, shape, common.reference_quirks), extend::ScoreMap<S>(shape)};
    layer.allocation.require_finite(where);

    OutputGram<S> scratch;
    const OutputGram<S>* gram = params_.value_norm == ValueNorm::l2 ? &extend::output_gram<S>(in, scratch) : nullptr;
    const RowMatrix<S> n = extend::value_norms<S>(in.values, in.w_o, shape, params_.value_norm, gram, in.values_scale);
    const S eps = static_cast<S>(params_.eps);
    const S layer_max = extend::max_prefix_score(s, shape);
    for (Index h = 0; h < shape.kv_heads; ++h) {
      for (Index j = 0; j < shape.prefix_of(h); ++j) layer.critical.at(h, j) = (s(h, j) + eps) * n(h, j);
      for (Index j = shape.prefix_of(h); j < shape.length(h); ++j) {
        if (common.reference_quirks)
          layer.critical.at(h, j) = (layer_max + eps) * n(h, j);
        else
          layer.critical.promote(h, j, extend::Tier::window);
      }
    }
    layer.critical.require_finite(where);
    return layer;
  }

  template <class S>
  void select(const Layer<S>& layer, const std::vector<Index>& budgets, extend::KeepFlags& keep) const {
    keep.assign(layer.allocation.score.size(), 0);
    extend::ScoreMap<S> second = layer.critical;  // safeguard entries of the allocation stay first in stage 2 too
    for (std::size_t f = 0; f < second.tier.size(); ++f)
      if (layer.allocation.tier[f] == extend::Tier::forced)
        second.promote(static_cast<Index>(f) / second.tokens, static_cast<Index>(f) % second.tokens,
                       extend::Tier::forced);
    for (Index h = 0; h < layer.allocation.heads; ++h) {
      const Index b = budgets[static_cast<std::size_t>(h)];
      const auto first = static_cast<Index>(static_cast<double>(b) * params_.first_stage_ratio);
      extend::top_k_of_head(layer.allocation, h, first, keep);
      extend::top_k_of_head(second, h, b - first, keep);
    }
  }

 private:
  Params params_;
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
