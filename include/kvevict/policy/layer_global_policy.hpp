#pragma once
/// LayerGlobalPolicy<Selector>: one budget shared by every layer of the model (plan, then apply).

#include <cmath>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// A model-level policy: every layer is scored by the selector, one top-k over all layers allocates the model
/// total (sum over layers of Hkv * n_kept; under reference_quirks int(L (1 - cr) Hkv NL)), then each layer selects
/// with its budgets. Immutable after construction; plan() objects are per call.
template <class Selector>
class LayerGlobalPolicy {
 public:
  struct Params : CommonParams, Selector::Params {
    void validate(const char* where) const {
      CommonParams::validate(where);
      Selector::Params::validate(where);
    }
  };

  /// Scores layers one at a time (an engine can drop each layer's queries after add()), then apply() selects.
  /// Holds a copy of the policy's parameters, so it may outlive the policy.
  template <class S, class T>
  class Plan {
   public:
    Plan(const LayerGlobalPolicy& policy, const Budget& budget) : policy_(policy), budget_(budget) {}

    /// Scores one layer (in model order). Throws kvevict::invalid_argument on bad shapes or budgets.
    void add(const LayerInputs<T>& in) {
      const char* where = "LayerGlobalPolicy::add";
      const LayerShape shape = detail::validate_inputs(in, policy_.params_.window, where);
      LayerBudget b = layer_budget(shape, budget_);
      b.shared_across_layers = true;
      policy_.selector_.adjust_budget(b, shape, policy_.params_);
      layers_.push_back(policy_.selector_.template score<S>(in, shape, policy_.params_, b));
      shapes_.push_back(shape);
      total_ += shape.kv_heads * static_cast<Index>(b.n_kept);
      if (policy_.params_.reference_quirks) {
        const double cr = detail::quirk_compression_ratio(b, where);
        detail::require(shapes_.front().tokens == shape.tokens && shapes_.front().kv_heads == shape.kv_heads, where,
                        "reference_quirks needs every layer to have the same tokens and KV heads, layer ",
                        shapes_.size() - 1, " has ", shape.tokens, " and ", shape.kv_heads);
        quirk_total_ = static_cast<Index>(static_cast<double>(shape.tokens) * (1.0 - cr) *
                                          static_cast<double>(shape.kv_heads) * static_cast<double>(layers_.size()));
      }
    }

    /// Allocates across layers and returns one Selection per added layer.
    std::vector<Selection> apply() const {
      detail::require(!layers_.empty(), "LayerGlobalPolicy::apply", "no layer was added");
      std::vector<const ScoreMap<S>*> maps;
      for (const auto& l : layers_) maps.push_back(&l.allocation);
      const Index total = policy_.params_.reference_quirks ? quirk_total_ : total_;
      const std::vector<std::vector<Index>> budgets = allocate_layer_global(maps, total);
      std::vector<Selection> out;
      KeepFlags keep;
      for (std::size_t l = 0; l < layers_.size(); ++l) {
        policy_.selector_.select(layers_[l], budgets[l], keep);
        out.push_back(Selection::from_flags(keep, shapes_[l].kv_heads, shapes_[l].tokens));
      }
      return out;
    }

   private:
    LayerGlobalPolicy policy_;  // a copy (small): the plan may outlive the policy it came from
    Budget budget_;
    std::vector<typename Selector::template Layer<S>> layers_;
    std::vector<LayerShape> shapes_;
    Index total_ = 0, quirk_total_ = 0;
  };

  LayerGlobalPolicy() : LayerGlobalPolicy(Params{}) {}
  explicit LayerGlobalPolicy(const Params& params)
      : params_((params.validate("LayerGlobalPolicy"), params)), selector_(params) {}
  const Params& params() const { return params_; }

  template <class S = float, class T = float>
  Plan<S, T> plan(const Budget& budget) const {
    return Plan<S, T>(*this, budget);
  }

  /// All layers at once: one Selection per layer.
  template <class S = float, class T>
  std::vector<Selection> select(const std::vector<LayerInputs<T>>& layers, const Budget& budget) const {
    Plan<S, T> p(*this, budget);
    for (const LayerInputs<T>& in : layers) p.add(in);
    return p.apply();
  }

 private:
  Params params_;
  Selector selector_;
};

}  // namespace kvevict
