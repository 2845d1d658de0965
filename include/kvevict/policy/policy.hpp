#pragma once
/// Policy<Base, Selector>: a base method's budget allocation composed with a selector's scoring, for one layer, a
/// plan over a model's layers, or a whole model at once. One run loop (run() below) serves every entry point:
///   score (each layer) -> group (the layout's units) -> allocate (per layer, or across layers) -> select -> expand

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/allocation/threshold.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/forcing/protected_prefix.hpp"
#include "kvevict/forcing/retrieval_heads.hpp"
#include "kvevict/layout/units.hpp"
#include "kvevict/measure/redundancy.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/shard/layer_shard.hpp"
#include "kvevict/shard/model_shard.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict {

/// An eviction policy. Immutable after construction; select() is const and may be called from several threads at
/// once.
///   Base:     an allocation (UniformAllocation, HeadAdaptiveAllocation, PyramidAllocation, LayerGlobalAllocation)
///             or any scored preset whose allocation to reuse, with that preset's allocation defaults:
///             Policy<DefensiveKV, CriticalSelector> allocates as DefensiveKV (flat top-k, alpha = 0) and scores as
///             CriticalKV; Policy<LayerDefensiveKV, CriticalSelector> allocates across layers.
///   Selector: AttentionSelector (default), CriticalSelector, DefensiveSelector, ..., RecencySelector (StreamingLLM's
///             positional ranking), or your own (docs/extending.md).
/// The allocation decides the budget's scope: each layer alone, each layer its share of the model's budget
/// (PyramidAllocation schedules it), or one budget across layers (LayerGlobalAllocation: every layer is scored
/// before any is allocated, so a layer of a larger model cannot be selected alone).
template <class Base, class Selector = AttentionSelector>
class Policy {
  static_assert(detail::base_traits<Base>::valid,
                "kvevict::Policy<Base, Selector>: Base must be an allocation (UniformAllocation, "
                "HeadAdaptiveAllocation, PyramidAllocation, LayerGlobalAllocation, or a type meeting the Allocation "
                "contract of docs/extending.md) or a scored "
                "preset (SnapKV, AdaKV, PyramidKV, CriticalKV, CriticalSnapKV, DefensiveKV, AdaKVDefensive, "
                "LayerDefensiveKV, TOVA, KNorm, KeyDiff, ExpectedAttention, H2O, StreamingLLM)");
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
  struct Params : ScoringParams, Allocation::Params, SelectorType::Params {
    Params() : Allocation::Params(allocation_defaults()) {
      if constexpr (!detail::has_window<SelectorType>::value) window = 0;
    }
    void validate(const char* where) const {
      ScoringParams::validate(where, reads_observation() ? 1 : 0);
      if constexpr (!detail::has_window<SelectorType>::value) {
        detail::require(window == 0, where, "a positional policy observes no window: window must be 0, got ", window);
        detail::require(redundancy == 0.0, where,
                        "a positional policy has no scores to weigh: redundancy must be 0, got ", redundancy);
      }
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
  /// Whether select() reads the window observation (queries or attention), only the queries, the engine's scores,
  /// values and W_o.
  static constexpr bool reads_observation() { return detail::reads_observation<SelectorType>::value; }
  static constexpr bool reads_queries() { return detail::reads_queries<SelectorType>::value; }
  static constexpr bool reads_scores() { return detail::reads_scores<SelectorType>::value; }
  bool reads_values() const { return selector_.reads_values(); }
  /// Whether one budget spans the model's layers (LayerGlobalAllocation): select every layer at once.
  static constexpr bool allocates_model() { return detail::allocates_model<Allocation>::value; }

  /// Selects what one layer keeps. S is the arithmetic type (float, or double to compare with a float64
  /// reference); KV, Q and W the storage types of the inputs. Throws kvevict::invalid_argument on bad shapes or
  /// budgets, with a message that starts with "kvevict::<name>::select: ". `share = per_model` needs every layer:
  /// use select(layers, budget) or plan(). Under one budget across layers the layer is a model of one layer.
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    if constexpr (allocates_model()) return select<S>(in, budget, 0, 1);
    return select_one<S>(in, budget, name_ + "::select");
  }
  /// The same for layer `layer` of a model: error messages start with "kvevict::<name>::select (layer <i>): ".
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    if constexpr (allocates_model()) return select<S>(in, budget, layer, 1);
    return select_one<S>(in, budget, name_ + "::select (layer " + std::to_string(layer) + ")", {layer, 0});
  }
  /// The same for layer `layer` of a model of `layers` layers: what a scheduled allocation (PyramidKV) needs. One
  /// budget across layers selects every layer at once: only layer 0 of 1 is accepted.
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer, Index layers) const {
    const std::string where = name_ + "::select (layer " + std::to_string(layer) + ")";
    if constexpr (allocates_model())
      detail::require(layer == 0 && layers == 1, where.c_str(),
                      "one budget across layers selects every layer at once: use select(layers, budget) or "
                      "plan(budget, layers) (a single layer is a model of one layer: layer 0 of 1), got layer ",
                      layer, " of ", layers);
    else
      detail::require(layers >= 1 && layer >= 0 && layer < layers, where.c_str(), "layer must be in [0, ", layers,
                      ") (the model's layers), got ", layer);
    return select_one<S>(in, budget, where, {layer, layers});
  }

  /// This rank's part of a layer whose KV heads are split across tensor-parallel ranks (docs/algorithms.md#sharded):
  /// `in` holds the heads shard.kv_heads (their query heads and W_o columns), and every rank of shard.comm calls this
  /// with its own part. Keeps, for these heads, exactly what select(whole layer, budget) keeps. Needs a selector whose
  /// scores shard (shardable_scores) and a per-layer allocation (SnapKV, AdaKV, CriticalKV, CriticalSnapKV,
  /// DefensiveKV, AdaKVDefensive, KNorm, KeyDiff, H2O, StreamingLLM, EngineScores), per head and token, without
  /// reference_quirks, and a count budget; anything else is refused by name. Errors are thrown on every rank (no rank
  /// is left waiting at a collective).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, const shard::LayerShard& shard) const {
    return select_sharded<S>(in, budget, shard,
                             name_ + "::select (sharded, layer " + std::to_string(shard.layer) + ")");
  }

  /// This rank's layers of a model split across pipeline stages and tensor-parallel ranks (docs/algorithms.md#sharded):
  /// layers[i] holds layer shard.layers[i]'s KV heads shard.kv_heads, and every rank of shard.comm calls this with its
  /// own part. Keeps, for these heads and layers, exactly what select(every layer, budget) keeps on one rank. Takes
  /// what select(in, budget, LayerShard) takes, and the layer-global policies with such a selector (LayerDefensiveKV,
  /// OpenDefensiveKV, LayerEngineScores, LayerGlobalPolicy<...>). Errors are thrown on every rank of shard.comm.
  template <class S = float, class KV, class Q, class W>
  std::vector<Selection> select(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget,
                                const shard::ModelShard& shard) const;

 private:
  /// One layer after scoring: the selector's state, the layer's shape and token budget, and the error prefix of
  /// the call that selects it.
  template <class S>
  struct Scored {
    typename SelectorType::template Layer<S> layer;
    extend::LayerShape shape;
    extend::LayerBudget budget;
    std::string where;
    /// LayerInputs::retrieval_heads under a layout (docs/algorithms.md#layouts): their groups are forced whole after
    /// the forcing cap. Per head in tokens they are forced in the maps themselves and this is empty.
    std::vector<Index> retrieval_heads = {};
    /// Points shape.positions at the map's copy of the positions (after the engine's view is gone).
    void restore_positions() { shape = detail::with_map_positions(shape, layer.allocation); }
  };

 public:
  /// Scores layers one at a time (an engine can drop each layer's queries after add()), then apply() selects: the
  /// way to select every layer under one budget across layers or `share = per_model` (docs/algorithms.md#layouts);
  /// otherwise the same as select() on each layer. Holds a copy of the policy, so it may outlive it.
  template <class S>
  class Plan {
   public:
    /// `layers`: the model's evicted layers when known (every layer but those kept whole, LayerInputs::evict; 0: not
    /// given; a scheduled allocation needs it).
    Plan(const Policy& policy, const Budget& budget, Index layers = 0)
        : policy_(policy), budget_(budget), model_layers_(layers) {
      detail::require(layers >= 0, (policy_.name_ + "::plan").c_str(), "layers must be >= 0, got ", layers);
    }
    /// Scores the next layer (in model order); errors start with "kvevict::<name>::add (layer <i>): ".
    template <class KV, class Q, class W>
    void add(const LayerInputs<KV, Q, W>& in) {
      const std::string where = policy_.name_ + "::add (layer " + std::to_string(added_) + ")";
      if (!in.evict) {  // kept whole (docs/algorithms.md#hybrid-models): no part of the model's budget
        whole_.emplace_back(added_, policy_.keep_whole(in, where));
        ++added_;
        return;
      }
      const auto layer = static_cast<Index>(layers_.size());  // its place among the evicted layers
      detail::require(model_layers_ == 0 || layer < model_layers_, where.c_str(), "the plan was made for ",
                      model_layers_, " evicted layers");
      policy_.add_scored(layers_, policy_.template score_layer<S>(in, budget_, where, {layer, model_layers_}));
      layers_.back().shape.positions = PositionsView();  // the engine's view may not outlive add(): the map has a copy
      evicted_.push_back(added_++);                      // nothing changes when add() throws
    }
    /// One Selection per added layer.
    std::vector<Selection> apply() const {
      const std::string where = policy_.name_ + "::apply";
      detail::require(added_ > 0, where.c_str(), "no layer was added");
      detail::require(model_layers_ == 0 || static_cast<Index>(layers_.size()) == model_layers_, where.c_str(),
                      "the plan was made for ", model_layers_, " evicted layers, ", layers_.size(), " were added");
      std::vector<Selection> out(static_cast<std::size_t>(added_));
      for (const auto& [l, whole] : whole_) out[static_cast<std::size_t>(l)] = whole;
      if (layers_.empty()) return out;
      for (std::size_t i = 0; i < layers_.size(); ++i) {
        layers_[i].restore_positions();
        layers_[i].where = where + " (layer " + std::to_string(evicted_[i]) + ")";
      }
      std::vector<Selection> kept = policy_.run(layers_, where, no_refinement);
      for (std::size_t i = 0; i < kept.size(); ++i) out[static_cast<std::size_t>(evicted_[i])] = std::move(kept[i]);
      return out;
    }

   private:
    Policy policy_;
    Budget budget_;
    Index model_layers_;
    Index added_ = 0;                                 // layers added, in model order
    std::vector<Index> evicted_;                      // the model index of each scored layer
    std::vector<std::pair<Index, Selection>> whole_;  // the layers kept whole, by model index
    mutable std::vector<Scored<S>> layers_;           // apply() allocates on the maps (a safeguard promotes entries)
  };

  /// A plan for one model: add() every layer in order, then apply(). S is the arithmetic type. `layers`, the
  /// model's evicted layer count (docs/algorithms.md#hybrid-models), is needed by a scheduled allocation (PyramidKV);
  /// apply() then checks that many were added.
  template <class S = float>
  Plan<S> plan(const Budget& budget, Index layers = 0) const {
    return Plan<S>(*this, budget, layers);
  }

  /// All layers at once (any `share`): one Selection per layer. The same as a plan, with the inputs alive until the
  /// selection is made (so the pruned L1 term of CriticalSelector refines its bounds here too). A layer kept whole
  /// (LayerInputs::evict = false) keeps every entry and is no part of the model's budget.
  template <class S = float, class KV, class Q, class W>
  std::vector<Selection> select(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget) const {
    const std::string where = name_ + "::apply";
    detail::require(!layers.empty(), where.c_str(), "no layer was added");
    std::vector<std::size_t> evicted;  // the model index of each scored layer
    std::vector<Selection> out(layers.size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
      if (layers[l].evict)
        evicted.push_back(l);
      else
        out[l] = keep_whole(layers[l], name_ + "::add (layer " + std::to_string(l) + ")");
    }
    if (evicted.empty()) return out;
    const auto count = static_cast<Index>(evicted.size());
    std::vector<Scored<S>> scored;
    for (Index i = 0; i < count; ++i) {
      const std::size_t l = evicted[static_cast<std::size_t>(i)];
      add_scored(scored, score_layer<S>(layers[l], budget, name_ + "::add (layer " + std::to_string(l) + ")",
                                        {i, count}, refines(budget)));
    }
    for (std::size_t i = 0; i < scored.size(); ++i)
      scored[i].where = where + " (layer " + std::to_string(evicted[i]) + ")";
    std::vector<Selection> kept = [&] {
      if constexpr (detail::refines_bounds<SelectorType>::value)
        return run(scored, where, [&](std::size_t i, auto&... args) {
          return selector_.refine(args..., layers[evicted[i]], scored[i].shape);
        });
      else
        return run(scored, where, no_refinement);
    }();
    for (std::size_t i = 0; i < kept.size(); ++i) out[evicted[i]] = std::move(kept[i]);
    return out;
  }

 private:
  /// run()'s refinement step when the layers hold exact scores.
  static constexpr std::nullptr_t no_refinement = nullptr;

  /// Whether the selector ranks by upper bounds it refines (CriticalSelector's pruned L1 term) under this layout
  /// and budget (a threshold compares exact scores).
  bool refines(const Budget& budget) const {
    if constexpr (detail::refines_bounds<SelectorType>::value)
      return params_.per_head_tokens() && !budget.is_threshold();
    else
      return false;
  }

  /// A layer the engine keeps whole (LayerInputs::evict = false, docs/algorithms.md#hybrid-models): every entry, in
  /// whole blocks of the layout's block size and its tail.
  template <class KV, class Q, class W>
  Selection keep_whole(const LayerInputs<KV, Q, W>& in, const std::string& where) const {
    const extend::LayerShape shape = detail::read_entries(in, where.c_str());
    extend::KeepFlags keep(static_cast<std::size_t>(shape.kv_heads * shape.tokens), 0);
    for (Index h = 0; h < shape.kv_heads; ++h)
      std::fill_n(keep.begin() + h * shape.tokens, shape.length(h), std::uint8_t{1});
    return Selection::from_flags(keep, shape, params_.block);
  }

  template <class S, class KV, class Q, class W>
  Selection select_one(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where,
                       extend::LayerPlace place = {}) const {
    if (!in.evict) return keep_whole(in, where);
    if constexpr (!allocates_model())
      detail::require(params_.share != Sharing::per_model, where.c_str(),
                      "share = per_model selects every layer at once: use select(layers, budget) or plan()");
    detail::require(!budget.is_threshold() || budget.bounds_scope() != Budget::Scope::model || place.layers <= 1,
                    where.c_str(),
                    "a threshold budget bounded per model selects every layer at once: use select(layers, budget), "
                    "plan() or select_layers");
    std::vector<Scored<S>> scored;
    add_scored(scored, score_layer<S>(in, budget, where, place, refines(budget)));
    if constexpr (detail::refines_bounds<SelectorType>::value)
      return run(scored, where,
                 [&](std::size_t, auto&... args) { return selector_.refine(args..., in, scored.front().shape); })
          .front();
    else
      return run(scored, where, no_refinement).front();
  }

  // Sharded selection (docs/algorithms.md#sharded), defined in policy/sharded.hpp.
  template <class S, class KV, class Q, class W>
  Selection select_sharded(const LayerInputs<KV, Q, W>& in, const Budget& budget, const shard::LayerShard& shard,
                           const std::string& where) const;
  template <class S, class KV, class Q, class W>
  Selection select_shardable(const LayerInputs<KV, Q, W>& in, const Budget& budget, const shard::LayerShard& shard,
                             const std::string& where) const;
  template <class S, class KV, class Q, class W>
  std::vector<Selection> select_model_shardable(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget,
                                                const shard::ModelShard& shard, const std::string& where) const;
  template <class S, class KV, class Q, class W>
  std::string check_sharded(const LayerInputs<KV, Q, W>& in, const shard::LayerShard& shard,
                            const std::string& where) const;
  static extend::LayerShape whole_layer(const extend::LayerShape& shape, const shard::LayerShard& shard,
                                        const char* at);
  void check_sharded_params(const Budget& budget, const char* at) const;
  template <class S>
  std::vector<Scored<S>> assemble_layers(shard::Communicator& comm, const std::vector<Scored<S>>& mine,
                                         const std::vector<shard::LayerShard>& parts, const std::string& where,
                                         std::vector<Index>& ids) const;
  template <class S>
  std::vector<Selection> select_assembled(shard::Communicator& comm, const std::vector<Scored<S>>& mine,
                                          const std::vector<shard::LayerShard>& parts,
                                          const std::vector<extend::LayerShape>& shapes,
                                          const std::string& where) const;

  /// `budget_shape`: the shape the budget is resolved against when it is not the inputs' own (a sharded layer: every
  /// rank's heads).
  template <class S, class KV, class Q, class W>
  Scored<S> score_layer(const LayerInputs<KV, Q, W>& in, const Budget& budget, const std::string& where,
                        extend::LayerPlace place, bool bounded = false,
                        const extend::LayerShape* budget_shape = nullptr,
                        const shard::LayerShard* shard = nullptr) const {
    const extend::LayerShape shape = detail::validate_inputs(in, params_.window, where.c_str(), reads_observation());
    detail::require_dense_for_quirks(shape, params_.reference_quirks, where.c_str());
    extend::LayerBudget layer =
        extend::layer_budget(budget_shape ? *budget_shape : shape, budget, where.c_str(),
                             allocates_model() || (scheduled() && params_.share != Sharing::per_model), place);
    layer.block = params_.block;
    layer.shard = shard;
    selector_.adjust_budget(layer, shape, params_, where.c_str());
    if constexpr (scheduled()) {  // the layer's share (per_model: one set of n_kept)
      detail::require(!budget.is_threshold(), where.c_str(),
                      "a threshold budget decides its counts from the scores; this allocation schedules a count per "
                      "layer: give a count budget (tokens, keep ratio, compression ratio)");
      if (params_.share != Sharing::per_model)
        allocation_.schedule(layer, budget_shape ? *budget_shape : shape, where.c_str());
    }
    const auto& common = static_cast<const ScoringParams&>(params_);
    (void)bounded;  // only selectors with score_bounded read it
    auto scored = [&] {
      if constexpr (detail::refines_bounds<SelectorType>::value) {
        // Bounds of the unweighted score: the redundancy term (below) needs every score exact.
        if (bounded && params_.redundancy == 0.0)
          return selector_.template score_bounded<S>(in, shape, common, layer, where.c_str());
      }
      return selector_.template score<S>(in, shape, common, layer, where.c_str());
    }();
    detail::require_layout(scored.allocation, shape, where.c_str());
    // docs/algorithms.md#retrieval-heads: every map; under a layout, the groups that hold them, after the forcing cap
    if (!in.retrieval_heads.empty() && params_.per_head_tokens())
      std::apply([&](auto&... maps) { (detail::force_retrieval_heads(maps, in.retrieval_heads), ...); },
                 detail::score_maps<SelectorType>(scored));
    if (params_.redundancy > 0.0) {  // docs/algorithms.md#redundancy: every map, below the protected prefix's tier
      const RowMatrix<S> r = extend::key_redundancy<S>(in, shape);
      std::apply([&](auto&... maps) { (extend::weigh_by_redundancy(maps, r, params_.redundancy), ...); },
                 detail::score_maps<SelectorType>(scored));
    }
    if (layer.protected_prefix > 0)  // docs/algorithms.md#protected-prefix: above every tier of every map
      std::apply([&](auto&... maps) { (detail::protect_prefix(maps, budget.protected_prefix()), ...); },
                 detail::score_maps<SelectorType>(scored));
    if constexpr (allocates_model()) {  // the reference's model total reads the compression ratio
      if (params_.reference_quirks) detail::quirk_compression_ratio(layer, where.c_str());
    }
    return {std::move(scored), shape, layer, where,
            params_.per_head_tokens() ? std::vector<Index>{} : in.retrieval_heads};
  }

  /// Appends a scored layer; under the reference quirks one budget across layers needs every layer alike.
  template <class S>
  void add_scored(std::vector<Scored<S>>& layers, Scored<S>&& s) const {
    if constexpr (allocates_model()) {
      if (params_.reference_quirks && !layers.empty()) {
        const extend::LayerShape& first = layers.front().shape;
        detail::require(first.tokens == s.shape.tokens && first.kv_heads == s.shape.kv_heads, s.where.c_str(),
                        "reference_quirks needs every layer to have the same tokens and KV heads, ", "layer ",
                        layers.size(), " has ", s.shape.tokens, " and ", s.shape.kv_heads);
      }
    }
    layers.push_back(std::move(s));
  }

  /// The run loop: every scored layer through allocation and selection, one Selection per layer. Per head (block
  /// 1) the layers' own maps are allocated; otherwise the layout's unit maps (docs/algorithms.md#layouts).
  /// `refine(l, layer, selected, budgets, keep)` refines layer l's bounds after a selection (nullptr: the scores
  /// are exact).
  /// `top_k`: what a per-layer allocation ranks across heads with (a sharded layer: shard::LayerTopK).
  template <class S, class Refine, class TopK = extend::LocalTopK>
  std::vector<Selection> run(std::vector<Scored<S>>& layers, const std::string& where, Refine&& refine,
                             const TopK& top_k = TopK{}) const {
    if (params_.per_head_tokens()) return run_tokens(layers, where, refine, top_k);
    return run_units(layers, where);
  }

  /// One budget across layers: the model's total, the sum over its layers of kv_heads * n_kept (or the reference's
  /// formula). A sharded model's is resolved over every rank's layers (shard::ModelTopK::total).
  template <class S, class TopK>
  Index model_total(const std::vector<Scored<S>>& layers, const std::string& where, const TopK& top_k) const {
    if constexpr (std::is_same_v<TopK, shard::ModelTopK>) {
      (void)layers;
      (void)where;
      return top_k.total;
    } else {
      (void)top_k;
      Index total = 0, entries = 0;
      for (const auto& l : layers) {
        total += l.shape.kv_heads * static_cast<Index>(l.budget.n_kept);
        entries += l.shape.entries();
      }
      require_model_budget(total, entries, where.c_str());
      if (params_.reference_quirks) {  // int(L (1 - cr) Hkv NL), every layer alike
        const Scored<S>& f = layers.front();
        const double cr = detail::quirk_compression_ratio(f.budget, where.c_str());
        total = static_cast<Index>(static_cast<double>(f.shape.tokens) * (1.0 - cr) *
                                   static_cast<double>(f.shape.kv_heads) * static_cast<double>(layers.size()));
      }
      return total;
    }
  }
  static void require_model_budget(Index total, Index entries, const char* where) {
    detail::require(total <= entries, where, "the model budget (", total,
                    " entries: the sum over layers of kv_heads * n_kept) exceeds what the layers hold (", entries, ")");
  }

  /// Per head, per token: allocate each layer (or all layers at once), select, refine bounds, again until exact.
  template <class S, class Refine, class TopK>
  std::vector<Selection> run_tokens(std::vector<Scored<S>>& layers, const std::string& where, Refine& refine,
                                    const TopK& top_k) const {
    using L = typename SelectorType::template Layer<S>;
    const std::size_t n = layers.size();
    Index total = 0;  // one budget across layers: the model's
    if constexpr (allocates_model()) total = model_total(layers, where, top_k);
    constexpr bool refining = !std::is_same_v<std::decay_t<Refine>, std::nullptr_t>;
    // A rank of a sharded model may score no layer and still take part in the top-k across layers.
    const bool threshold = n > 0 && layers.front().budget.threshold.has_value();
    std::vector<extend::KeepFlags> keep(n);
    std::vector<std::vector<Index>> budgets(n);
    for (;;) {
      std::vector<L> trials;  // refining: the allocation may promote entries of its map, so it runs on copies
      if constexpr (refining) {
        for (const auto& l : layers) trials.push_back(l.layer);
      }
      auto selected = [&](std::size_t l) -> L& {
        if constexpr (refining)
          return trials[l];
        else
          return layers[l].layer;
      };
      if (threshold) {  // the scores decide the counts (docs/algorithms.md#threshold-budgets)
        std::vector<extend::ScoreMap<S>*> maps;
        for (std::size_t l = 0; l < n; ++l) maps.push_back(&selected(l).allocation);
        budgets = detail::threshold_budgets(maps, detail::CountBounds::of(*layers.front().budget.threshold));
      } else if constexpr (allocates_model()) {
        std::vector<const extend::ScoreMap<S>*> maps;
        for (std::size_t l = 0; l < n; ++l) maps.push_back(&selected(l).allocation);
        budgets = allocation_.allocate_model(maps, total, top_k);
      } else {
        for (std::size_t l = 0; l < n; ++l) {
          if constexpr (std::is_same_v<TopK, extend::LocalTopK>)
            budgets[l] = allocation_.allocate(selected(l).allocation, layers[l].budget);
          else
            budgets[l] = allocation_.allocate(selected(l).allocation, layers[l].budget, top_k);
        }
      }
      for (std::size_t l = 0; l < n; ++l) {
        if (layers[l].budget.protected_prefix > 0)
          detail::require_holds_prefix(selected(l).allocation, budgets[l], false, layers[l].where.c_str());
        detail::select_kept(selector_, selected(l), budgets[l], keep[l]);
      }
      bool again = false;
      if constexpr (refining) {
        for (std::size_t l = 0; l < n; ++l) again = refine(l, layers[l].layer, trials[l], budgets[l], keep[l]) || again;
      }
      if (!again) break;
    }
    std::vector<Selection> out;
    for (std::size_t l = 0; l < n; ++l) out.push_back(Selection::from_flags(keep[l], layers[l].shape));
    return out;
  }

  /// The unit maps of one scope (docs/algorithms.md#layouts): its groups reduced to units, each group's forced units
  /// capped at what its share of `tokens` holds next to its window (nullptr: a threshold budget, no share), then the
  /// groups holding a retrieval head forced whole, in every map of the selector.
  template <class S, class L>
  L scope_units(const std::vector<Scored<S>>& layers, const std::vector<std::size_t>& scope,
                const std::vector<const L*>& members, const extend::Grouping& grouping,
                const extend::LayerBudget* tokens) const {
    L units = detail::unit_layer<SelectorType>(members, grouping, params_.reduce);
    std::vector<bool> whole(grouping.groups.size(), false);
    bool any = false;
    for (std::size_t v = 0; v < grouping.groups.size(); ++v)
      for (const auto& [slot, h] : grouping.groups[v].members) {
        const std::vector<Index>& named = layers[scope[slot]].retrieval_heads;
        if (std::find(named.begin(), named.end(), h) != named.end()) whole[v] = any = true;
      }
    // unit_budget refuses B > n_kept; the caller's own check names that budget (no block is kept: no cap)
    const bool capped = tokens && grouping.block <= tokens->n_kept;
    const Index cap = capped ? extend::forcing_cap(extend::unit_budget(*tokens, grouping, "")) : 0;
    std::apply(
        [&](auto&... maps) {
          if (capped) (extend::cap_forcing(maps, cap), ...);
          if (any) (extend::force_groups(maps, whole), ...);
        },
        detail::score_maps<SelectorType>(units));
    return units;
  }

  /// docs/algorithms.md#layouts: groups of KV heads that keep one set, in blocks. A scope is one layer, or every
  /// layer under share = per_model; its unit map is allocated alone, or with every other scope's under one budget
  /// across layers.
  template <class S>
  std::vector<Selection> run_units(std::vector<Scored<S>>& layers, const std::string& where) const {
    using L = typename SelectorType::template Layer<S>;
    const LayoutParams& layout = params_;
    std::vector<std::vector<std::size_t>> scopes;  // the layers of each unit map
    if (layout.share == Sharing::per_model) {
      scopes.emplace_back();
      for (std::size_t l = 0; l < layers.size(); ++l) scopes.back().push_back(l);
    } else {
      for (std::size_t l = 0; l < layers.size(); ++l) scopes.push_back({l});
    }
    std::vector<extend::Grouping> groupings;
    std::vector<L> units;
    std::vector<std::vector<Index>> budgets(scopes.size());
    std::vector<Selection> out(layers.size());
    extend::KeepFlags keep;
    // Scope u, allocated: its prefix checked, its units selected, and the unit flags back to one Selection per layer.
    const auto select_scope = [&](std::size_t u, const std::string& scope_where) {
      if (layers[scopes[u].front()].budget.protected_prefix > 0)
        detail::require_holds_prefix(units[u].allocation, budgets[u], true, scope_where.c_str());
      detail::select_kept(selector_, units[u], budgets[u], keep);
      for (std::size_t i = 0; i < scopes[u].size(); ++i) {
        const Scored<S>& s = layers[scopes[u][i]];
        out[scopes[u][i]] = Selection::from_flags(
            extend::expand(keep, units[u].allocation.tokens, groupings[u], i, s.shape), s.shape, layout.block);
      }
    };
    const std::optional<Budget>& threshold = layers.front().budget.threshold;
    for (std::size_t u = 0; u < scopes.size(); ++u) {
      const std::string& scope_where = layout.share == Sharing::per_model ? where : layers[scopes[u].front()].where;
      std::vector<const extend::ScoreMap<S>*> maps;
      std::vector<const L*> members;
      for (std::size_t l : scopes[u]) {
        maps.push_back(&layers[l].layer.allocation);
        members.push_back(&layers[l].layer);
      }
      groupings.push_back(extend::group_maps(maps, layout.share, layout.block, scope_where.c_str()));
      extend::LayerBudget tokens = layers[scopes[u].front()].budget;
      if (layout.share == Sharing::per_model) tokens.total = tokens.n_kept;  // one group keeps n_kept tokens
      units.push_back(scope_units(layers, scopes[u], members, groupings[u], threshold ? nullptr : &tokens));
      if (!allocates_model() && !threshold) {  // else allocated below, once every scope has its units
        const extend::LayerBudget unit_budget = extend::unit_budget(tokens, groupings[u], scope_where.c_str());
        budgets[u] = allocation_.allocate(units[u].allocation, unit_budget);
        select_scope(u, scope_where);
      }
    }
    if (threshold) {  // the scores decide the counts, in whole blocks (docs/algorithms.md#threshold-budgets)
      std::vector<extend::ScoreMap<S>*> maps;
      for (L& unit : units) maps.push_back(&unit.allocation);
      budgets = detail::threshold_budgets(maps, detail::CountBounds::of(*threshold, layout.block));
      for (std::size_t u = 0; u < scopes.size(); ++u) select_scope(u, where);
      return out;
    }
    if constexpr (allocates_model()) {
      // Tokens the model keeps: n_kept per group (per_model: one group, layer 0's n_kept).
      Index tokens = 0, tails = 0, entries = 0;
      for (std::size_t u = 0; u < scopes.size(); ++u) {
        const extend::LayerBudget& b = layers[scopes[u].front()].budget;
        detail::require(layout.block <= b.n_kept, where.c_str(), "block (", layout.block, ") must be <= n_kept (",
                        b.n_kept, "): a budget smaller than one block keeps no whole block");
        tokens += static_cast<Index>(groupings[u].groups.size()) * static_cast<Index>(b.n_kept);
        tails += groupings[u].tails();
        entries += groupings[u].entries();
      }
      detail::require(tokens <= entries, where.c_str(), "the model budget (", tokens, " tokens: n_kept per ",
                      layout.share == Sharing::per_head ? "KV head" : "group", ") exceeds what the ",
                      to_string(layout.share), " groups hold (", entries, ")");
      std::vector<const extend::ScoreMap<S>*> maps;
      for (const L& u : units) maps.push_back(&u.allocation);
      budgets = allocation_.allocate_model(maps, (tokens - tails) / layout.block);
      for (std::size_t u = 0; u < scopes.size(); ++u) select_scope(u, where);
    }
    return out;
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
    if constexpr (std::is_same_v<Base, LayerGlobalAllocation>)
      return "LayerGlobalPolicy<" + detail::name_of<Selector>() + ">";
    else
      return "Policy<" + detail::name_of<Base>() + ", " + detail::name_of<Selector>() + ">";
  }

  std::string name_;
  Params params_;
  Allocation allocation_;
  SelectorType selector_;
};

/// One budget shared by every layer of the model, scored by the selector (Layer-DefensiveKV's allocation with any
/// selector): plan()/add()/apply() or select(layers, budget).
template <class Selector>
using LayerGlobalPolicy = Policy<LayerGlobalAllocation, Selector>;

}  // namespace kvevict

#include "kvevict/policy/sharded.hpp"  // the sharded entry points
