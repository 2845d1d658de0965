#pragma once
/// Stage "allocation" (docs/algorithms.md#allocation), StreamingLLM (arXiv 2309.17453) baseline: positional, no scores.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/allocation/uniform.hpp"
#include "kvevict/core/budget.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/layout/units.hpp"
#include "kvevict/ranking/topk.hpp"
#include "kvevict/selectors/selector.hpp"

namespace kvevict {

/// Every KV head keeps its first min(sinks, n_kept) tokens (attention sinks) and its most recent
/// max(0, n_kept - sinks) tokens. Reads only the keys' shape.
class StreamingLLM {
 public:
  static constexpr const char* type_name = "StreamingLLM";
  struct Params : LayoutParams {
    Index sinks = 4;
    void validate(const char* where) const {
      LayoutParams::validate(where);
      detail::require(sinks >= 0, where, "sinks must be >= 0, got ", sinks);
    }
  };

  StreamingLLM() = default;
  explicit StreamingLLM(const Params& params) : params_((params.validate("StreamingLLM::Params"), params)) {}
  const Params& params() const { return params_; }
  const std::string& name() const {
    static const std::string n = type_name;
    return n;
  }
  /// StreamingLLM reads only the keys' shape.
  static constexpr bool reads_observation() { return false; }
  static constexpr bool reads_queries() { return false; }
  bool reads_values() const { return false; }

  /// Selection over a layer of kv_heads x tokens.
  Selection select(Index kv_heads, Index tokens, const Budget& budget,
                   const char* where = "StreamingLLM::select") const {
    detail::require(kv_heads >= 1 && tokens >= 1, where, "needs kv_heads >= 1 and tokens >= 1, got ", kv_heads, " and ",
                    tokens);
    extend::LayerShape shape;
    shape.kv_heads = kv_heads;
    shape.tokens = tokens;
    return select(shape, budget, where);
  }

  /// Same as the scored policies' entry point; reads only the keys' shape, lengths and positions (a ragged layer
  /// keeps b_h = min(n_kept, L_h) per head, sinks first: docs/algorithms.md#ragged).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget) const {
    const char* where = "StreamingLLM::select";
    return select(detail::read_entries(in, where), budget, where);
  }
  /// The same for layer `layer` of a model (named in error messages).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer) const {
    const std::string where = "StreamingLLM::select (layer " + std::to_string(layer) + ")";
    return select(detail::read_entries(in, where.c_str()), budget, where.c_str());
  }
  /// The same for layer `layer` of `layers` (the scored policies' signature; every layer keeps n_kept).
  template <class S = float, class KV, class Q, class W>
  Selection select(const LayerInputs<KV, Q, W>& in, const Budget& budget, Index layer, Index /*layers*/) const {
    return select<S>(in, budget, layer);
  }
  /// Every layer at once (any `share`; per_model needs it): one Selection per layer.
  template <class S = float, class KV, class Q, class W>
  std::vector<Selection> select(const std::vector<LayerInputs<KV, Q, W>>& layers, const Budget& budget) const {
    detail::require(!layers.empty(), "StreamingLLM::select", "no layer was given");
    if (params_.share != Sharing::per_model) {
      std::vector<Selection> out;
      for (std::size_t l = 0; l < layers.size(); ++l) out.push_back(select(layers[l], budget, static_cast<Index>(l)));
      return out;
    }
    const char* where = "StreamingLLM::select";
    std::vector<extend::LayerShape> shapes;
    for (const auto& in : layers) shapes.push_back(detail::read_entries(in, where));
    return select_scope(shapes, n_kept_of(shapes.front(), budget, where), where);
  }

 private:
  static std::int64_t n_kept_of(const extend::LayerShape& shape, const Budget& budget, const char* where) {
    return shape.ragged() ? budget.n_kept(shape.entries(), shape.kv_heads, where) : budget.n_kept(shape.tokens, where);
  }

  /// Rows of head h ranked by recency (score = position), its first min(sinks, min(n_kept, L_h)) rows forced.
  extend::ScoreMap<double> recency_map(const extend::LayerShape& shape, std::int64_t n_kept) const {
    extend::ScoreMap<double> m(shape);
    for (Index h = 0; h < shape.kv_heads; ++h) {
      const Index L = shape.length(h), kept = std::min(static_cast<Index>(n_kept), L);
      for (Index j = 0; j < L; ++j) m.at(h, j) = static_cast<double>(shape.position(h, j));
      for (Index j = 0; j < std::min(params_.sinks, kept); ++j) m.promote(h, j, extend::Tier::forced);
    }
    return m;
  }

  /// docs/algorithms.md#layouts on one scope (one layer, or every layer for per_model): the layers' recency maps in
  /// units, the budget in blocks, the uniform allocation, each group's top blocks, back to one Selection per layer.
  std::vector<Selection> select_scope(const std::vector<extend::LayerShape>& shapes, std::int64_t n_kept,
                                      const char* where) const {
    std::vector<extend::ScoreMap<double>> maps;
    std::vector<const extend::ScoreMap<double>*> scope;
    for (const auto& shape : shapes) maps.push_back(recency_map(shape, n_kept));
    for (const auto& m : maps) scope.push_back(&m);
    const extend::Grouping grouping = extend::group_maps(scope, params_.share, params_.block, where);
    extend::ScoreMap<double> units = extend::to_units(scope, grouping, params_.reduce);
    extend::LayerBudget tokens;
    tokens.n_kept = n_kept;
    extend::KeepFlags keep;
    extend::select_top_per_head(
        units, UniformAllocation().allocate(units, extend::unit_budget(tokens, grouping, where)), keep);
    std::vector<Selection> out;
    for (std::size_t l = 0; l < shapes.size(); ++l)
      out.push_back(
          Selection::from_flags(extend::expand(keep, units.tokens, grouping, l, shapes[l]), shapes[l], params_.block));
    return out;
  }

  Selection select(const extend::LayerShape& shape, const Budget& budget, const char* where) const {
    detail::require(params_.share != Sharing::per_model, where,
                    "share = per_model selects every layer at once: use select(layers, budget)");
    const std::int64_t n_kept = n_kept_of(shape, budget, where);
    if (params_.per_head_tokens()) {  // recency_map's top b_h per head in closed form: O(L), no ranking
      extend::KeepFlags keep(static_cast<std::size_t>(shape.kv_heads * shape.tokens), 0);
      for (Index h = 0; h < shape.kv_heads; ++h) {
        const Index L = shape.length(h), kept = std::min(static_cast<Index>(n_kept), L);
        const Index sinks = std::min(params_.sinks, kept), recent = kept - sinks;
        for (Index j = 0; j < L; ++j)
          keep[static_cast<std::size_t>(h * shape.tokens + j)] = (j < sinks || j >= L - recent) ? 1 : 0;
      }
      return Selection::from_flags(keep, shape);
    }
    return select_scope({shape}, n_kept, where).front();
  }

  Params params_;
};

}  // namespace kvevict
