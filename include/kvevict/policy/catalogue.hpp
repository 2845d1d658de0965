#pragma once
/// The policy catalogue: every named policy once (name -> preset, what its budget guarantees, which knobs apply),
/// and the bases and selectors that compose. kvevict-select, kvevict-demo, the benchmarks and the tests all read
/// it, so a new policy is one line in entries() below.
///
///   kvevict::catalogue::visit("defensivekv", [&](const auto& entry) {
///     const auto policy = entry.make(knobs);            // a kvevict::DefensiveKV with the knobs applied
///     auto kept = kvevict::select_layers(policy, layers, budget);
///   });

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kvevict/allocation/head_adaptive.hpp"
#include "kvevict/allocation/pyramid.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/policy/presets.hpp"
#include "kvevict/selectors/critical_selector.hpp"
#include "kvevict/selectors/defensive_selector.hpp"
#include "kvevict/selectors/engine_score_selector.hpp"
#include "kvevict/selectors/expected_attention_selector.hpp"
#include "kvevict/selectors/h2o_selector.hpp"
#include "kvevict/selectors/key_diff_selector.hpp"
#include "kvevict/selectors/key_norm_selector.hpp"

namespace kvevict {

/// Every tunable parameter of the presets, each optional: an unset knob keeps the preset's default. The names are
/// those of the Params fields (and of kvevict-select's options, with '-' for '_').
struct Knobs {
  std::optional<Index> window, kernel;
  std::optional<Pooling> pooling;
  std::optional<bool> reference_quirks;
  std::optional<double> redundancy;                              // ScoringParams (R-KV's 1 - lambda)
  std::optional<Sharing> share;                                  // LayoutParams (every policy)
  std::optional<Reduce> reduce;                                  // LayoutParams
  std::optional<Index> block;                                    // LayoutParams
  std::optional<double> alpha;                                   // HeadAdaptiveAllocation
  std::optional<double> beta;                                    // PyramidAllocation
  std::optional<HeadAdaptiveAllocation::Variant> adakv_variant;  // HeadAdaptiveAllocation::Params::variant
  std::optional<Index> sinks;                                    // RecencySelector (StreamingLLM)
  std::optional<double> eps, first_stage_ratio;                  // CriticalSelector
  std::optional<ValueNorm> value_norm;                           // CriticalSelector, DefensiveSelector
  std::optional<double> mass_threshold;                          // DefensiveSelector
  std::optional<bool> floor, value_term, mass_forcing;           // DefensiveSelector (value_term: also Expected)
  std::optional<bool> open_window;                               // DefensiveSelector
  std::optional<double> rope_theta;                              // ExpectedAttentionSelector
  std::optional<Index> rotary_dim, future_positions;             // ExpectedAttentionSelector
  std::optional<RopeLayout> rope_layout;                         // ExpectedAttentionSelector
  std::optional<bool> covariance;                                // ExpectedAttentionSelector
  std::optional<double> recent_share;                            // H2OSelector
};

namespace detail {
/// Calls f(name, knob, member pointer) for every knob that Params has.
template <class Params, class K, class F>
void for_each_knob(K& k, F&& f) {
  if constexpr (std::is_base_of_v<LayoutParams, Params>) {
    f("share", k.share, &LayoutParams::share);
    f("reduce", k.reduce, &LayoutParams::reduce);
    f("block", k.block, &LayoutParams::block);
  }
  // A positional policy (StreamingLLM: RecencySelector) observes nothing: no window, pooling or reference quirks.
  if constexpr (std::is_base_of_v<ScoringParams, Params> && !std::is_base_of_v<RecencySelector::Params, Params>) {
    f("window", k.window, &ScoringParams::window);
    f("pooling", k.pooling, &ScoringParams::pooling);
    f("kernel", k.kernel, &ScoringParams::kernel);
    f("reference_quirks", k.reference_quirks, &ScoringParams::reference_quirks);
    f("redundancy", k.redundancy, &ScoringParams::redundancy);
  }
  if constexpr (std::is_base_of_v<HeadAdaptiveAllocation::Params, Params>) {
    f("alpha", k.alpha, &HeadAdaptiveAllocation::Params::alpha);
    f("adakv_variant", k.adakv_variant, &HeadAdaptiveAllocation::Params::variant);
  }
  if constexpr (std::is_base_of_v<PyramidAllocation::Params, Params>)
    f("beta", k.beta, &PyramidAllocation::Params::beta);
  if constexpr (std::is_base_of_v<RecencySelector::Params, Params>)
    f("sinks", k.sinks, &RecencySelector::Params::sinks);
  if constexpr (std::is_base_of_v<CriticalSelector::Params, Params>) {
    f("eps", k.eps, &CriticalSelector::Params::eps);
    f("first_stage_ratio", k.first_stage_ratio, &CriticalSelector::Params::first_stage_ratio);
    f("value_norm", k.value_norm, &CriticalSelector::Params::value_norm);
  }
  if constexpr (std::is_base_of_v<DefensiveSelector::Params, Params>) {
    f("mass_threshold", k.mass_threshold, &DefensiveSelector::Params::mass_threshold);
    f("value_norm", k.value_norm, &DefensiveSelector::Params::value_norm);
    f("floor", k.floor, &DefensiveSelector::Params::floor);
    f("value_term", k.value_term, &DefensiveSelector::Params::value_term);
    f("mass_forcing", k.mass_forcing, &DefensiveSelector::Params::mass_forcing);
    f("open_window", k.open_window, &DefensiveSelector::Params::open_window);
  }
  if constexpr (std::is_base_of_v<ExpectedAttentionSelector::Params, Params>) {
    using E = ExpectedAttentionSelector::Params;
    f("rope_theta", k.rope_theta, &E::rope_theta);
    f("rotary_dim", k.rotary_dim, &E::rotary_dim);
    f("rope_layout", k.rope_layout, &E::rope_layout);
    f("future_positions", k.future_positions, &E::future_positions);
    f("sinks", k.sinks, &E::sinks);
    f("covariance", k.covariance, &E::covariance);
    f("value_term", k.value_term, &E::value_term);
  }
  if constexpr (std::is_base_of_v<H2OSelector::Params, Params>)
    f("recent_share", k.recent_share, &H2OSelector::Params::recent_share);
}

/// Whether two Params of one type hold the same value in every knob they have (allocation defaults, say).
template <class Params>
bool same_knobs(const Params& a, const Params& b) {
  bool same = true;
  const Knobs none;
  for_each_knob<Params>(none, [&](const char*, const auto&, auto member) { same = same && a.*member == b.*member; });
  return same;
}
}  // namespace detail

/// Copies the knobs that are set into `p`, for the fields Params has (the others are ignored: see knob_names()).
template <class Params>
void apply_knobs(const Knobs& k, Params& p) {
  detail::for_each_knob<Params>(k, [&](const char*, const auto& knob, auto member) {
    if (knob) p.*member = *knob;
  });
}

/// The knobs a policy's Params has, in Knobs order.
template <class Params>
std::vector<std::string> knob_names() {
  std::vector<std::string> names;
  const Knobs none;
  detail::for_each_knob<Params>(none, [&](const char* name, const auto&, auto) {
    if (std::find(names.begin(), names.end(), name) == names.end()) names.emplace_back(name);
  });
  return names;
}

/// What a policy's budget guarantees exactly: each KV head keeps n_kept (head), each layer Hkv * n_kept (layer),
/// or the model NL * Hkv * n_kept (model).
enum class BudgetScope { head, layer, model };

template <class P>
constexpr BudgetScope budget_scope() {
  if constexpr (detail::is_layer_global<P>::value || detail::is_scheduled<P>::value)
    return BudgetScope::model;
  else
    return std::is_same_v<typename P::Allocation, UniformAllocation> ? BudgetScope::head : BudgetScope::layer;
}

/// One Selection per layer with any policy: per-layer policies select each layer, layer-global ones plan over all
/// of them (one budget across layers), as does share = per_model or a threshold budget bounded per model. Errors
/// name the layer.
template <class S = float, class P, class KV, class Q, class W>
std::vector<Selection> select_layers(const P& policy, const std::vector<LayerInputs<KV, Q, W>>& layers,
                                     const Budget& budget) {
  if constexpr (detail::is_layer_global<P>::value) {
    return policy.template select<S>(layers, budget);
  } else {
    if (policy.params().share == Sharing::per_model ||
        (budget.is_threshold() && budget.bounds_scope() == Budget::Scope::model))
      return policy.template select<S>(layers, budget);
    // A layer's place among the evicted layers (docs/algorithms.md#hybrid-models: a layer kept whole is no part of
    // the model, so PyramidKV schedules the others).
    Index evicted = 0;
    for (const auto& in : layers) evicted += in.evict ? 1 : 0;
    std::vector<Selection> out;
    out.reserve(layers.size());
    Index place = 0;
    for (std::size_t l = 0; l < layers.size(); ++l)
      out.push_back(layers[l].evict ? policy.template select<S>(layers[l], budget, place++, evicted)
                                    : policy.template select<S>(layers[l], budget));
    return out;
  }
}

namespace catalogue {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: the presets depend on KVEVICT_OPENMP

/// A catalogue entry: the preset type P under a name, with a one-line summary.
template <class P>
struct Entry {
  using policy_type = P;
  std::string_view name;
  std::string_view summary;

  static constexpr BudgetScope scope = budget_scope<P>();
  static constexpr bool layer_global = detail::is_layer_global<P>::value;
  /// The preset with `knobs` applied over its defaults (validated: throws kvevict::invalid_argument).
  P make(const Knobs& knobs = {}) const {
    typename P::Params p;
    apply_knobs(knobs, p);
    return P(p);
  }
  /// The knobs that apply to it.
  static std::vector<std::string> knobs() { return knob_names<typename P::Params>(); }
};

/// The named policies, in the order reports list them. Adding a policy: one line here.
inline auto entries() {
  return std::make_tuple(
      Entry<StreamingLLM>{"streamingllm", "4 attention sinks + the most recent tokens (arXiv 2309.17453)"},
      Entry<SnapKV>{"snapkv", "mean window attention, pooled; uniform per head (arXiv 2404.14469)"},
      Entry<AdaKV>{"adakv", "SnapKV scores, head-adaptive budgets with a safeguard (arXiv 2407.11550)"},
      Entry<CriticalKV>{"criticalkv", "AdaKV + two stages weighted by ||V W_o^T|| (arXiv 2502.03805)"},
      Entry<CriticalSnapKV>{"criticalkv-snapkv", "CriticalKV's selector on SnapKV's uniform allocation"},
      Entry<DefensiveKV>{"defensivekv", "worst-case aggregation, value term, mass forcing (arXiv 2510.13334)"},
      Entry<LayerDefensiveKV>{"layer-defensivekv", "DefensiveKV with one budget across layers (arXiv 2510.13334)"},
      Entry<AdaKVDefensive>{"adakv-defensive", "AdaKV with the defensive aggregation alone (ablation)"},
      Entry<TOVA>{"tova",
                  "the last query's attention, mean over the layer's heads; one set per layer (arXiv 2401.06104)"},
      Entry<KNorm>{"knorm", "keys of lowest L2 norm; reads keys only (arXiv 2406.11430)"},
      Entry<KeyDiff>{"keydiff", "keys least similar to the head's mean key direction; keys only (arXiv 2504.18838)"},
      Entry<PyramidKV>{"pyramidkv", "SnapKV scores, per-layer budgets decreasing with depth (arXiv 2406.02069)"},
      Entry<ExpectedAttention>{"expected-attention",
                               "attention the next 512 queries are expected to pay, times ||v|| (kvpress)"},
      Entry<H2O>{"h2o", "attention received from every query so far, plus the recent half (arXiv 2306.14048)"},
      Entry<RKV>{"rkv", "SnapKV's attention minus the keys' redundancy, decoding-time (arXiv 2505.24133)"},
      Entry<OpenDefensiveKV>{"open-defensivekv",
                             "ours: Layer-DefensiveKV unpooled, the window's tokens scored instead of kept"},
      Entry<EngineScores>{"engine-scores",
                          "scores the engine computed (LayerInputs::scores: KVzip's replay, ...); flat top-k"},
      Entry<LayerEngineScores>{"layer-engine-scores",
                               "the engine's scores with one budget across layers (KVzip, arXiv 2505.23416)"});
}

/// The bases of a composition Policy<Base, Selector> (their allocation and its defaults) and the selectors.
inline auto bases() {
  return std::make_tuple(Entry<SnapKV>{"snapkv", "uniform allocation"},
                         Entry<AdaKV>{"adakv", "head-adaptive allocation, safeguard alpha = 0.2"},
                         Entry<DefensiveKV>{"defensivekv", "flat top-k over the layer (alpha = 0)"},
                         Entry<LayerDefensiveKV>{"layer", "one top-k across layers"},
                         Entry<PyramidKV>{"pyramidkv", "per-layer budgets on a decreasing line (beta = 20)"});
}
template <class S>
struct SelectorEntry {
  using selector_type = S;
  std::string_view name;
};
inline auto selectors() {
  return std::make_tuple(SelectorEntry<AttentionSelector>{"attention"}, SelectorEntry<CriticalSelector>{"critical"},
                         SelectorEntry<DefensiveSelector>{"defensive"}, SelectorEntry<KeyNormSelector>{"knorm"},
                         SelectorEntry<KeyDiffSelector>{"keydiff"},
                         SelectorEntry<ExpectedAttentionSelector>{"expected"}, SelectorEntry<H2OSelector>{"h2o"},
                         SelectorEntry<EngineScoreSelector>{"engine"});
}

/// Calls f(entry) for every element of a tuple of entries, in order.
template <class Tuple, class F>
void for_each(const Tuple& list, F&& f) {
  std::apply([&](const auto&... e) { (f(e), ...); }, list);
}

/// Names of a tuple of entries, comma-separated (for messages and --help).
template <class Tuple>
std::string names(const Tuple& list) {
  std::string out;
  for_each(list, [&](const auto& e) { out += (out.empty() ? "" : ", ") + std::string(e.name); });
  return out;
}

/// True when an entry of `list` has that name.
template <class Tuple>
bool contains(const Tuple& list, std::string_view name) {
  bool found = false;
  for_each(list, [&](const auto& e) { found = found || e.name == name; });
  return found;
}

/// Calls f(entry) for the named policy; false when no entry has that name.
template <class F>
bool visit(std::string_view name, F&& f) {
  bool found = false;
  for_each(entries(), [&](const auto& e) {
    if (!found && e.name == name) {
      found = true;
      f(e);
    }
  });
  return found;
}

/// The name in bases() of the base that P's allocation is: the first with P's allocation type and allocation
/// defaults ("layer" for a layer-global policy), so that compose(base_of<P>(), selector) allocates as P does.
/// Empty when no base has it.
template <class P>
std::string_view base_of() {
  std::string_view found;
  for_each(bases(), [&](const auto& b) {
    using B = typename std::decay_t<decltype(b)>::policy_type;
    if (!found.empty()) return;
    if constexpr (kvevict::detail::is_layer_global<P>::value || kvevict::detail::is_layer_global<B>::value) {
      if (kvevict::detail::is_layer_global<P>::value && kvevict::detail::is_layer_global<B>::value) found = b.name;
    } else if constexpr (kvevict::detail::base_traits<P>::valid) {
      using A = typename kvevict::detail::base_traits<P>::allocation;
      if constexpr (std::is_same_v<A, typename kvevict::detail::base_traits<B>::allocation>) {
        if (kvevict::detail::same_knobs(kvevict::detail::base_traits<P>::allocation_defaults(),
                                        kvevict::detail::base_traits<B>::allocation_defaults()))
          found = b.name;
      }
    }
  });
  return found;
}

/// Calls f(entry) for Policy<base, selector>, named "<base>+<selector>"; false when either name is unknown.
template <class F>
bool compose(std::string_view base, std::string_view selector, F&& f) {
  bool found = false;
  for_each(bases(), [&](const auto& b) {
    for_each(selectors(), [&](const auto& s) {
      if (found || b.name != base || s.name != selector) return;
      found = true;
      using Base = typename std::decay_t<decltype(b)>::policy_type;
      using Sel = typename std::decay_t<decltype(s)>::selector_type;
      const std::string name = std::string(base) + "+" + std::string(selector);
      f(Entry<Policy<Base, Sel>>{name, "composition"});
    });
  });
  return found;
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace catalogue
}  // namespace kvevict
