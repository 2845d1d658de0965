#pragma once
/// The DefensiveKV selector (arXiv 2510.13334, ICLR 2026): worst-case aggregation with a prior floor, the value
/// term normalised across KV heads, and cumulative-attention-mass forcing.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/aggregation/defensive.hpp"
#include "kvevict/forcing/mass_forcing.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/shard/exchange.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// Scores s'[h][j] = M[h][j] * Nn[h][j] with M the defensive aggregation (docs/algorithms.md#aggregation) and Nn[h][j]
/// = N[h][j] / sum over KV heads of N[.][j] (docs/algorithms.md#value-term, no eps), then one top-k over the layer (or
/// the model). Corrected (default): each head's mass-forced tokens (docs/algorithms.md#forcing, at most n_kept - w) and
/// the window are kept strictly first, in tiers above every score (+infinity in a layer-global top-k). Under
/// reference_quirks they carry the layer maximum of s' and compete by score (exact ties go to the more recent token),
/// the window bias is the reference's, the cap is int(P (1 - cr) - w) (negative: all but the last |cap|) and the flat
/// totals are int(L (1 - cr) Hkv) per layer. `value_term = false` and `mass_forcing = false` give the paper's ablation
/// (the defensive aggregation alone). `open_window` (ours, docs/algorithms.md#open-window): the window's tokens are
/// scored like the prefix (their attention from the later window queries, unpooled, floored at the prefix mean,
/// value-weighted) and only each head's most recent entry is kept first (under reference_quirks it carries the layer
/// maximum, as the window does); the window is still observed whole and the mass forcing is unchanged.
struct DefensiveSelector {
  static constexpr const char* type_name = "DefensiveSelector";
  /// A layer split across ranks scores as on one rank: the window bias and the value normalisation, which sum across
  /// the layer's heads, are exchanged through budget.shard (docs/algorithms.md#sharded).
  static constexpr bool shardable_scores() { return true; }
  struct Params {
    double mass_threshold = 0.9;           ///< tau before the window bias is subtracted
    ValueNorm value_norm = ValueNorm::l1;  ///< norm of the value term
    bool value_term = true;                ///< weight by the normalised value norm
    bool mass_forcing = true;              ///< force each head's cumulative-mass tokens
    bool floor = true;                     ///< adaptive prior floor at the head mean (false: ablation)
    bool open_window = false;              ///< score the window's tokens; keep only the newest first (ours)
    void validate(const char* where) const {
      detail::require(std::isfinite(mass_threshold) && mass_threshold >= 0.0 && mass_threshold <= 1.0, where,
                      "mass_threshold must be in [0, 1], got ", mass_threshold);
    }
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;
  };

  DefensiveSelector() = default;
  explicit DefensiveSelector(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }
  bool reads_values() const { return params_.value_term; }

  /// Under reference_quirks the flat totals are int(L * (1 - cr) * Hkv) (docs/algorithms.md#budgets).
  void adjust_budget(extend::LayerBudget& budget, const extend::LayerShape& shape, const ScoringParams& common,
                     const char* where) const {
    if (!common.reference_quirks) return;
    const double cr = detail::quirk_compression_ratio(budget, where);
    budget.total =
        static_cast<Index>(static_cast<double>(shape.tokens) * (1.0 - cr) * static_cast<double>(shape.kv_heads));
  }

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& budget, const char* where) const {
    if (params_.value_term) extend::validate_value_inputs(in, shape, params_.value_norm, where);
    const auto obs = extend::observe<S>(in, shape, where);
    extend::DefensiveAggregator<S> aggregation(shape, common.kernel, common.pooling, params_.floor,
                                               params_.open_window);
    extend::MassStatistics<S> mass(shape, common.reference_quirks);
    obs.for_each_head([&](Index q, const RowMatrix<S>& rows) {
      aggregation.add(q, rows);
      if (params_.mass_forcing) mass.add(q, rows);
    });
    RowMatrix<S> scores = aggregation.finish();  // M [Hkv, P] ([Hkv, L] with an open window)
    if (params_.value_term) {
      OutputGram<S> scratch;
      const OutputGram<S>* gram = params_.value_norm == ValueNorm::l2 ? &extend::output_gram<S>(in, scratch) : nullptr;
      weight_by_normalised_values(
          scores, extend::value_norms<S>(in.values, in.w_o, shape, params_.value_norm, gram, in.values_scale), shape,
          params_.open_window, budget.shard);
    }

    Layer<S> layer{params_.open_window ? open_window_map(scores, shape)
                                       : extend::ScoreMap<S>::with_window(scores, shape)};
    layer.allocation.require_finite(where);
    std::vector<std::vector<Index>> forced(static_cast<std::size_t>(shape.kv_heads));
    if (params_.mass_forcing) {
      const double tau = params_.mass_threshold - window_bias(mass, shape, budget.shard);
      const Index cap = common.reference_quirks
                            ? static_cast<Index>(static_cast<double>(shape.prefix) *
                                                     (1.0 - detail::quirk_compression_ratio(budget, where)) -
                                                 static_cast<double>(shape.window))
                            : std::max<Index>(0, static_cast<Index>(budget.n_kept) - shape.window);
      for (Index h = 0; h < shape.kv_heads; ++h) forced[static_cast<std::size_t>(h)] = mass.forced_tokens(h, tau, cap);
    }
    if (!common.reference_quirks) {
      // Corrected (per layer and layer-global alike): forced and window tokens form tiers above every scored entry
      // (+infinity in a layer-global top-k), so a prefix token that ties the layer maximum never displaces them.
      for (Index h = 0; h < shape.kv_heads; ++h)
        for (Index j : forced[static_cast<std::size_t>(h)]) layer.allocation.promote(h, j, extend::Tier::forced);
    } else {
      // Reference: forced tokens and the window (an open window's newest entries) carry the layer maximum of the
      // scored s', then one top-k in the docs/algorithms.md#ties order (a scored token that ties the maximum and is
      // more recent displaces a forced one when they all tie).
      auto& map = layer.allocation;
      S layer_max = S(0);
      bool any = false;
      for (std::size_t f = 0; f < map.score.size(); ++f)
        if (map.tier[f] == extend::Tier::scored && (!any || map.score[f] > layer_max)) {
          layer_max = map.score[f];
          any = true;
        }
      for (Index h = 0; h < shape.kv_heads; ++h) {
        for (Index j : forced[static_cast<std::size_t>(h)]) map.at(h, j) = layer_max;
        for (Index j = 0; j < shape.length(h); ++j)
          if (map.tier[map.flat(h, j)] == extend::Tier::window) {
            map.tier[map.flat(h, j)] = extend::Tier::scored;
            map.at(h, j) = layer_max;
          }
      }
    }
    return layer;
  }

 private:
  /// An open window's map: every entry scored by `scores` [Hkv, L], the newest entry of each head in the window tier.
  template <class S>
  static extend::ScoreMap<S> open_window_map(const RowMatrix<S>& scores, const extend::LayerShape& shape) {
    extend::ScoreMap<S> m(shape);
    for (Index h = 0; h < shape.kv_heads; ++h) {
      for (Index j = 0; j < shape.length(h); ++j) m.at(h, j) = scores(h, j);
      m.promote(h, shape.length(h) - 1, extend::Tier::window);
    }
    return m;
  }

  /// The window bias of the mass forcing: MassStatistics::window_bias(), or on a layer split across ranks the same
  /// sum over every rank's query heads in global order (docs/algorithms.md#sharded).
  template <class S>
  static double window_bias(const extend::MassStatistics<S>& mass, const extend::LayerShape& shape,
                            const shard::LayerShard* shard) {
    if (!shard) return mass.window_bias();
    std::vector<shard::IndexedTerm> terms;
    const std::vector<double>& bias = mass.window_bias_terms();
    for (Index q = 0; q < shape.query_heads; ++q)
      terms.push_back({shard->kv_heads[static_cast<std::size_t>(q / shape.group)] * shape.group + q % shape.group,
                       bias[static_cast<std::size_t>(q)]});
    const shard::OrderedSum all = shard::sum_in_order(*shard->comm, terms);
    return all.sum / static_cast<double>(static_cast<Index>(all.terms) * shape.window);
  }

  /// scores(h, j) *= N[h][j] / (sum of N over the KV heads whose scored entries hold the same position), 0 when
  /// that sum is 0 (docs/algorithms.md#value-term and docs/algorithms.md#ragged; on a dense layer the sum is the
  /// column's, in head order). The scored entries are the prefix, or every entry with an open window. On a layer
  /// split across ranks the sums take every rank's heads, in global head order.
  template <class S>
  static void weight_by_normalised_values(RowMatrix<S>& scores, const RowMatrix<S>& n, const extend::LayerShape& shape,
                                          bool open_window, const shard::LayerShard* shard = nullptr) {
    const auto weight = [&](Index h, Index j, S total) { scores(h, j) *= total > S(0) ? n(h, j) / total : S(0); };
    const auto scored = [&](Index h) { return open_window ? shape.length(h) : shape.prefix_of(h); };
    if (shard) {
      std::vector<shard::PositionTerm<S>> terms;
      for (Index h = 0; h < shape.kv_heads; ++h)
        for (Index j = 0; j < scored(h); ++j) {
          shard::PositionTerm<S> t;
          std::memset(&t, 0, sizeof t);  // the padding too: the bytes go to other ranks
          t.position = shape.position(h, j);
          t.head = shard->kv_heads[static_cast<std::size_t>(h)];
          t.value = n(h, j);
          terms.push_back(t);
        }
      const std::vector<S> totals = shard::sums_by_position(*shard->comm, terms);
      std::size_t i = 0;
      for (Index h = 0; h < shape.kv_heads; ++h)
        for (Index j = 0; j < scored(h); ++j) weight(h, j, totals[i++]);
      return;
    }
    if (!shape.ragged() && shape.positions.heads() == 0) {  // every head holds positions 0 .. L-1
      for (Index j = 0; j < scored(0); ++j) {
        S total = 0;
        for (Index h = 0; h < shape.kv_heads; ++h) total += n(h, j);
        for (Index h = 0; h < shape.kv_heads; ++h) weight(h, j, total);
      }
      return;
    }
    struct Entry {
      std::int64_t position;
      Index head, row;
    };
    std::vector<Entry> entries;  // every prefix entry, grouped by position, heads in order inside a group
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = 0; j < scored(h); ++j) entries.push_back({shape.position(h, j), h, j});
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.position != b.position ? a.position < b.position : a.head < b.head;
    });
    for (std::size_t first = 0, last = 0; first < entries.size(); first = last) {
      S total = 0;
      for (last = first; last < entries.size() && entries[last].position == entries[first].position; ++last)
        total += n(entries[last].head, entries[last].row);
      for (std::size_t e = first; e < last; ++e) weight(entries[e].head, entries[e].row, total);
    }
  }

  Params params_;
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
