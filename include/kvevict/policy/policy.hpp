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
#include "kvevict/policy/contracts.hpp"
#include "kvevict/policy/layer_global_policy.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// A per-layer eviction policy. Immutable after construction; select() is const and may be called from several
/// threads at once.
///   Base:     an allocation (UniformAllocation, HeadAdaptiveAllocation) or any scored preset whose allocation to
///             reuse, with that preset's allocation defaults: Policy<DefensiveKV, CriticalSelector> allocates as
///             DefensiveKV (flat top-k, alpha = 0) and scores as CriticalKV. A layer-global preset as Base gives
///             the layer-global policy of the selector (the specialisation below).
///   Selector: AttentionSelector (default), CriticalSelector, DefensiveSelector, or your own (docs/extending.md).
template <class Base, class Selector = AttentionSelector, class = void>
class Policy {
  static_assert(detail::base_traits<Base>::valid,
                "kvevict::Policy<Base, Selector>: Base must be an allocation (UniformAllocation, "
                "HeadAdaptiveAllocation, or a type meeting the Allocation contract of docs/extending.md) or a scored "
                "preset (SnapKV, AdaKV, CriticalKV, CriticalSnapKV, DefensiveKV, AdaKVDefensive, LayerDefensiveKV); "
                "StreamingLLM is positional and has no allocation to reuse");
  static_assert(detail::is_selector<Selector>::value,
                "kvevict::Policy<Base, Selector>: Selector must meet the Selector contract (Params, Layer<S>, "
                "adjust_budget, score<S>, select; see selectors/selector.hpp): AttentionSelector, CriticalSelector, "
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
  /// Whether select() reads the window observation (queries or attention), and values and W_o.
  static constexpr bool reads_observation() { return true; }
  bool reads_values() const { return selector_.reads_values(); }

  /// Selects what one layer keeps. S is the arithmetic type (float, or double to compare with a float64
  /// reference); KV, Q and W the storage types of the inputs. Throws kvevict::invalid_argument on bad shapes or
  /// budgets, with a message that starts with "kvevict::<name>::select: ".
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    return select_as<S>(in, budget, name_ + "::select");
  }
  /// The same for layer `layer` of a model: error messages start with "kvevict::<name>::select (layer <i>): ".
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    return select_as<S>(in, budget, name_ + "::select (layer " + std::to_string(layer) + ")");
  }

 private:
  template <class S, class KV, class Q, class W>
  Selection select_as(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where) const {
    const extend::LayerShape shape = detail::validate_inputs(in, params_.window, where.c_str());
    detail::require_dense_for_quirks(shape, params_.reference_quirks, where.c_str());
    extend::LayerBudget layer = extend::layer_budget(shape, budget, where.c_str());
    selector_.adjust_budget(layer, shape, params_, where.c_str());
    auto scored =
        selector_.template score<S>(in, shape, static_cast<const CommonParams&>(params_), layer, where.c_str());
    detail::require_layout(scored.allocation, shape, where.c_str());
    const std::vector<Index> budgets = allocation_.allocate(scored.allocation, layer);
    extend::KeepFlags keep;
    selector_.select(scored, budgets, keep);
    return Selection::from_flags(keep, shape);
  }

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
