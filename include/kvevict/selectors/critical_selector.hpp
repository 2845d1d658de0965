#pragma once
/// The CriticalKV selector (arXiv 2502.03805, ICML 2026; kvpress CriticalKVPress / CriticalAdaKVPress): attention
/// alone is not what matters, the output perturbation is. Two stages inside each head's budget.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kvevict/aggregation/mean.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/value/value_bound.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// Allocation ranks by the mean attention score s (docs/algorithms.md#aggregation), so the base method (uniform,
/// head-adaptive with its safeguard, layer-global) allocates exactly as it would alone. Then each head h with
/// budget b_h
///   stage 1: keeps its top int(b_h * first_stage_ratio) tokens by s (window and safeguard entries first);
///   stage 2: fills the rest with the best of s'[h][j] = (s[h][j] + eps) * N[h][j] (docs/algorithms.md#value-term).
/// Under reference_quirks the window does not rank first in stage 2: it competes with
/// s' = (layer max of s + eps) * N, as the reference's padded scores do.
/// With the L1 term and `prune` (the default), a policy that selects a layer at once (select(), select_layers)
/// computes N only where it can change stage 2 (docs/algorithms.md#pruned-l1): score_bounded() ranks by an
/// upper bound and refine() computes the exact term for what stage 2 picked at its bound, until it picks none. The
/// selection is the same, bit for bit.
struct CriticalSelector {
  /// Each KV head scored from its own inputs: a layer split across ranks scores alike (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  static constexpr const char* type_name = "CriticalSelector";
  struct Params {
    double eps = 1e-4;                     ///< added to s before weighting by the value norm
    double first_stage_ratio = 0.5;        ///< fraction of each head's budget chosen by attention alone
    ValueNorm value_norm = ValueNorm::l1;  ///< l1 (the papers' code) or l2 (Gram form, O(L d^2))
    bool prune = true;                     ///< l1: compute N only where it can change the selection (same result)
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
    /// Pruned L1 term only (score_bounded): entries of `critical` still at their upper bound [Hkv * L], and the
    /// factor (s + eps) their N is multiplied by; empty when every entry is exact.
    std::vector<std::uint8_t> pending;
    std::vector<S> weight;
  };

  /// Both maps, for the sharing and blocks of docs/algorithms.md#layouts.
  template <class L>
  static auto score_maps(L& layer) {
    return std::tie(layer.allocation, layer.critical);
  }

  CriticalSelector() = default;
  explicit CriticalSelector(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }
  bool reads_values() const { return true; }

  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& /*budget*/, const char* where) const {
    return score_layer<S>(in, shape, common, where, false);
  }

  /// score(), except that with the pruned L1 term the entries of `critical` hold upper bounds of their scores
  /// (marked `pending`) until refine() computes them; used by policies that select right after scoring.
  template <class S, class In>
  Layer<S> score_bounded(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                         const extend::LayerBudget& /*budget*/, const char* where) const {
    return score_layer<S>(in, shape, common, where, prunes(in));
  }

  /// After select(`selected`, budgets, keep) on a copy of `layer` (the allocation may have promoted entries of its
  /// copy): computes the exact score of every entry stage 2 kept at its bound, and of the best other pending
  /// entries of the same heads that fit the free slots of the same products. Returns false when stage 2 kept no
  /// pending entry: then the selection is the one the exact scores give (lowering scores of entries a top-k did not
  /// keep does not change it).
  template <class S, class In>
  bool refine(Layer<S>& layer, const Layer<S>& selected, const std::vector<Index>& budgets,
              const extend::KeepFlags& keep, const In& in, const extend::LayerShape& shape) const {
    if (layer.pending.empty()) return false;
    const extend::ScoreMap<S>& ranking = selected.allocation;
    std::vector<std::vector<Index>> rows(static_cast<std::size_t>(shape.kv_heads));
    bool any = false;
    extend::KeepFlags first(keep.size(), 0);  // stage 1 of each head, as select() chose it
    for (Index h = 0; h < shape.kv_heads; ++h) {
      extend::top_k_of_head(ranking, h, first_stage(budgets[static_cast<std::size_t>(h)]), first);
      std::vector<Index> candidates, all_pending;
      Index scored = 0;
      for (Index j = 0; j < shape.length(h); ++j) {
        const std::size_t f = layer.critical.flat(h, j);
        scored += layer.critical.tier[f] == extend::Tier::scored;
        if (!layer.pending[f]) continue;
        all_pending.push_back(j);
        if (first[f] || ranking.tier[f] >= extend::Tier::safeguard) continue;  // kept whatever their score
        (keep[f] ? rows[static_cast<std::size_t>(h)] : candidates).push_back(j);
      }
      std::vector<Index>& chosen = rows[static_cast<std::size_t>(h)];
      if (chosen.empty()) continue;
      any = true;
      if (static_cast<Index>(all_pending.size()) == scored &&
          most_would_be_computed(layer.critical, h, chosen, candidates, all_pending.size())) {
        chosen = std::move(all_pending);  // the full pass, in its own blocks
        continue;
      }
      fill_free_slots(layer.critical, h, shape.length(h), chosen, candidates);
    }
    if (any) resolve(layer, in, shape, rows);
    return any;
  }
  template <class S>
  void select(const Layer<S>& layer, const std::vector<Index>& budgets, extend::KeepFlags& keep) const {
    keep.assign(layer.allocation.score.size(), 0);
    extend::ScoreMap<S> second = layer.critical;  // safeguard entries of the allocation stay first in stage 2 too
    for (std::size_t f = 0; f < second.tier.size(); ++f)
      if (layer.allocation.tier[f] == extend::Tier::safeguard)
        second.promote(static_cast<Index>(f) / second.tokens, static_cast<Index>(f) % second.tokens,
                       extend::Tier::safeguard);
    for (Index h = 0; h < layer.allocation.heads; ++h) {
      const Index b = budgets[static_cast<std::size_t>(h)];
      const Index first = first_stage(b);
      extend::top_k_of_head(layer.allocation, h, first, keep);
      extend::top_k_of_head(second, h, b - first, keep);
    }
  }

 private:
  Index first_stage(Index budget) const {
    return static_cast<Index>(static_cast<double>(budget) * params_.first_stage_ratio);
  }

  template <class In>
  bool prunes(const In& in) const {
    return params_.prune && params_.value_norm == ValueNorm::l1 && in.w_o.rows() >= extend::kMinPrunedHidden;
  }

  /// Both maps; with `bounded`, `critical` holds (s + eps) * Ubar for the scored entries (value_bound.hpp) and
  /// those whose bound is not finite are computed at once (so a non-finite score is reported as without pruning).
  template <class S, class In>
  Layer<S> score_layer(const In& in, const extend::LayerShape& shape, const ScoringParams& common, const char* where,
                       bool bounded) const {
    extend::validate_value_inputs(in, shape, params_.value_norm, where);
    const auto obs = extend::observe<S>(in, shape, where);
    const RowMatrix<S> s = extend::mean_scores(obs, common.kernel, common.pooling);
    Layer<S> layer{extend::scores_with_window(s, shape, common.reference_quirks), extend::ScoreMap<S>(shape), {}, {}};
    layer.allocation.require_finite(where);

    OutputGram<S> scratch;
    const OutputGram<S>* gram =
        params_.value_norm == ValueNorm::l2 || bounded ? &extend::output_gram<S>(in, scratch) : nullptr;
    const auto length = [&](Index h) { return shape.length(h); };
    const RowMatrix<S> n =
        bounded ? extend::l1_value_bounds<S>(in.values, in.w_o, shape.group, *gram, length, in.values_scale)
                : extend::value_norms<S>(in.values, in.w_o, shape, params_.value_norm, gram, in.values_scale);
    const S eps = static_cast<S>(params_.eps);
    const S layer_max = extend::max_prefix_score(s, shape);
    if (bounded) {
      layer.pending.assign(layer.critical.score.size(), 0);
      layer.weight.assign(layer.critical.score.size(), S(0));
    }
    std::vector<std::vector<Index>> unbounded(static_cast<std::size_t>(shape.kv_heads));
    const auto set = [&](Index h, Index j, S weight) {
      layer.critical.at(h, j) = weight * n(h, j);
      if (!bounded) return;
      const std::size_t f = layer.critical.flat(h, j);
      layer.pending[f] = 1;
      layer.weight[f] = weight;
      if (!std::isfinite(n(h, j))) unbounded[static_cast<std::size_t>(h)].push_back(j);
    };
    for (Index h = 0; h < shape.kv_heads; ++h) {
      for (Index j = 0; j < shape.prefix_of(h); ++j) set(h, j, s(h, j) + eps);
      for (Index j = shape.prefix_of(h); j < shape.length(h); ++j) {
        if (common.reference_quirks)
          set(h, j, layer_max + eps);
        else
          layer.critical.promote(h, j, extend::Tier::window);
      }
    }
    if (bounded) {
      if (extend::ValueTermCounter* counter = extend::ValueTermCounter::active().load()) {
        std::int64_t scored = 0;
        for (std::uint8_t p : layer.pending) scored += p;
        counter->scored += scored;
      }
      resolve(layer, in, shape, unbounded);
    }
    layer.critical.require_finite(where);
    return layer;
  }

  /// On a head's first refine: whether pruning would likely compute most of its pending entries anyway (scores
  /// that hardly vary, e.g. when eps outweighs the attention of most tokens), so that the full pass is cheaper
  /// than selecting again and again. The estimate: the candidates whose bound reaches 0.75 of the lowest bound
  /// stage 2 kept (the L1 norm of a dense D-vector is about sqrt(2 / pi) = 0.8 of sqrt(D) times its L2 norm). Only
  /// the work depends on it, never the selection.
  template <class S>
  static bool most_would_be_computed(const extend::ScoreMap<S>& critical, Index h, const std::vector<Index>& kept,
                                     const std::vector<Index>& candidates, std::size_t pending) {
    S lowest = critical.at(h, kept.front());
    for (Index j : kept) lowest = std::min(lowest, critical.at(h, j));
    const S reach = static_cast<S>(0.75) * lowest;
    std::size_t estimate = kept.size();
    for (Index j : candidates) estimate += critical.at(h, j) >= reach;
    return 2 * estimate > pending;
  }

  /// Adds to `rows` (head h's rows to compute, ascending on return) the best `candidates` by bound that fit the
  /// free slots of the products `rows` needs (l1_value_norms_of_rows): they cost nothing more.
  template <class S>
  static void fill_free_slots(const extend::ScoreMap<S>& critical, Index h, Index length, std::vector<Index>& rows,
                              std::vector<Index>& candidates) {
    constexpr Index block = detail::kL1Block;
    const Index last_start = (length - 1) / block * block;
    std::vector<Index> used(static_cast<std::size_t>(block), 0);
    Index last_used = 0, buffers = 0;
    for (Index j : rows) {
      if (j >= last_start)
        ++last_used;
      else
        buffers = std::max(buffers, ++used[static_cast<std::size_t>(j % block)]);
    }
    const std::size_t free_slots =
        static_cast<std::size_t>(buffers * block - static_cast<Index>(rows.size()) + last_used) +
        (last_used > 0 ? static_cast<std::size_t>(length - last_start - last_used) : 0);
    const std::size_t n = std::min(candidates.size(), free_slots);
    const auto better = [&](Index a, Index b) {
      const S sa = critical.at(h, a), sb = critical.at(h, b);
      return sa != sb ? sa > sb : a > b;
    };
    if (n < candidates.size())
      std::nth_element(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(n), candidates.end(),
                       better);
    std::sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(n), better);
    for (std::size_t i = 0; i < n; ++i) {
      const Index j = candidates[i];
      if (j >= last_start) {
        if (last_used > 0) rows.push_back(j);  // else no product of the last block runs
      } else if (used[static_cast<std::size_t>(j % block)] < buffers) {
        ++used[static_cast<std::size_t>(j % block)];
        rows.push_back(j);
      }
    }
    std::sort(rows.begin(), rows.end());
  }

  /// Exact scores weight * N for `rows[h]` of every head (KV heads in parallel with KVEVICT_OPENMP).
  template <class S, class In>
  void resolve(Layer<S>& layer, const In& in, const extend::LayerShape& shape,
               const std::vector<std::vector<Index>>& rows) const {
    detail::parallel_for(shape.kv_heads, [&](Index h) {
      const std::vector<Index>& r = rows[static_cast<std::size_t>(h)];
      if (r.empty()) return;
      const std::vector<S> n =
          extend::l1_value_norms_of_rows<S>(in.values, in.w_o, shape.group, h, shape.length(h), r, in.values_scale);
      if (extend::ValueTermCounter* counter = extend::ValueTermCounter::active().load())
        counter->computed += static_cast<std::int64_t>(r.size());
      for (std::size_t i = 0; i < r.size(); ++i) {
        const std::size_t f = layer.critical.flat(h, r[i]);
        layer.critical.score[f] = layer.weight[f] * n[i];
        layer.pending[f] = 0;
      }
    });
  }

  Params params_;
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
