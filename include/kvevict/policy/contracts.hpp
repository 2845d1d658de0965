#pragma once
/// The compile-time contracts of the extension points (docs/extending.md): what an Allocation and a Selector must
/// provide, and what may serve as the Base of Policy<Base, Selector>. Policy checks them with a
/// static_assert that names what is expected.

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

namespace detail {

/// T::type_name when T declares one (presets, allocations, selectors), for messages.
template <class T, class = void>
struct has_type_name : std::false_type {};
template <class T>
struct has_type_name<T, std::void_t<decltype(T::type_name)>> : std::true_type {};
template <class T>
std::string name_of() {
  if constexpr (has_type_name<T>::value)
    return T::type_name;
  else
    return "(unnamed)";
}

/// An Allocation: `struct Params { void validate(const char*) const; }`, constructible from its Params, and
///   template <class S> std::vector<Index> allocate(ScoreMap<S>& ranking, const LayerBudget&) const;
/// for S = float and double (checked for both).
/// returning the per-KV-head budgets (it may promote entries of the ranking, e.g. a safeguard).
template <class T, class = void>
struct is_allocation : std::false_type {};
template <class T>
struct is_allocation<
    T, std::void_t<typename T::Params, decltype(std::declval<const typename T::Params&>().validate("")),
                   decltype(std::declval<const T&>().allocate(std::declval<extend::ScoreMap<float>&>(),
                                                              std::declval<const extend::LayerBudget&>()))>>
    : std::bool_constant<
          std::is_constructible_v<T, const typename T::Params&> &&
          std::is_same_v<decltype(std::declval<const T&>().allocate(std::declval<extend::ScoreMap<float>&>(),
                                                                    std::declval<const extend::LayerBudget&>())),
                         std::vector<Index>> &&
          std::is_same_v<decltype(std::declval<const T&>().allocate(std::declval<extend::ScoreMap<double>&>(),
                                                                    std::declval<const extend::LayerBudget&>())),
                         std::vector<Index>>> {};

/// An Allocation that gives each layer its own share of the model's budget (PyramidAllocation) declares
///   void schedule(LayerBudget& budget, const LayerShape& shape, const char* where) const;
/// The policy calls it on each layer's budget before scoring, with LayerBudget::layer and layers set from the call;
/// such a policy guarantees the model total (BudgetScope::model) and selects no layer without its place.
template <class T, class = void>
struct schedules_budget : std::false_type {};
template <class T>
struct schedules_budget<T, std::void_t<decltype(std::declval<const T&>().schedule(
                               std::declval<extend::LayerBudget&>(), std::declval<const extend::LayerShape&>(), ""))>>
    : std::true_type {};

/// A policy whose allocation is scheduled (PyramidKV): false for policies without an Allocation.
template <class P, class = void>
struct is_scheduled : std::false_type {};
template <class P>
struct is_scheduled<P, std::void_t<typename P::Allocation>> : schedules_budget<typename P::Allocation> {};

/// Whether a Selector has its own selection phase
///   template <class S> void select(const Layer<S>&, const std::vector<Index>& budgets, KeepFlags& keep) const;
/// (CriticalSelector's two stages); without one each head keeps its top budgets[h] entries of `allocation`.
template <class T, class = void>
struct has_select : std::false_type {};
template <class T>
struct has_select<T, std::void_t<decltype(std::declval<const T&>().select(
                         std::declval<const typename T::template Layer<float>&>(),
                         std::declval<const std::vector<Index>&>(), std::declval<extend::KeepFlags&>()))>>
    : std::true_type {};

/// Whether T names a member `select` at all (a function or a function template): one whose signature is not
/// has_select's is a mistake, not "no select".
template <class T, class = void>
struct names_plain_select : std::false_type {};
template <class T>
struct names_plain_select<T, std::void_t<decltype(&T::select)>> : std::true_type {};
template <class T, class = void>
struct names_template_select : std::false_type {};
template <class T>
struct names_template_select<T, std::void_t<decltype(&T::template select<float>)>> : std::true_type {};
template <class T>
constexpr bool select_is_valid() {
  return has_select<T>::value || !(names_plain_select<T>::value || names_template_select<T>::value);
}

/// A Selector (selectors/selector.hpp documents each member); score<S>() must return Layer<S>.
template <class T, class = void>
struct is_selector : std::false_type {};
template <class T>
struct is_selector<
    T, std::void_t<typename T::Params, decltype(std::declval<const typename T::Params&>().validate("")),
                   typename T::template Layer<float>, decltype(bool{std::declval<const T&>().reads_values()}),
                   decltype(std::declval<const T&>().adjust_budget(std::declval<extend::LayerBudget&>(),
                                                                   std::declval<const extend::LayerShape&>(),
                                                                   std::declval<const ScoringParams&>(), "")),
                   decltype(std::declval<const T&>().template score<float>(
                       std::declval<const LayerInputs<float>&>(), std::declval<const extend::LayerShape&>(),
                       std::declval<const ScoringParams&>(), std::declval<const extend::LayerBudget&>(), "")),
                   decltype(std::declval<const typename T::template Layer<float>&>().allocation)>>
    : std::bool_constant<
          std::is_constructible_v<T, const typename T::Params&> && select_is_valid<T>() &&
          std::is_same_v<decltype(std::declval<const T&>().template score<float>(
                             std::declval<const LayerInputs<float>&>(), std::declval<const extend::LayerShape&>(),
                             std::declval<const ScoringParams&>(), std::declval<const extend::LayerBudget&>(), "")),
                         typename T::template Layer<float>>> {};

/// The selection phase of `selector` on `layer`: its select(), or extend::select_top_per_head of the allocation.
template <class Sel, class L>
void select_kept(const Sel& selector, const L& layer, const std::vector<Index>& budgets, extend::KeepFlags& keep) {
  if constexpr (has_select<Sel>::value)
    selector.select(layer, budgets, keep);
  else
    extend::select_top_per_head(layer.allocation, budgets, keep);
}

/// A Selector that can rank by upper bounds and refine them (CriticalSelector's pruned L1 term):
///   template <class S, class In> Layer<S> score_bounded(in, shape, common, budget, where) const;
///   template <class S, class In> bool refine(Layer<S>& layer, const Layer<S>& selected, budgets, keep, in, shape)
///       const;
/// Policy::select() then loops allocate + select on a copy of the layer until refine() returns false.
template <class T, class = void>
struct refines_bounds : std::false_type {};
template <class T>
struct refines_bounds<
    T, std::void_t<decltype(std::declval<const T&>().template score_bounded<float>(
                       std::declval<const LayerInputs<float>&>(), std::declval<const extend::LayerShape&>(),
                       std::declval<const ScoringParams&>(), std::declval<const extend::LayerBudget&>(), "")),
                   decltype(static_cast<bool>(std::declval<const T&>().refine(
                       std::declval<typename T::template Layer<float>&>(),
                       std::declval<const typename T::template Layer<float>&>(),
                       std::declval<const std::vector<Index>&>(), std::declval<const extend::KeepFlags&>(),
                       std::declval<const LayerInputs<float>&>(), std::declval<const extend::LayerShape&>())))>>
    : std::true_type {};

/// Whether a Selector reads the window observation (LayerInputs::queries or attention): true unless it declares
///   static constexpr bool reads_observation() { return false; }   // key-only scores (KeyNormSelector)
/// A policy over such a selector takes layers without an observation (one that is given is ignored).
template <class T, class = void>
struct reads_observation : std::true_type {};
template <class T>
struct reads_observation<T, std::void_t<decltype(T::reads_observation())>>
    : std::bool_constant<T::reads_observation()> {};

/// Whether a Selector needs the window queries themselves, not attention rows: false unless it declares
///   static constexpr bool reads_queries() { return true; }   // statistics of the queries (Expected Attention)
template <class T, class = void>
struct reads_queries : std::false_type {};
template <class T>
struct reads_queries<T, std::void_t<decltype(T::reads_queries())>> : std::bool_constant<T::reads_queries()> {};

/// Whether a Selector reads the engine's per-entry scores (LayerInputs::scores): false unless it declares
///   static constexpr bool reads_scores() { return true; }   // scores the engine computed (EngineScoreSelector)
template <class T, class = void>
struct reads_scores : std::false_type {};
template <class T>
struct reads_scores<T, std::void_t<decltype(T::reads_scores())>> : std::bool_constant<T::reads_scores()> {};

/// Whether a Selector keeps an observation window (the last `window` entries, above every score): true unless it
/// declares
///   static constexpr bool has_window() { return false; }   // positional (RecencySelector)
/// A policy over such a selector has window 0 (its default; any other value is refused at construction).
template <class T, class = void>
struct has_window : std::true_type {};
template <class T>
struct has_window<T, std::void_t<decltype(T::has_window())>> : std::bool_constant<T::has_window()> {};

/// Whether a layer split across tensor-parallel ranks scores under a Selector as on one rank
/// (docs/algorithms.md#sharded): each KV head scored from its own inputs (no sum, maximum or normalisation across the
/// layer's heads outside reference_quirks), or what crosses heads exchanged through LayerBudget::shard
/// (DefensiveSelector). False unless it declares
///   static constexpr bool shardable_scores() { return true; }
template <class T, class = void>
struct shardable_scores : std::false_type {};
template <class T>
struct shardable_scores<T, std::void_t<decltype(T::shardable_scores())>> : std::bool_constant<T::shardable_scores()> {};

/// Whether Params has a value_norm (a selector with a value term: CriticalSelector, DefensiveSelector).
template <class T, class = void>
struct has_value_norm : std::false_type {};
template <class T>
struct has_value_norm<T, std::void_t<decltype(std::declval<const T&>().value_norm)>> : std::true_type {};

/// Whether an Allocation takes the top-k it ranks across heads with (extend::LocalTopK, shard::LayerTopK):
///   template <class S, class TopK> std::vector<Index> allocate(ScoreMap<S>&, const LayerBudget&, const TopK&) const;
template <class T, class TopK, class = void>
struct allocates_with_top_k : std::false_type {};
template <class T, class TopK>
struct allocates_with_top_k<T, TopK,
                            std::void_t<decltype(std::declval<const T&>().allocate(
                                std::declval<extend::ScoreMap<float>&>(), std::declval<const extend::LayerBudget&>(),
                                std::declval<const TopK&>()))>> : std::true_type {};

/// An Allocation whose budget spans the model's layers (LayerGlobalAllocation) declares
///   template <class S> std::vector<std::vector<Index>> allocate_model(const std::vector<const ScoreMap<S>*>& layers,
///                                                                    Index total) const;
/// returning per-(layer, KV head) budgets summing to `total`; the policy then scores every layer before it allocates.
template <class T, class = void>
struct allocates_model : std::false_type {};
template <class T>
struct allocates_model<T, std::void_t<decltype(std::declval<const T&>().template allocate_model<float>(
                              std::declval<const std::vector<const extend::ScoreMap<float>*>&>(), Index{}))>>
    : std::true_type {};

/// A scored policy (Policy<A, S> or a preset derived from one, such as SnapKV or LayerDefensiveKV).
template <class T, class = void>
struct is_scored_policy : std::false_type {};
template <class T>
struct is_scored_policy<T, std::void_t<typename T::Allocation, typename T::SelectorType, typename T::Params>>
    : std::true_type {};

/// A scored policy with one budget across layers (its allocation allocates_model: LayerDefensiveKV).
template <class T, class = void>
struct is_layer_global : std::false_type {};
template <class T>
struct is_layer_global<T, std::enable_if_t<is_scored_policy<T>::value>> : allocates_model<typename T::Allocation> {};

/// A scored policy whose budget is per layer (SnapKV, DefensiveKV, PyramidKV's scheduled shares).
template <class T>
struct is_layer_policy : std::bool_constant<is_scored_policy<T>::value && !is_layer_global<T>::value> {};

/// What Policy<Base, S> takes from Base: its allocation type and that allocation's default parameters (so that
/// Policy<DefensiveKV, S> allocates as DefensiveKV does, with alpha = 0).
template <class Base, class = void>
struct base_traits {
  static constexpr bool valid = false;
};
template <class Base>
struct base_traits<Base, std::enable_if_t<is_allocation<Base>::value>> {
  static constexpr bool valid = true;
  using allocation = Base;
  static typename Base::Params allocation_defaults() { return {}; }
};
template <class Base>
struct base_traits<Base, std::enable_if_t<!is_allocation<Base>::value && is_scored_policy<Base>::value>> {
  static constexpr bool valid = true;
  using allocation = typename Base::Allocation;
  static typename allocation::Params allocation_defaults() {
    const typename Base::Params defaults;
    return static_cast<const typename allocation::Params&>(defaults);
  }
};

}  // namespace detail
}  // namespace kvevict
