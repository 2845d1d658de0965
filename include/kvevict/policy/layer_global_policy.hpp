#pragma once
/// LayerGlobalPolicy<Selector>: one budget shared by every layer of the model (plan, then apply).

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/layout/units.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// A model-level policy: every layer is scored by the selector, one top-k over all layers allocates the model
/// total (sum over layers of Hkv * n_kept; under reference_quirks int(L (1 - cr) Hkv NL)), then each layer selects
/// with its budgets. Immutable after construction; plan() objects are per call.
template <class Selector>
class LayerGlobalPolicy {
  static_assert(
      detail::is_selector<Selector>::value,
      "kvevict::LayerGlobalPolicy<Selector>: Selector must meet the Selector contract (Params, Layer<S>, "
      "adjust_budget, score<S>, select if any; see selectors/selector.hpp): AttentionSelector, CriticalSelector, "
      "DefensiveSelector, or your own");
  using checked_selector = std::conditional_t<detail::is_selector<Selector>::value, Selector, AttentionSelector>;

 public:
  using SelectorType = checked_selector;

  struct Params : CommonParams, SelectorType::Params {
    void validate(const char* where) const {
      CommonParams::validate(where);
      SelectorType::Params::validate(where);
    }
  };

  /// Scores layers one at a time (an engine can drop each layer's queries after add()), then apply() selects.
  /// Holds a copy of the policy, so it may outlive it. S is the arithmetic type; each layer may have its own
  /// storage types.
  template <class S>
  class Plan {
   public:
    /// `layers`: the model's layer count when known (0: not given), checked by add() and apply(). `call` names the
    /// entry point in error messages (select() of one layer goes through a plan too).
    Plan(const LayerGlobalPolicy& policy, const Budget& budget, Index layers = 0, const char* call = "add")
        : policy_(policy), budget_(budget), model_layers_(layers), call_(call) {
      detail::require(layers >= 0, (policy_.name_ + "::plan").c_str(), "layers must be >= 0, got ", layers);
    }

    /// Scores the next layer (in model order). Throws kvevict::invalid_argument on bad shapes or budgets, with a
    /// message that starts with "kvevict::<name>::add (layer <i>): ".
    template <class KV, class Q, class W>
    void add(const LayerInputs<KV, Q, W>& in) {
      const std::string where = policy_.name_ + "::" + call_ + " (layer " + std::to_string(layers_.size()) + ")";
      detail::require(model_layers_ == 0 || static_cast<Index>(layers_.size()) < model_layers_, where.c_str(),
                      "the plan was made for ", model_layers_, " layers");
      const extend::LayerShape shape =
          detail::validate_inputs(in, policy_.params_.window, where.c_str(), reads_observation());
      detail::require_dense_for_quirks(shape, policy_.params_.reference_quirks, where.c_str());
      extend::LayerBudget b = extend::layer_budget(shape, budget_, where.c_str(), true);
      policy_.selector_.adjust_budget(b, shape, policy_.params_, where.c_str());
      auto scored = policy_.selector_.template score<S>(in, shape, policy_.params_, b, where.c_str());
      detail::require_layout(scored.allocation, shape, where.c_str());
      if (policy_.params_.reference_quirks) {
        const double cr = detail::quirk_compression_ratio(b, where.c_str());
        detail::require(
            layers_.empty() || (shapes_.front().tokens == shape.tokens && shapes_.front().kv_heads == shape.kv_heads),
            where.c_str(), "reference_quirks needs every layer to have the same tokens and KV heads, ", "layer ",
            layers_.size(), " has ", shape.tokens, " and ", shape.kv_heads);
        quirk_total_ =
            static_cast<Index>(static_cast<double>(shape.tokens) * (1.0 - cr) * static_cast<double>(shape.kv_heads) *
                               static_cast<double>(layers_.size() + 1));
      }
      layers_.push_back(std::move(scored));
      budgets_.push_back(b);
      shapes_.push_back(shape);
      shapes_.back().positions = PositionsView();  // the engine's view may not outlive add(): the map has a copy
      total_ += shape.kv_heads * static_cast<Index>(b.n_kept);
      entries_ += shape.entries();
    }

    /// Allocates across layers and returns one Selection per added layer.
    std::vector<Selection> apply() const {
      const std::string where = policy_.name_ + "::apply";
      detail::require(!layers_.empty(), where.c_str(), "no layer was added");
      detail::require(model_layers_ == 0 || static_cast<Index>(layers_.size()) == model_layers_, where.c_str(),
                      "the plan was made for ", model_layers_, " layers, ", layers_.size(), " were added");
      if (!policy_.params_.per_head_tokens()) return apply_layout(where);
      detail::require(total_ <= entries_, where.c_str(), "the model budget (", total_,
                      " entries: the sum over layers of kv_heads * n_kept) exceeds what the layers hold (", entries_,
                      ")");
      std::vector<const extend::ScoreMap<S>*> maps;
      for (const auto& l : layers_) maps.push_back(&l.allocation);
      const Index total = policy_.params_.reference_quirks ? quirk_total_ : total_;
      const std::vector<std::vector<Index>> budgets = extend::allocate_layer_global(maps, total);
      std::vector<Selection> out;
      extend::KeepFlags keep;
      for (std::size_t l = 0; l < layers_.size(); ++l) {
        detail::select_kept(policy_.selector_, layers_[l], budgets[l], keep);
        out.push_back(Selection::from_flags(keep, shape(l)));
      }
      return out;
    }

   private:
    using Layer = typename SelectorType::template Layer<S>;

    /// Layer l's shape with the positions of its map (the engine's view is gone after add()).
    extend::LayerShape shape(std::size_t l) const {
      return detail::with_map_positions(shapes_[l], layers_[l].allocation);
    }

    /// Section 8: the groups of every layer (or the model) in units, one top-k of the model's blocks.
    std::vector<Selection> apply_layout(const std::string& where) const {
      const LayoutParams& layout = policy_.params_;
      std::vector<extend::Grouping> groupings;             // one per unit map
      std::vector<std::vector<std::size_t>> scope_layers;  // the layers of each unit map
      if (layout.share == Sharing::per_model) {
        std::vector<const extend::ScoreMap<S>*> maps;
        for (const auto& l : layers_) maps.push_back(&l.allocation);
        groupings.push_back(extend::group_maps(maps, layout.share, layout.block, where.c_str()));
        scope_layers.emplace_back();
        for (std::size_t l = 0; l < layers_.size(); ++l) scope_layers.back().push_back(l);
      } else {
        for (std::size_t l = 0; l < layers_.size(); ++l) {
          groupings.push_back(extend::group_maps<S>({&layers_[l].allocation}, layout.share, layout.block,
                                                    (where + " (layer " + std::to_string(l) + ")").c_str()));
          scope_layers.push_back({l});
        }
      }
      // Tokens the model keeps: n_kept per group (per_model: one group, layer 0's n_kept).
      Index tokens = 0, tails = 0, entries = 0;
      for (std::size_t u = 0; u < groupings.size(); ++u) {
        const extend::LayerBudget& b = budgets_[scope_layers[u].front()];
        detail::require(layout.block <= b.n_kept, where.c_str(), "block (", layout.block, ") must be <= n_kept (",
                        b.n_kept, "): a budget smaller than one block keeps no whole block");
        tokens += static_cast<Index>(groupings[u].groups.size()) * static_cast<Index>(b.n_kept);
        tails += groupings[u].tails();
        entries += groupings[u].entries();
      }
      detail::require(tokens <= entries, where.c_str(), "the model budget (", tokens, " tokens: n_kept per ",
                      layout.share == Sharing::per_head ? "KV head" : "group", ") exceeds what the ",
                      to_string(layout.share), " groups hold (", entries, ")");
      std::vector<Layer> units;
      std::vector<const extend::ScoreMap<S>*> maps;
      units.reserve(groupings.size());
      for (std::size_t u = 0; u < groupings.size(); ++u) {
        std::vector<const Layer*> scope;
        for (std::size_t l : scope_layers[u]) scope.push_back(&layers_[l]);
        units.push_back(detail::unit_layer<SelectorType>(scope, groupings[u], layout.reduce));
      }
      for (Layer& u : units) {
        // The layer-global order ranks forced and window entries alike (by recency); so must each group's own
        // selection, or a group whose share is smaller than its forced blocks would keep other blocks than the
        // top-k chose (in token mode every non-scored entry always fits, section 2.6).
        for (extend::Tier& t : u.allocation.tier)
          if (t == extend::Tier::forced) t = extend::Tier::window;
        maps.push_back(&u.allocation);
      }
      const std::vector<std::vector<Index>> budgets =
          extend::allocate_layer_global(maps, (tokens - tails) / layout.block);
      std::vector<Selection> out(layers_.size());
      extend::KeepFlags keep;
      for (std::size_t u = 0; u < units.size(); ++u) {
        detail::select_kept(policy_.selector_, units[u], budgets[u], keep);
        for (std::size_t i = 0; i < scope_layers[u].size(); ++i) {
          const std::size_t l = scope_layers[u][i];
          const extend::LayerShape s = shape(l);
          out[l] = Selection::from_flags(extend::expand(keep, units[u].allocation.tokens, groupings[u], i, s), s,
                                         layout.block);
        }
      }
      return out;
    }

    LayerGlobalPolicy policy_;  // a copy (small): the plan may outlive the policy it came from
    Budget budget_;
    Index model_layers_;
    std::string call_;
    std::vector<Layer> layers_;
    std::vector<extend::LayerBudget> budgets_;
    std::vector<extend::LayerShape> shapes_;
    Index total_ = 0, quirk_total_ = 0, entries_ = 0;
  };

  LayerGlobalPolicy() : LayerGlobalPolicy(Params{}) {}
  /// Throws kvevict::invalid_argument naming the first bad field. `name` prefixes every error message.
  explicit LayerGlobalPolicy(const Params& params,
                             std::string name = "LayerGlobalPolicy<" + detail::name_of<Selector>() + ">")
      : name_(std::move(name)), params_((params.validate((name_ + "::Params").c_str()), params)), selector_(params) {}
  const Params& params() const { return params_; }
  const std::string& name() const { return name_; }
  /// Whether select() reads the window observation (queries or attention), only the queries, values and W_o.
  static constexpr bool reads_observation() { return detail::reads_observation<SelectorType>::value; }
  static constexpr bool reads_queries() { return detail::reads_queries<SelectorType>::value; }
  bool reads_values() const { return selector_.reads_values(); }

  /// A plan for one model: add() every layer in order, then apply(). S is the arithmetic type. `layers`, the
  /// model's layer count (0: not given), makes add() and apply() check that many are added (Policy::plan's form).
  template <class S = float>
  Plan<S> plan(const Budget& budget, Index layers = 0) const {
    return Plan<S>(*this, budget, layers);
  }

  /// All layers at once: one Selection per layer.
  template <class S = float, class KV, class Q, class W>
  std::vector<Selection> select(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget) const {
    Plan<S> p(*this, budget, static_cast<Index>(layers.size()));
    for (const auto& in : layers) p.add(in);
    return p.apply();
  }

  /// A model of one layer (the budget is that layer's): the same as select({in}, budget).front(), with Policy's
  /// per-layer signatures, so that generic code compiles for both kinds. A layer of a larger model cannot be
  /// selected alone under one budget across layers: layer > 0 or layers > 1 is refused (use select(layers, budget)
  /// or plan()). Errors start with "kvevict::<name>::select (layer <i>): ".
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    return select<S>(in, budget, 0, 1);
  }
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    return select<S>(in, budget, layer, 1);
  }
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer, Index layers) const {
    detail::require(layer == 0 && layers == 1, (name_ + "::select (layer " + std::to_string(layer) + ")").c_str(),
                    "one budget across layers selects every layer at once: use select(layers, budget) or "
                    "plan(budget, layers) (a single layer is a model of one layer: layer 0 of 1), got layer ",
                    layer, " of ", layers);
    Plan<S> p(*this, budget, 1, "select");
    p.add(in);
    return p.apply().front();
  }

 private:
  std::string name_;
  Params params_;
  SelectorType selector_;
};

}  // namespace kvevict
