#pragma once
/// Policy's sharded entry points (docs/algorithms.md#sharded): a layer whose KV heads are split across tensor-parallel
/// ranks (select(in, budget, LayerShard)), and a model whose layers are also split across pipeline stages
/// (select(layers, budget, ModelShard)). Every check that can fail on one rank alone is agreed on every rank
/// (shard::require_on_every_rank) before the next collective, so no rank is left waiting.

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvevict/policy/policy.hpp"
#include "kvevict/shard/model_shard.hpp"

namespace kvevict {

namespace detail {

/// The message of a sharded check, without the "kvevict::<where>: " prefix require_on_every_rank puts back (a
/// layer's "kvevict::<where> (layer i): " becomes "layer i: ").
inline std::string shard_message(const invalid_argument& e, const std::string& where) {
  const std::string text = e.what(), prefix = "kvevict::" + where;
  if (text.compare(0, prefix.size(), prefix) != 0) return text;
  std::string rest = text.substr(prefix.size());
  if (rest.compare(0, 2, ": ") == 0) return rest.substr(2);
  if (rest.compare(0, 2, " (") == 0) {
    const std::size_t close = rest.find("): ");
    if (close != std::string::npos) return rest.substr(2, close - 2) + rest.substr(close + 1);
  }
  return text;
}

}  // namespace detail

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
Selection Policy<Base, Selector>::select_sharded(const LayerInputs<KV, Q, W>& in, const Budget& budget,
                                                 const shard::LayerShard& shard, const std::string& where) const {
  detail::require(shard.comm != nullptr, where.c_str(), "the shard needs a communicator (LayerShard::comm)");
  // What every rank knows alike: the policy and the budget form. Refused the same way on every rank.
  constexpr bool shardable = detail::shardable_scores<SelectorType>::value && !allocates_model() && !scheduled() &&
                             detail::allocates_with_top_k<Allocation, shard::LayerTopK>::value;
  if constexpr (!shardable) {
    throw invalid_argument(detail::concat(
        "kvevict::", where, ": ", detail::name_of<SelectorType>(), " on ", detail::name_of<Allocation>(),
        " looks across heads or layers beyond one top-k of the layer; a layer's sharded selection takes SnapKV, AdaKV, "
        "CriticalKV, CriticalSnapKV, DefensiveKV, AdaKVDefensive, KNorm, KeyDiff, H2O, StreamingLLM and EngineScores "
        "(select(layers, budget, ModelShard) also takes the layer-global ones)"));
  } else {
    return select_shardable<S>(in, budget, shard, where);
  }
}

template <class Base, class Selector>
void Policy<Base, Selector>::check_sharded_params(const Budget& budget, const char* at) const {
  detail::require(params_.per_head_tokens() && !params_.reference_quirks, at,
                  "sharded selection is per head and token (share per_head, block 1) and without reference_quirks");
  detail::require(!budget.is_threshold(), at,
                  "sharded selection takes a count budget (tokens, keep ratio, compression ratio), not a threshold");
}

/// This rank's inputs of a sharded layer, checked with everything scoring reads before a selector's exchanges
/// (DefensiveSelector's sums across heads): the message of the first failure, empty when they pass.
template <class Base, class Selector>
template <class S, class KV, class Q, class W>
std::string Policy<Base, Selector>::check_sharded(const LayerInputs<KV, Q, W>& in, const shard::LayerShard& shard,
                                                  const std::string& where) const {
  const char* at = where.c_str();
  try {
    const extend::LayerShape shape = detail::validate_inputs(in, params_.window, at, reads_observation());
    detail::require(static_cast<Index>(shard.kv_heads.size()) == shape.kv_heads, at, "the shard names ",
                    shard.kv_heads.size(), " KV heads (kv_heads), the inputs hold ", shape.kv_heads);
    if constexpr (reads_observation()) (void)extend::observe<S>(in, shape, at);
    if constexpr (detail::has_value_norm<Params>::value) {
      if (selector_.reads_values()) extend::validate_value_inputs(in, shape, params_.value_norm, at);
    }
  } catch (const invalid_argument& e) {
    return detail::shard_message(e, where);
  }
  return {};
}

/// The whole layer's shape from this rank's part (`shape`): (global id, L_h, G) gathered for every head over
/// shard.comm; what the budget is resolved against. Throws alike on every rank of shard.comm.
template <class Base, class Selector>
extend::LayerShape Policy<Base, Selector>::whole_layer(const extend::LayerShape& shape, const shard::LayerShard& shard,
                                                       const char* at) {
  std::vector<std::int64_t> mine;
  for (Index h = 0; h < shape.kv_heads; ++h)
    mine.insert(mine.end(), {static_cast<std::int64_t>(shard.kv_heads[static_cast<std::size_t>(h)]),
                             static_cast<std::int64_t>(shape.length(h)), static_cast<std::int64_t>(shape.group)});
  const std::vector<std::vector<std::int64_t>> all = shard::all_gather(*shard.comm, mine);
  std::size_t heads = 0;
  for (const std::vector<std::int64_t>& rank : all) heads += rank.size() / 3;
  std::vector<std::int64_t> lengths(heads, 0);  // [the layer's KV heads] by global id
  std::int64_t group = -1;
  for (const std::vector<std::int64_t>& rank : all)
    for (std::size_t i = 0; i + 2 < rank.size(); i += 3) {
      const std::int64_t id = rank[i];
      detail::require(id >= 0 && id < static_cast<std::int64_t>(heads), at, "KV head id ", id, " must be in [0, ",
                      heads, ") (the ranks hold ", heads, " KV heads of the layer)");
      detail::require(lengths[static_cast<std::size_t>(id)] == 0, at, "KV head ", id, " is held by two ranks");
      detail::require(group < 0 || group == rank[i + 2], at, "every rank's query heads per KV head must agree (", group,
                      " and ", rank[i + 2], ")");
      lengths[static_cast<std::size_t>(id)] = rank[i + 1];
      group = rank[i + 2];
    }
  extend::LayerShape whole = shape;
  whole.kv_heads = static_cast<Index>(lengths.size());
  whole.query_heads = whole.kv_heads * shape.group;
  whole.tokens = *std::max_element(lengths.begin(), lengths.end());
  whole.prefix = whole.tokens - whole.window;
  whole.lengths.clear();
  if (std::any_of(lengths.begin(), lengths.end(), [&](std::int64_t l) { return l != whole.tokens; }))
    whole.lengths.assign(lengths.begin(), lengths.end());
  return whole;
}

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
Selection Policy<Base, Selector>::select_shardable(const LayerInputs<KV, Q, W>& in, const Budget& budget,
                                                   const shard::LayerShard& shard, const std::string& where) const {
  const char* at = where.c_str();
  shard::Communicator& comm = *shard.comm;
  check_sharded_params(budget, at);
  std::string failed = check_sharded<S>(in, shard, where);
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  const extend::LayerShape whole = whole_layer(detail::validate_inputs(in, params_.window, at, false), shard, at);
  std::vector<Scored<S>> scored;
  try {
    scored.push_back(score_layer<S>(in, budget, where, {shard.layer, 0}, false, &whole, &shard));
  } catch (const invalid_argument& e) {
    failed = detail::shard_message(e, where);
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  Selection out;
  try {
    out = run(scored, where, no_refinement, shard::LayerTopK{&shard, whole.kv_heads}).front();
  } catch (const invalid_argument& e) {  // after the top-k's collectives: a check of this rank's heads
    failed = detail::shard_message(e, where);
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  return out;
}

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
std::vector<Selection> Policy<Base, Selector>::select(const std::vector<LayerInputs<KV, Q, W>>& layers,
                                                      const Budget& budget, const shard::ModelShard& shard) const {
  const std::string where = name_ + "::select (sharded model)";
  detail::require(shard.comm != nullptr, where.c_str(), "the shard needs a communicator (ModelShard::comm)");
  constexpr bool shardable = detail::shardable_scores<SelectorType>::value && !scheduled() &&
                             (allocates_model() || detail::allocates_with_top_k<Allocation, shard::LayerTopK>::value);
  if constexpr (!shardable) {
    throw invalid_argument(detail::concat(
        "kvevict::", where, ": ", detail::name_of<SelectorType>(), " on ", detail::name_of<Allocation>(),
        " looks across heads or layers beyond one top-k; sharded selection takes SnapKV, AdaKV, CriticalKV, "
        "CriticalSnapKV, DefensiveKV, AdaKVDefensive, KNorm, KeyDiff, H2O, StreamingLLM, EngineScores and their "
        "layer-global forms (LayerDefensiveKV, OpenDefensiveKV, LayerEngineScores)"));
  } else {
    return select_model_shardable<S>(layers, budget, shard, where);
  }
}

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
std::vector<Selection> Policy<Base, Selector>::select_model_shardable(const std::vector<LayerInputs<KV, Q, W>>& layers,
                                                                      const Budget& budget,
                                                                      const shard::ModelShard& shard,
                                                                      const std::string& where) const {
  const char* at = where.c_str();
  shard::Communicator& comm = *shard.comm;
  shard::SelfCommunicator alone;
  shard::Communicator& group = shard.layer_group ? *shard.layer_group : alone;
  const std::size_t n = layers.size();
  const auto layer_where = [&](std::size_t i) { return where + " (layer " + std::to_string(shard.layers[i]) + ")"; };
  // 1. This rank's layer list, then its group's: the same layers (and which are evicted) on every rank of the group.
  std::string failed;
  try {
    check_sharded_params(budget, at);
    detail::require(shard.layers.size() == n, at, "the shard names ", shard.layers.size(),
                    " layers (ModelShard::layers), the inputs hold ", n);
    for (std::size_t i = 0; i < n; ++i)
      detail::require(shard.layers[i] >= 0 && (i == 0 || shard.layers[i] > shard.layers[i - 1]), at,
                      "ModelShard::layers must be ascending layer ids >= 0, got ", shard.layers[i], " at ", i);
    detail::require(!shard.kv_heads.empty(), at, "the shard holds no KV head (ModelShard::kv_heads is empty)");
  } catch (const invalid_argument& e) {
    failed = detail::shard_message(e, where);
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  std::vector<std::int64_t> listed{comm.rank()};  // this rank's model rank, then (layer id, evicted) per layer
  for (std::size_t i = 0; i < n; ++i) listed.insert(listed.end(), {shard.layers[i], layers[i].evict ? 1 : 0});
  const std::vector<std::vector<std::int64_t>> lists = shard::all_gather(group, listed);
  for (std::size_t r = 0; r < lists.size() && failed.empty(); ++r)
    if (!std::equal(lists[r].begin() + 1, lists[r].end(), listed.begin() + 1, listed.end()))
      failed = detail::concat("rank ", r,
                              " of the layer group (ModelShard::layer_group) holds other layers or "
                              "evicts other ones: every rank of a group must pass the same layers");
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  // 2. Every (layer, KV head) of the model on one group: no layer split over two groups, no gap in the ids.
  {
    std::vector<std::int64_t> held;  // (layer, head, group's first model rank)
    for (std::size_t i = 0; i < n; ++i)
      for (Index h : shard.kv_heads) held.insert(held.end(), {shard.layers[i], h, lists.front().front()});
    std::map<std::int64_t, std::map<std::int64_t, std::int64_t>> model;  // layer -> head -> group
    for (const std::vector<std::int64_t>& rank : shard::all_gather(comm, held))
      for (std::size_t i = 0; i + 2 < rank.size(); i += 3) {
        auto& heads = model[rank[i]];
        detail::require(heads.emplace(rank[i + 1], rank[i + 2]).second, at, "layer ", rank[i], ", KV head ",
                        rank[i + 1], " is held twice: each (layer, KV head) must be on one rank");
        detail::require(heads.begin()->second == rank[i + 2], at, "layer ", rank[i],
                        " is held by two layer groups: a layer's KV heads must be split within one group");
      }
    std::int64_t expected = 0;
    for (const auto& [layer, heads] : model) {
      detail::require(layer == expected, at, "layer ", expected, " is held by no rank (the ranks hold layers up to ",
                      model.rbegin()->first, ")");
      detail::require(heads.rbegin()->first == static_cast<std::int64_t>(heads.size()) - 1, at, "layer ", layer,
                      " has ", heads.size(), " KV heads on the ranks, but ids up to ", heads.rbegin()->first);
      ++expected;
    }
  }
  // 3. Each layer's inputs, with everything scoring reads; a layer kept whole keeps its entries.
  std::vector<Selection> out(n);
  std::vector<std::size_t> evicted;
  std::vector<shard::LayerShard> parts;  // [evicted layers] their shards over the group
  for (std::size_t i = 0; i < n && failed.empty(); ++i) {
    try {
      if (!layers[i].evict) {
        out[i] = keep_whole(layers[i], layer_where(i));
        continue;
      }
      evicted.push_back(i);
      parts.push_back({&group, shard.kv_heads, shard.layers[i]});
      failed = check_sharded<S>(layers[i], parts.back(), layer_where(i));
      if (!failed.empty()) failed = detail::concat("layer ", shard.layers[i], ": ", failed);
    } catch (const invalid_argument& e) {
      failed = detail::shard_message(e, where);
    }
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  if constexpr (!allocates_model()) {
    // Each layer alone over its group; the groups' failures agreed over the model.
    for (std::size_t e = 0; e < evicted.size() && failed.empty(); ++e) {
      const std::size_t i = evicted[e];
      try {
        out[i] = select_shardable<S>(layers[i], budget, parts[e], layer_where(i));
      } catch (const invalid_argument& err) {
        failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    return out;
  } else {
    // 4. Each layer's whole shape over its group, then its scores (the group's exchanges, layer after layer).
    std::vector<extend::LayerShape> wholes;
    for (std::size_t e = 0; e < evicted.size() && failed.empty(); ++e) {
      const std::size_t i = evicted[e];
      try {
        wholes.push_back(whole_layer(detail::validate_inputs(layers[i], params_.window, at, false), parts[e],
                                     layer_where(i).c_str()));
      } catch (const invalid_argument& err) {  // alike on every rank of the group
        failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    std::vector<Scored<S>> scored;
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const std::size_t i = evicted[e];
      try {  // a failure after a layer's exchanges does not skip the next layer's: the group goes on together
        scored.push_back(
            score_layer<S>(layers[i], budget, layer_where(i), {shard.layers[i], 0}, false, &wholes[e], &parts[e]));
      } catch (const invalid_argument& err) {
        if (failed.empty()) failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    // 5. The model's budget: each layer's Hkv n_kept and entries, once per layer (every rank of a group sends them).
    std::vector<std::int64_t> totals;
    for (std::size_t e = 0; e < evicted.size(); ++e)
      totals.insert(totals.end(),
                    {shard.layers[evicted[e]], wholes[e].kv_heads * scored[e].budget.n_kept, wholes[e].entries()});
    std::map<std::int64_t, std::pair<Index, Index>> by_layer;
    for (const std::vector<std::int64_t>& rank : shard::all_gather(comm, totals))
      for (std::size_t i = 0; i + 2 < rank.size(); i += 3) by_layer[rank[i]] = {rank[i + 1], rank[i + 2]};
    Index total = 0, entries = 0;
    for (const auto& [layer, t] : by_layer) {
      total += t.first;
      entries += t.second;
    }
    require_model_budget(total, entries, at);
    // 6. One top-k over every rank's layers, then each layer's selection.
    std::vector<Selection> kept;
    try {
      kept = run(scored, where, no_refinement, shard::ModelTopK{&comm, parts, total});
    } catch (const invalid_argument& err) {  // after the top-k's collectives: a check of this rank's layers
      failed = detail::shard_message(err, where);
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    for (std::size_t e = 0; e < evicted.size(); ++e) out[evicted[e]] = std::move(kept[e]);
    return out;
  }
}

}  // namespace kvevict
