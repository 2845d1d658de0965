#pragma once
/// The Selector extension point: how a policy scores a layer and picks each head's tokens once the base
/// allocation has fixed the per-head budgets. CriticalKV and DefensiveKV plug in here; allocators never change.
///
/// A Selector type provides (checked at compile time by Policy: policy/contracts.hpp)
///   static constexpr const char* type_name = "...";                   // optional, for messages
///   struct Params { ...; void validate(const char* where) const; };
///   explicit Selector(const Params&);
///   bool reads_values() const;  // whether score() reads LayerInputs::values and w_o
///   static constexpr bool reads_observation();  // optional, default true: false for key-only scores
///   static constexpr bool has_window();         // optional, default true: false for positional scores (window 0)
///   static constexpr bool reads_queries();      // optional, default false: true when attention rows will not do
///   static constexpr bool reads_scores();       // optional, default false: true when it reads LayerInputs::scores
///   template <class S> struct Layer { ScoreMap<S> allocation; ... };  // state between the two phases
///   void adjust_budget(LayerBudget&, const LayerShape&, const ScoringParams&, const char* where) const;
///       may change the layer total (reference quirks of the flat top-k totals)
///   template <class S, class In>
///   Layer<S> score(const In& in, const LayerShape&, const ScoringParams&, const LayerBudget&, const char* where)
///   const;
///       scoring phase over LayerInputs<KV, Q, W> `in`: observation, aggregation, value term, forcing; fills
///       `allocation`, the ranking the base allocation uses (the allocator may promote entries of it, e.g. AdaKV's
///       safeguard). Errors go through detail::require(ok, where, ...) so that they name the policy.
///   template <class S>
///   void select(const Layer<S>&, const std::vector<Index>& budgets, KeepFlags& keep) const;
///       optional selection phase (CriticalSelector's two stages): sizes keep to [kv_heads, tokens] and clears it
///       (it arrives empty or holding another layer's flags), then flags exactly budgets[h] tokens of every KV head
///       h. Without it each head keeps its top budgets[h] of `allocation` (extend::select_top_per_head)
///   template <class L> static auto score_maps(L& layer);   // only if Layer<S> holds maps besides `allocation`
///       std::tie of every ScoreMap<S> of the Layer, `allocation` first: sharing and blocks convert
///       each of them to units (docs/algorithms.md#layouts), so select() then works on groups and blocks
/// Scoring and selection are separate so that a layer-global allocator can score every layer first, allocate
/// across layers, then select (plan, then apply).

#include <cmath>
#include <vector>

#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/layout/params.hpp"
#include "kvevict/policy/scoring_params.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict::extend {

/// The largest of the prefix scores [Hkv, P] of the layer of `shape` (head h's first P_h), 0 for an empty prefix.
template <class S>
S max_prefix_score(const RowMatrix<S>& prefix_scores, const LayerShape& shape) {
  S m = S(0);
  bool any = false;
  for (Index h = 0; h < shape.kv_heads; ++h)
    for (Index j = 0; j < shape.prefix_of(h); ++j)
      if (!any || prefix_scores(h, j) > m) {
        m = prefix_scores(h, j);
        any = true;
      }
  return m;
}

/// Prefix scores [Hkv, P] followed by the window, on the layer of `shape` (head h: its P_h scores, then its
/// window entries). By default the window is its own tier, above every prefix token. Under reference_quirks it
/// carries the maximum of the whole layer's prefix scores, as the reference pads it: the same ranking inside a layer
/// (exact ties go to the more recent token), but it can lose a layer-global top-k.
template <class S>
ScoreMap<S> scores_with_window(const RowMatrix<S>& prefix_scores, const LayerShape& shape, bool reference_quirks) {
  ScoreMap<S> m = ScoreMap<S>::with_window(prefix_scores, shape);
  if (reference_quirks) {
    const S layer_max = max_prefix_score(prefix_scores, shape);
    for (Index h = 0; h < m.heads; ++h)
      for (Index j = shape.prefix_of(h); j < shape.length(h); ++j) {
        m.tier[m.flat(h, j)] = Tier::scored;
        m.at(h, j) = layer_max;
      }
  }
  return m;
}

/// Selection phase shared by selectors whose final choice is the allocation ranking itself: each head keeps its
/// top budgets[h] entries of `map` (which, for a flat top-k allocation, is exactly that head's share of it).
template <class S>
void select_top_per_head(const ScoreMap<S>& map, const std::vector<Index>& budgets, KeepFlags& keep) {
  KVEVICT_ASSERT(static_cast<Index>(budgets.size()) == map.heads);
  keep.assign(map.score.size(), 0);
  for (Index h = 0; h < map.heads; ++h) top_k_of_head(map, h, budgets[static_cast<std::size_t>(h)], keep);
}

}  // namespace kvevict::extend

namespace kvevict::detail {

/// A column the engine gives per entry, [Hkv, >= L_h, 1] (LayerInputs::accumulated, LayerInputs::scores), as [Hkv, L]
/// in S (entries beyond L_h: 0), checked: shaped and finite. `name` names it in messages, `what` says what it holds.
template <class S, class T>
RowMatrix<S> read_entry_column(const HeadsView<const T>& a, const extend::LayerShape& shape, const char* where,
                               const char* name, const char* what) {
  require(a.heads() == shape.kv_heads && a.rows() >= shape.tokens && a.cols() == 1, where, name, " [", a.heads(), ", ",
          a.rows(), ", ", a.cols(), "] must be [kv_heads = ", shape.kv_heads, ", >= ", shape.tokens, " entries, 1]");
  RowMatrix<S> out = RowMatrix<S>::Zero(shape.kv_heads, shape.tokens);
  for (Index h = 0; h < shape.kv_heads; ++h)
    for (Index j = 0; j < shape.length(h); ++j) {
      const auto x = static_cast<S>(*a.row(h, j));
      require(std::isfinite(static_cast<double>(x)), where, name, "[", h, ", ", j, "] is not finite (",
              static_cast<double>(x), "); ", what, " must be finite");
      out(h, j) = x;
    }
  return out;
}
/// The compression ratio a reference quirk's formula needs; throws when the budget was given another way.
inline double quirk_compression_ratio(const extend::LayerBudget& b, const char* where) {
  require(!std::isnan(b.compression_ratio), where,
          "reference_quirks needs the budget as a compression ratio (Budget::compression_ratio), since the "
          "reference's formulas use it");
  return b.compression_ratio;
}
}  // namespace kvevict::detail
