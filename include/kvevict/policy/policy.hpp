#pragma once
/// Policy<Base, Selector>: a base method's budget allocation composed with a selector's scoring.

#include <type_traits>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

template <class Base, class Selector>
class Policy;

namespace detail {
/// The allocation of a base method: an allocation type itself, or the allocation of a policy used as a base
/// (so Policy<AdaKV, SomeSelector> means "AdaKV's allocation, SomeSelector's scoring").
template <class Base>
struct allocation_of {
  using type = Base;
};
template <class A, class S>
struct allocation_of<Policy<A, S>> {
  using type = typename allocation_of<A>::type;
};
}  // namespace detail

/// A per-layer eviction policy. Immutable after construction; select() is const and may be called from several
/// threads at once.
///   Allocation: UniformAllocation, HeadAdaptiveAllocation, ... (or a policy whose allocation to reuse)
///   Selector:   AttentionSelector (default), ... (see selectors/selector.hpp)
template <class Base, class Selector = AttentionSelector>
class Policy {
 public:
  using Allocation = typename detail::allocation_of<Base>::type;
  using SelectorType = Selector;

  /// All the numbers of the policy in one flat struct, with the papers' defaults
  /// (e.g. `AdaKV::Params p; p.window = 16; p.alpha = 0.1;`).
  struct Params : CommonParams, Allocation::Params, Selector::Params {
    void validate(const char* where) const {
      CommonParams::validate(where);
      Allocation::Params::validate(where);
      Selector::Params::validate(where);
    }
  };

  Policy() : Policy(Params{}) {}
  /// Throws kvevict::invalid_argument naming the first bad field.
  explicit Policy(const Params& params)
      : params_((params.validate("Policy"), params)), allocation_(params), selector_(params) {}

  const Params& params() const { return params_; }

  /// Selects what one layer keeps. S is the arithmetic type (float, or double to compare with a float64
  /// reference); T the storage type of the inputs. Throws kvevict::invalid_argument on bad shapes or budgets.
  template <class S = float, class T>
  Selection select(const LayerInputs<T>& in, const Budget& budget) const {
    const LayerShape shape = detail::validate_inputs(in, params_.window, "select");
    const LayerBudget layer = budget_of(shape, budget);
    auto scored = selector_.template score<S>(in, shape, static_cast<const CommonParams&>(params_), layer);
    const std::vector<Index> budgets = allocation_.allocate(scored.allocation, layer);
    KeepFlags keep;
    selector_.select(scored, budgets, keep);
    return Selection::from_flags(keep, shape.kv_heads, shape.tokens);
  }

 private:
  LayerBudget budget_of(const LayerShape& shape, const Budget& budget) const {
    LayerBudget b = layer_budget(shape, budget);
    selector_.adjust_budget(b, shape, params_);
    return b;
  }

  Params params_;
  Allocation allocation_;
  Selector selector_;
};

}  // namespace kvevict
