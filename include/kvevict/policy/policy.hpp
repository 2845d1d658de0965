#pragma once
/// Policy<Base, Selector>: a base method's budget allocation composed with a selector's scoring.

#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/layout/units.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/policy/layer_global_policy.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// A per-layer eviction policy. Immutable after construction; select() is const and may be called from several
/// threads at once.
///   Base:     an allocation (UniformAllocation, HeadAdaptiveAllocation, PyramidAllocation) or any scored preset
///             whose allocation to reuse, with that preset's allocation defaults: Policy<DefensiveKV,
///             CriticalSelector> allocates as DefensiveKV (flat top-k, alpha = 0) and scores as CriticalKV. A
///             layer-global preset as Base gives the layer-global policy of the selector (the specialisation below).
///   Selector: AttentionSelector (default), CriticalSelector, DefensiveSelector, or your own (docs/extending.md).
template <class Base, class Selector = AttentionSelector, class = void>
class Policy {
  static_assert(detail::base_traits<Base>::valid,
                "kvevict::Policy<Base, Selector>: Base must be an allocation (UniformAllocation, "
                "HeadAdaptiveAllocation, PyramidAllocation, or a type meeting the Allocation contract of "
                "docs/extending.md) or a scored "
                "preset (SnapKV, AdaKV, PyramidKV, CriticalKV, CriticalSnapKV, DefensiveKV, AdaKVDefensive, "
                "LayerDefensiveKV, TOVA, KNorm, KeyDiff, ExpectedAttention, H2O); "
                "StreamingLLM is positional and has no allocation to reuse");
  static_assert(
      detail::is_selector<Selector>::value,
      "kvevict::Policy<Base, Selector>: Selector must meet the Selector contract (Params, Layer<S>, "
      "adjust_budget, score<S>, select if any; see selectors/selector.hpp): AttentionSelector, CriticalSelector, "
      "DefensiveSelector, or your own");
  // Past a failed static_assert, stand-ins keep the compiler from adding pages of follow-up errors.
  using checked_selector = std::conditional_t<detail::is_selector<Selector>::value, Selector, AttentionSelector>;

 public:
  using Allocation = typename std::conditional_t<detail::base_traits<Base>::valid, detail::base_traits<Base>,
                                                 detail::base_traits<UniformAllocation>>::allocation;
  using SelectorType = checked_selector;

  /// All the numbers of the policy in one flat struct, with the papers' defaults and the base's allocation
  /// defaults (e.g. `AdaKV::Params p; p.window = 16; p.alpha = 0.1;`).
  struct Params : CommonParams, Allocation::Params, SelectorType::Params {
    Params() : Allocation::Params(allocation_defaults()) {}
    void validate(const char* where) const {
      CommonParams::validate(where);
      Allocation::Params::validate(where);
      SelectorType::Params::validate(where);
    }
  };

  Policy() : Policy(Params{}) {}
  /// Throws kvevict::invalid_argument naming the first bad field. `name` prefixes every error message.
  explicit Policy(const Params& params, std::string name = default_name())
      : name_(std::move(name)),
        params_((params.validate((name_ + "::Params").c_str()), params)),
        allocation_(params),
        selector_(params) {}

  const Params& params() const { return params_; }
  /// The preset's name (e.g. "SnapKV"), or "Policy<Base, Selector>" for a composition.
  const std::string& name() const { return name_; }
  /// Whether select() reads the window observation (queries or attention), only the queries, values and W_o.
  static constexpr bool reads_observation() { return detail::reads_observation<SelectorType>::value; }
  static constexpr bool reads_queries() { return detail::reads_queries<SelectorType>::value; }
  bool reads_values() const { return selector_.reads_values(); }

  /// Selects what one layer keeps. S is the arithmetic type (float, or double to compare with a float64
  /// reference); KV, Q and W the storage types of the inputs. Throws kvevict::invalid_argument on bad shapes or
  /// budgets, with a message that starts with "kvevict::<name>::select: ". `share = per_model` needs every layer:
  /// use select(layers, budget) or plan().
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    return select_one<S>(in, budget, name_ + "::select");
  }
  /// The same for layer `layer` of a model: error messages start with "kvevict::<name>::select (layer <i>): ".
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    return select_one<S>(in, budget, name_ + "::select (layer " + std::to_string(layer) + ")", {layer, 0});
  }
  /// The same for layer `layer` of a model of `layers` layers: what a scheduled allocation (PyramidKV) needs.
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer, Index layers) const {
    const std::string where = name_ + "::select (layer " + std::to_string(layer) + ")";
    detail::require(layers >= 1 && layer >= 0 && layer < layers, where.c_str(), "layer must be in [0, ", layers,
                    ") (the model's layers), got ", layer);
    return select_one<S>(in, budget, where, {layer, layers});
  }

 private:
  /// One layer after scoring: the selector's state, the layer's shape and token budget, and the error prefix.
  template <class S>
  struct Scored {
    typename SelectorType::template Layer<S> layer;
    extend::LayerShape shape;
    extend::LayerBudget budget;
    std::string where;
    /// Points shape.positions at the map's copy of the positions (after the engine's view is gone).
    void restore_positions() { shape = detail::with_map_positions(shape, layer.allocation); }
  };

 public:
  /// Scores layers one at a time (an engine can drop each layer's queries after add()), then apply() selects: the
  /// way to select every layer under `share = per_model` (docs/algorithms.md section 8); with any other layout the
  /// same as select() on each layer. Holds a copy of the policy.
  template <class S>
  class Plan {
   public:
    /// `layers`: the model's layer count when known (0: not given; a scheduled allocation needs it).
    Plan(const Policy& policy, const Budget& budget, Index layers = 0)
        : policy_(policy), budget_(budget), model_layers_(layers) {
      detail::require(layers >= 0, (policy_.name_ + "::plan").c_str(), "layers must be >= 0, got ", layers);
    }
    /// Scores the next layer (in model order); errors start with "kvevict::<name>::add (layer <i>): ".
    template <class KV, class Q, class W>
    void add(const LayerInputs<KV, Q, W>& in) {
      const auto layer = static_cast<Index>(layers_.size());
      const std::string where = policy_.name_ + "::add (layer " + std::to_string(layer) + ")";
      detail::require(model_layers_ == 0 || layer < model_layers_, where.c_str(), "the plan was made for ",
                      model_layers_, " layers");
      layers_.push_back(policy_.template score_layer<S>(in, budget_, where, {layer, model_layers_}));
      layers_.back().shape.positions = PositionsView();  // the engine's view may not outlive add(): the map has a copy
    }
    /// One Selection per added layer.
    std::vector<Selection> apply() {
      const std::string where = policy_.name_ + "::apply";
      detail::require(!layers_.empty(), where.c_str(), "no layer was added");
      detail::require(model_layers_ == 0 || static_cast<Index>(layers_.size()) == model_layers_, where.c_str(),
                      "the plan was made for ", model_layers_, " layers, ", layers_.size(), " were added");
      for (auto& l : layers_) l.restore_positions();
      if (policy_.params_.share == Sharing::per_model) return policy_.select_model(layers_);
      std::vector<Selection> out;
      for (auto& l : layers_) out.push_back(policy_.select_scored(l));
      return out;
    }

   private:
    Policy policy_;
    Budget budget_;
    Index model_layers_;
    std::vector<Scored<S>> layers_;
  };

  /// A plan for one model: add() every layer in order, then apply(). S is the arithmetic type. `layers`, the
  /// model's layer count, is needed by a scheduled allocation (PyramidKV); apply() then checks that many were added.
  template <class S = float>
  Plan<S> plan(const Budget& budget, Index layers = 0) const {
    return Plan<S>(*this, budget, layers);
  }

  /// All layers at once (any `share`): one Selection per layer.
  template <class S = float, class KV, class Q, class W>
  std::vector<Selection> select(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget) const {
    Plan<S> p(*this, budget, static_cast<Index>(layers.size()));
    for (const auto& in : layers) p.add(in);
    return p.apply();
  }

 private:
  template <class S, class KV, class Q, class W>
  Selection select_one(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where,
                       extend::LayerPlace place = {}) const {
    detail::require(params_.share != Sharing::per_model, where.c_str(),
                    "share = per_model selects every layer at once: use select(layers, budget) or plan()");
    if constexpr (detail::refines_bounds<SelectorType>::value) {
      if (params_.per_head_tokens()) return select_refined<S>(in, budget, where, place);
    }
    Scored<S> scored = score_layer<S>(in, budget, where, place);
    return select_scored(scored);
  }

  /// select_scored's per-head path over a layer scored with upper bounds (the selector's score_bounded): allocate
  /// and select on a copy, let the selector compute what that selection kept at a bound, again until it kept none.
  template <class S, class KV, class Q, class W>
  Selection select_refined(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where,
                           extend::LayerPlace place) const {
    Scored<S> s = score_layer<S>(in, budget, where, place, true);
    extend::KeepFlags keep;
    for (;;) {
      typename SelectorType::template Layer<S> trial = s.layer;  // the allocation may promote entries of its map
      const std::vector<Index> budgets = allocation_.allocate(trial.allocation, s.budget);
      detail::select_kept(selector_, trial, budgets, keep);
      if (!selector_.refine(s.layer, trial, budgets, keep, in, s.shape)) return Selection::from_flags(keep, s.shape);
    }
  }

  template <class S, class KV, class Q, class W>
  Scored<S> score_layer(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where,
                        extend::LayerPlace place, bool bounded = false) const {
    const extend::LayerShape shape = detail::validate_inputs(in, params_.window, where.c_str(), reads_observation());
    detail::require_dense_for_quirks(shape, params_.reference_quirks, where.c_str());
    extend::LayerBudget layer =
        extend::layer_budget(shape, budget, where.c_str(), scheduled() && params_.share != Sharing::per_model, place);
    layer.block = params_.block;
    selector_.adjust_budget(layer, shape, params_, where.c_str());
    if constexpr (scheduled()) {  // the layer's share (per_model: one set of n_kept)
      if (params_.share != Sharing::per_model) allocation_.schedule(layer, shape, where.c_str());
    }
    const auto& common = static_cast<const CommonParams&>(params_);
    (void)bounded;  // only selectors with score_bounded read it
    auto scored = [&] {
      if constexpr (detail::refines_bounds<SelectorType>::value) {
        if (bounded) return selector_.template score_bounded<S>(in, shape, common, layer, where.c_str());
      }
      return selector_.template score<S>(in, shape, common, layer, where.c_str());
    }();
    detail::require_layout(scored.allocation, shape, where.c_str());
    return {std::move(scored), shape, layer, where};
  }

  /// Allocation and selection of one layer (per_head or per_layer sharing).
  template <class S>
  Selection select_scored(Scored<S>& s) const {
    extend::KeepFlags keep;
    if (params_.per_head_tokens()) {
      const std::vector<Index> budgets = allocation_.allocate(s.layer.allocation, s.budget);
      detail::select_kept(selector_, s.layer, budgets, keep);
      return Selection::from_flags(keep, s.shape);
    }
    const extend::Grouping grouping =
        extend::group_maps<S>({&s.layer.allocation}, params_.share, params_.block, s.where.c_str());
    const Index stride = select_units(std::vector<const Scored<S>*>{&s}, grouping, s.budget, keep);
    return Selection::from_flags(extend::expand(keep, stride, grouping, 0, s.shape), s.shape, params_.block);
  }

  /// One kept set for every layer (per_model): one group, allocated with layer 0's token budget.
  template <class S>
  std::vector<Selection> select_model(std::vector<Scored<S>>& layers) const {
    std::vector<const Scored<S>*> scope;
    std::vector<const extend::ScoreMap<S>*> maps;
    for (const auto& l : layers) {
      scope.push_back(&l);
      maps.push_back(&l.layer.allocation);
    }
    const std::string where = name_ + "::apply";
    const extend::Grouping grouping = extend::group_maps(maps, params_.share, params_.block, where.c_str());
    extend::LayerBudget budget = layers.front().budget;
    budget.total = budget.n_kept;  // one group keeps n_kept tokens
    extend::KeepFlags keep;
    const Index stride = select_units(scope, grouping, budget, keep);
    std::vector<Selection> out;
    for (std::size_t l = 0; l < layers.size(); ++l)
      out.push_back(Selection::from_flags(extend::expand(keep, stride, grouping, l, layers[l].shape), layers[l].shape,
                                          params_.block));
    return out;
  }

  /// Section 8 steps 1-4 on one scope: unit maps, unit budget, the allocation, the selector's selection phase.
  /// Leaves the unit flags in `keep` and returns the unit map's row stride (its widest group's blocks).
  template <class S>
  Index select_units(const std::vector<const Scored<S>*>& scope, const extend::Grouping& grouping,
                     const extend::LayerBudget& tokens, extend::KeepFlags& keep) const {
    using L = typename SelectorType::template Layer<S>;
    std::vector<const L*> layers;
    for (const Scored<S>* s : scope) layers.push_back(&s->layer);
    L units = detail::unit_layer<SelectorType>(layers, grouping, params_.reduce);
    const extend::LayerBudget budget = extend::unit_budget(tokens, grouping, scope.front()->where.c_str());
    const std::vector<Index> budgets = allocation_.allocate(units.allocation, budget);
    detail::select_kept(selector_, units, budgets, keep);
    return units.allocation.tokens;
  }

  /// Whether the allocation gives each layer its share of the model's budget (PyramidAllocation).
  static constexpr bool scheduled() { return detail::schedules_budget<Allocation>::value; }

  static typename Allocation::Params allocation_defaults() {
    if constexpr (detail::base_traits<Base>::valid)
      return detail::base_traits<Base>::allocation_defaults();
    else
      return {};
  }
  static std::string default_name() {
    return "Policy<" + detail::name_of<Base>() + ", " + detail::name_of<Selector>() + ">";
  }

  std::string name_;
  Params params_;
  Allocation allocation_;
  SelectorType selector_;
};

/// A layer-global preset as the base (Policy<LayerDefensiveKV, CriticalSelector>): one budget across layers,
/// scored by the selector; the same as LayerGlobalPolicy<Selector> (plan()/add()/apply() or select(layers)).
template <class Base, class Selector>
class Policy<Base, Selector, std::enable_if_t<detail::is_layer_global<Base>::value>>
    : public LayerGlobalPolicy<Selector> {
 public:
  using typename LayerGlobalPolicy<Selector>::Params;
  Policy() : Policy(Params{}) {}
  explicit Policy(const Params& params,
                  std::string name = "Policy<" + detail::name_of<Base>() + ", " + detail::name_of<Selector>() + ">")
      : LayerGlobalPolicy<Selector>(params, std::move(name)) {}
};

}  // namespace kvevict
