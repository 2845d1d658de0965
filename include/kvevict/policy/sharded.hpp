#pragma once
/// Policy's sharded entry points (docs/algorithms.md#sharded): a layer whose KV heads are split across tensor-parallel
/// ranks (select(in, budget, LayerShard)), and a model whose layers are also split across pipeline stages
/// (select(layers, budget, ModelShard)). Every check that can fail on one rank alone is agreed on every rank
/// (shard::require_on_every_rank) before the next collective, so no rank is left waiting.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kvevict/policy/policy.hpp"
#include "kvevict/shard/model_shard.hpp"

namespace kvevict {

namespace detail {

/// The refusal of a policy whose selector or allocation reads across heads or layers what sharded selection does not
/// exchange: "<takes> SnapKV, ..., StreamingLLM<tail>" names what the entry point takes.
template <class Selector, class Allocation>
invalid_argument unshardable(const std::string& where, const char* takes, const char* tail) {
  return invalid_argument(concat("kvevict::", where, ": ", name_of<Selector>(), " on ", name_of<Allocation>(),
                                 " reads across heads or layers what sharded selection does not exchange; ", takes,
                                 " SnapKV, AdaKV, PyramidKV, CriticalKV, CriticalSnapKV, DefensiveKV, AdaKVDefensive, "
                                 "TOVA, KNorm, KeyDiff, ExpectedAttention, H2O, StreamingLLM",
                                 tail, "; a selector of your own declares static constexpr bool shardable_scores()"));
}

}  // namespace detail

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
Selection Policy<Base, Selector>::select_sharded(const LayerInputs<KV, Q, W>& in, const Budget& budget,
                                                 const shard::LayerShard& shard, const std::string& where) const {
  detail::require(shard.comm != nullptr, where.c_str(), "the shard needs a communicator (LayerShard::comm)");
  // What every rank knows alike: the policy and the budget form. Refused the same way on every rank.
  constexpr bool shardable = detail::shardable_scores<SelectorType>::value && !allocates_model() &&
                             detail::allocates_with_top_k<Allocation, shard::LayerTopK>::value;
  if constexpr (!shardable) {
    throw detail::unshardable<SelectorType, Allocation>(
        where, "a layer's sharded selection takes",
        " and EngineScores (select(layers, budget, ModelShard) also takes "
        "the layer-global ones)");
  } else {
    return select_shardable<S>(in, budget, shard, where);
  }
}

template <class Base, class Selector>
void Policy<Base, Selector>::check_sharded_params(const Budget& budget, const char* at) const {
  detail::require(!params_.reference_quirks, at, "sharded selection runs without reference_quirks");
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

namespace detail {

/// A flat byte buffer of trivially copyable items, written and read in order (assemble_layers' messages).
struct Bytes {
  std::vector<unsigned char> data;
  std::size_t read = 0;
  template <class T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(&v);
    data.insert(data.end(), p, p + sizeof(T));
  }
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, data.data() + read, sizeof(T));
    read += sizeof(T);
    return v;
  }
};

}  // namespace detail

/// Every layer the ranks of `comm` hold, whole: each rank sends its scored layers' maps (every entry's score, tier
/// and position, with the layer's budget and its heads' global ids and lengths), and every rank puts them together in
/// global head order, ascending layer ids (`ids`). What a layout's group reductions and unit budgets read
/// (docs/algorithms.md#sharded): the one-rank run_units then runs on the same maps on every rank. O(entries) bytes.
template <class Base, class Selector>
template <class S>
std::vector<typename Policy<Base, Selector>::template Scored<S>> Policy<Base, Selector>::assemble_layers(
    shard::Communicator& comm, const std::vector<Scored<S>>& mine, const std::vector<shard::LayerShard>& parts,
    const std::string& where, std::vector<Index>& ids) const {
  using L = typename SelectorType::template Layer<S>;
  detail::Bytes out;
  out.put(static_cast<std::uint64_t>(mine.size()));
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const Scored<S>& s = mine[i];
    const extend::LayerBudget& b = s.budget;
    for (const std::int64_t v :
         {std::int64_t{parts[i].layer}, std::int64_t{s.shape.kv_heads}, std::int64_t{s.shape.group},
          std::int64_t{s.shape.window}, std::int64_t{s.shape.head_dim}, b.n_kept, std::int64_t{b.total},
          std::int64_t{b.window}, std::int64_t{b.layer}, std::int64_t{b.layers}, std::int64_t{b.block},
          std::int64_t{b.protected_prefix}, std::int64_t{b.shared_across_layers ? 1 : 0}})
      out.put(v);
    out.put(b.compression_ratio);
    for (Index h = 0; h < s.shape.kv_heads; ++h) {
      out.put(static_cast<std::int64_t>(parts[i].kv_heads[static_cast<std::size_t>(h)]));
      out.put(static_cast<std::int64_t>(s.shape.length(h)));
      const bool named = std::find(s.retrieval_heads.begin(), s.retrieval_heads.end(), h) != s.retrieval_heads.end();
      out.put(static_cast<std::uint8_t>(named ? 1 : 0));
    }
    std::apply(
        [&](const auto&... maps) {
          const auto send = [&](const extend::ScoreMap<S>& m) {
            out.put(static_cast<std::uint8_t>(m.position.empty() ? 0 : 1));
            for (Index h = 0; h < m.heads; ++h)
              for (Index j = 0; j < m.length(h); ++j) {
                const std::size_t f = m.flat(h, j);
                out.put(m.score[f]);
                out.put(static_cast<std::uint8_t>(m.tier[f]));
                out.put(m.position_of(f));
              }
          };
          (send(maps), ...);
        },
        detail::score_maps<SelectorType>(s.layer));
  }
  // Per layer id: its header (from the first rank that holds it), and each head's length and rows.
  struct Head {
    Index length = 0;
    /// Named in LayerInputs::retrieval_heads (docs/algorithms.md#retrieval-heads).
    bool retrieval = false;
    std::vector<std::vector<std::tuple<S, std::uint8_t, std::int64_t>>> rows;  // [maps][entries]
  };
  struct Whole {
    std::vector<std::int64_t> header;
    double compression_ratio = 0;
    std::map<Index, Head> heads;
    std::vector<bool> positioned;
  };
  std::map<Index, Whole> layers;
  for (std::vector<unsigned char>& bytes : shard::all_gather(comm, out.data)) {
    detail::Bytes in{std::move(bytes), 0};
    const auto count = in.get<std::uint64_t>();
    for (std::uint64_t i = 0; i < count; ++i) {
      std::vector<std::int64_t> header(13);
      for (std::int64_t& v : header) v = in.get<std::int64_t>();
      Whole& w = layers[static_cast<Index>(header[0])];
      w.header = header;
      w.compression_ratio = in.get<double>();
      std::vector<Index> held;  // this rank's heads of the layer
      for (std::int64_t h = 0; h < header[1]; ++h) {
        held.push_back(static_cast<Index>(in.get<std::int64_t>()));
        detail::require(w.heads.count(held.back()) == 0, where.c_str(), "layer ", header[0], ", KV head ", held.back(),
                        " is held twice");
        w.heads[held.back()].length = static_cast<Index>(in.get<std::int64_t>());
        w.heads[held.back()].retrieval = in.get<std::uint8_t>() != 0;
      }
      constexpr std::size_t n_maps = std::tuple_size_v<decltype(detail::score_maps<SelectorType>(
          std::declval<typename SelectorType::template Layer<S>&>()))>;
      w.positioned.resize(n_maps, false);
      for (std::size_t k = 0; k < n_maps; ++k) {
        if (in.get<std::uint8_t>() != 0) w.positioned[k] = true;
        for (Index id : held) {
          Head& head = w.heads[id];
          head.rows.resize(n_maps);
          for (Index j = 0; j < head.length; ++j) {
            const S score = in.get<S>();
            const auto tier = in.get<std::uint8_t>();
            head.rows[k].emplace_back(score, tier, in.get<std::int64_t>());
          }
        }
      }
    }
  }
  std::vector<Scored<S>> whole;
  ids.clear();
  for (auto& held : layers) {
    const Index id = held.first;
    Whole& w = held.second;  // (a named reference: C++17 lambdas cannot capture structured bindings)
    ids.push_back(id);
    const auto kv_heads = static_cast<Index>(w.heads.size());
    detail::require(w.heads.rbegin()->first == kv_heads - 1, where.c_str(), "layer ", id, " has ", kv_heads,
                    " KV heads on the ranks, but ids up to ", w.heads.rbegin()->first);
    extend::LayerShape shape;
    shape.kv_heads = kv_heads;
    shape.group = static_cast<Index>(w.header[2]);
    shape.query_heads = kv_heads * shape.group;
    shape.window = static_cast<Index>(w.header[3]);
    shape.head_dim = static_cast<Index>(w.header[4]);
    for (const auto& [h, head] : w.heads) shape.tokens = std::max(shape.tokens, head.length);
    shape.prefix = shape.tokens - shape.window;
    for (const auto& [h, head] : w.heads)
      if (head.length != shape.tokens) shape.lengths.assign(static_cast<std::size_t>(kv_heads), 0);
    if (shape.ragged())
      for (const auto& [h, head] : w.heads) shape.lengths[static_cast<std::size_t>(h)] = head.length;
    L layer{};
    std::size_t k = 0;
    std::apply(
        [&](auto&... maps) {
          const auto fill = [&](extend::ScoreMap<S>& m) {
            m = extend::ScoreMap<S>(kv_heads, shape.tokens);
            m.lengths = shape.lengths;
            if (w.positioned[k]) m.position.assign(m.score.size(), 0);
            for (const auto& [h, head] : w.heads)
              for (Index j = 0; j < shape.tokens; ++j) {
                const std::size_t f = m.flat(h, j);
                if (j >= head.length) {
                  m.tier[f] = extend::Tier::absent;
                  continue;
                }
                const auto& [score, tier, position] = head.rows[k][static_cast<std::size_t>(j)];
                m.score[f] = score;
                m.tier[f] = static_cast<extend::Tier>(tier);
                if (w.positioned[k]) m.position[f] = position;
              }
            ++k;
          };
          (fill(maps), ...);
        },
        detail::score_maps<SelectorType>(layer));
    extend::LayerBudget b;
    b.n_kept = w.header[5];
    b.total = static_cast<Index>(w.header[6]);
    b.window = static_cast<Index>(w.header[7]);
    b.layer = static_cast<Index>(w.header[8]);
    b.layers = static_cast<Index>(w.header[9]);
    b.block = static_cast<Index>(w.header[10]);
    b.protected_prefix = static_cast<Index>(w.header[11]);
    b.shared_across_layers = w.header[12] != 0;
    b.compression_ratio = w.compression_ratio;
    Scored<S> s{std::move(layer), shape, b, where + " (layer " + std::to_string(id) + ")"};
    for (const auto& [h, head] : w.heads)
      if (head.retrieval) s.retrieval_heads.push_back(h);
    s.restore_positions();
    whole.push_back(std::move(s));
  }
  return whole;
}

/// A layout's selection of sharded layers (share per_layer or per_model, blocks): the layers assembled whole over
/// `comm` (assemble_layers), the one-rank run_units on every rank, and each of this rank's layers cut to its heads.
/// `shapes[i]`: this rank's part of layer parts[i] (mine[i]).
template <class Base, class Selector>
template <class S>
std::vector<Selection> Policy<Base, Selector>::select_assembled(shard::Communicator& comm,
                                                                const std::vector<Scored<S>>& mine,
                                                                const std::vector<shard::LayerShard>& parts,
                                                                const std::vector<extend::LayerShape>& shapes,
                                                                const std::string& where) const {
  std::vector<Index> ids;  // the assembled layers' ids, ascending
  std::vector<Scored<S>> whole = assemble_layers(comm, mine, parts, where, ids);
  const std::vector<Selection> all = run_units(whole, where);
  std::vector<Selection> out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto w = static_cast<std::size_t>(std::lower_bound(ids.begin(), ids.end(), parts[i].layer) - ids.begin());
    const extend::LayerShape& shape = shapes[i];
    extend::KeepFlags keep(static_cast<std::size_t>(shape.kv_heads * shape.tokens), 0);
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (const auto j : all[w].head(parts[i].kv_heads[static_cast<std::size_t>(h)]))
        keep[static_cast<std::size_t>(h * shape.tokens + static_cast<Index>(j))] = 1;
    out.push_back(Selection::from_flags(keep, shape, params_.block));
  }
  return out;
}

template <class Base, class Selector>
template <class S, class KV, class Q, class W>
Selection Policy<Base, Selector>::select_shardable(const LayerInputs<KV, Q, W>& in, const Budget& budget,
                                                   const shard::LayerShard& shard, const std::string& where) const {
  const char* at = where.c_str();
  shard::Communicator& comm = *shard.comm;
  check_sharded_params(budget, at);
  detail::require(params_.share != Sharing::per_model, at,
                  "share = per_model selects every layer at once: use select(layers, budget, ModelShard)");
  std::string failed = check_sharded<S>(in, shard, where);
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  const extend::LayerShape mine = detail::validate_inputs(in, params_.window, at, false);
  const extend::LayerShape whole = whole_layer(mine, shard, at);
  std::vector<Scored<S>> scored;
  try {
    scored.push_back(score_layer<S>(in, budget, where, {shard.layer, shard.layers}, false, &whole, &shard));
  } catch (const invalid_argument& e) {
    failed = detail::shard_message(e, where);
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  Selection out;
  try {
    if (params_.per_head_tokens())
      out = run(scored, where, no_refinement, shard::LayerTopK{&shard, whole.kv_heads}).front();
    else  // a layout (share per_layer, blocks): the layer assembled whole on every rank
      out = select_assembled(comm, scored, {shard}, {mine}, where).front();
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
  constexpr bool shardable = detail::shardable_scores<SelectorType>::value &&
                             (allocates_model() || detail::allocates_with_top_k<Allocation, shard::LayerTopK>::value);
  if constexpr (!shardable) {
    throw detail::unshardable<SelectorType, Allocation>(
        where, "sharded selection takes",
        ", EngineScores and their layer-global forms (LayerDefensiveKV, "
        "OpenDefensiveKV, LayerEngineScores)");
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
  // 2. Every (layer, KV head) of the model on one group: no layer split over two groups, no gap in the ids. Each
  // evicted layer's place among the model's evicted layers (a scheduled allocation's, PyramidKV).
  std::map<Index, Index> place;  // this rank's evicted layers: id -> place
  Index evicted_layers = 0;
  {
    std::vector<std::int64_t> held;  // (layer, head, group's first model rank, evicted)
    for (std::size_t i = 0; i < n; ++i)
      for (Index h : shard.kv_heads)
        held.insert(held.end(), {shard.layers[i], h, lists.front().front(), layers[i].evict ? 1 : 0});
    std::map<std::int64_t, std::map<std::int64_t, std::int64_t>> model;  // layer -> head -> group
    std::map<std::int64_t, bool> evicts;                                 // layer -> evicted
    for (const std::vector<std::int64_t>& rank : shard::all_gather(comm, held))
      for (std::size_t i = 0; i + 3 < rank.size(); i += 4) {
        evicts[rank[i]] = rank[i + 3] != 0;
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
      if (evicts[layer]) place[static_cast<Index>(layer)] = evicted_layers++;
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
      parts.push_back({&group, shard.kv_heads, shard.layers[i], evicted_layers});
      failed = check_sharded<S>(layers[i], parts.back(), layer_where(i));
      if (!failed.empty()) failed = detail::concat("layer ", shard.layers[i], ": ", failed);
    } catch (const invalid_argument& e) {
      failed = detail::shard_message(e, where);
    }
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  if (!allocates_model() && params_.share != Sharing::per_model) {
    // Each layer alone over its group; the groups' failures agreed over the model.
    for (std::size_t e = 0; e < evicted.size() && failed.empty(); ++e) {
      const std::size_t i = evicted[e];
      try {
        shard::LayerShard placed = parts[e];  // a scheduled allocation reads the layer's place
        placed.layer = place[shard.layers[i]];
        out[i] = select_sharded<S>(layers[i], budget, placed, layer_where(i));
      } catch (const invalid_argument& err) {
        failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    return out;
  } else {
    // 4. Each layer's whole shape over its group, then its scores (the group's exchanges, layer after layer).
    std::vector<extend::LayerShape> wholes, shapes;  // each layer's whole shape, and this rank's part of it
    for (std::size_t e = 0; e < evicted.size() && failed.empty(); ++e) {
      const std::size_t i = evicted[e];
      try {
        shapes.push_back(detail::validate_inputs(layers[i], params_.window, at, false));
        wholes.push_back(whole_layer(shapes.back(), parts[e], layer_where(i).c_str()));
      } catch (const invalid_argument& err) {  // alike on every rank of the group
        failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    std::vector<Scored<S>> scored;
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const std::size_t i = evicted[e];
      try {  // a failure after a layer's exchanges does not skip the next layer's: the group goes on together
        scored.push_back(score_layer<S>(layers[i], budget, layer_where(i), {place[shard.layers[i]], evicted_layers},
                                        false, &wholes[e], &parts[e]));
      } catch (const invalid_argument& err) {
        if (failed.empty()) failed = detail::shard_message(err, where);
      }
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    if constexpr (allocates_model()) {
      if (params_.per_head_tokens()) {
        // 5. The model's budget: each layer's Hkv n_kept and entries, once per layer (every rank of a group sends
        // them).
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
    // 5'. A layout (shared sets, blocks) over the model: every layer assembled whole on every rank (share = per_model
    // on a per-layer allocation always takes this path).
    std::vector<Selection> kept;
    try {
      kept = select_assembled(comm, scored, parts, shapes, where);
    } catch (const invalid_argument& err) {
      failed = detail::shard_message(err, where);
    }
    shard::require_on_every_rank(comm, failed.empty(), at, failed);
    for (std::size_t e = 0; e < evicted.size(); ++e) out[evicted[e]] = std::move(kept[e]);
    return out;
  }
}

}  // namespace kvevict
