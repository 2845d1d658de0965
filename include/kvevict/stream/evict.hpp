#pragma once
/// The rule of docs/algorithms.md#streaming, "evict now": after each step, every layer holding more than its budget
/// is evicted to it (a layer-global policy: all layers, when the model holds more than its budget).

#include <algorithm>
#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/shard/model_shard.hpp"
#include "kvevict/stream/cache_book.hpp"

namespace kvevict {

namespace detail {
/// Whether P selects every layer at once: a layer-global policy, a scheduled allocation (PyramidKV: each layer's
/// share of the model budget), or any policy with share = per_model.
template <class P>
bool selects_model(const P& policy) {
  if constexpr (is_layer_global<P>::value)
    return true;
  else if constexpr (is_scheduled<P>::value)
    return true;
  else
    return policy.params().share == Sharing::per_model;
}
}  // namespace detail

/// The most entries per KV head on average a layer holds while the cache grows in steps of `step` tokens under a
/// budget of `n` tokens per KV head (n + p with a protected prefix kept on top), for a policy whose window is
/// `window` (docs/algorithms.md#streaming): n + step * ceil(window / step), n + step when step >= window (n + w when
/// decoding one token at a time). An average over the layer's KV heads (a layer-global policy: the model's); one
/// head of a head-adaptive or layer-global allocation can hold more.
inline Index stream_capacity(Index n, Index step, Index window) {
  detail::require(n >= 1 && step >= 1 && window >= 0, "stream_capacity",
                  "needs n >= 1, step >= 1 and window >= 0, got n ", n, ", step ", step, ", window ", window);
  return n + step * std::max<Index>(1, (window + step - 1) / step);
}

/// Ends the current step of `book` (the tokens appended since the last call) under a budget of `n` tokens per KV
/// head on average: every layer holding more than Hkv * n entries is evicted to Budget::tokens(n) with `policy`
/// (for a layer-global policy or share = per_model: every layer, when the model holds more than the sum of
/// Hkv * n). Returns how many layers were evicted. Not yet: while a layer is over budget but the step holds fewer
/// tokens than the policy's window, nothing is evicted and the step goes on (0 is returned, book.step() keeps
/// counting): an engine may call it after every decoded token, and evicts every w tokens
/// (stream_capacity(n, 1, w) entries per KV head on average at most; one head of a head-adaptive or layer-global
/// allocation can hold more, so size the book's capacity for the fullest head).
///   inputs_of(l) -> LayerInputs of layer l: keys and values viewing the engine's capacity rows, the step's last w
///                   queries (or attention rows over each head's entries), w_o; the book adds lengths and positions.
///   apply(l, selection) compacts the engine's storage, normally book.layer(l).apply(selection, keys, values).
/// Every selection is made before any is applied: on an error (kvevict::invalid_argument, e.g. queries that are not
/// the window's) nothing is evicted. S is the arithmetic type. The engine keeps the queries of the step's tokens
/// until the step holds w of them (the window is the step's last w queries).
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, Index n, Inputs&& inputs_of, Apply&& apply) {
  return evict_over_budget<S>(policy, book, Budget::tokens(n), std::forward<Inputs>(inputs_of),
                              std::forward<Apply>(apply));
}

/// The same under a token budget with a protected prefix (Budget::tokens(n).protect_prefix(p, counting),
/// docs/algorithms.md#protected-prefix): the prefix is never evicted; a layer is over budget when it holds more than
/// Hkv * n entries, or Hkv * (n + p) when the prefix is kept on top (PrefixBudget::extra).
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, const Budget& budget, Inputs&& inputs_of, Apply&& apply) {
  const std::string where = policy.name() + "::evict_over_budget";
  detail::require(budget.kind() == Budget::Kind::tokens, where.c_str(),
                  "a cache that grows is evicted to a token budget (Budget::tokens), got a ratio or a threshold");
  const auto n = static_cast<Index>(budget.value()) + static_cast<Index>(budget.extra());
  const bool model_wide = detail::selects_model(policy);
  std::vector<Index> due;
  for (Index l = 0; l < book.layers(); ++l)  // a layer kept whole is never due (docs/algorithms.md#hybrid-models)
    if (book.evicts(l) && (model_wide ? book.over_budget(n) : book.layer(l).over_budget(n)))
      due.push_back(l);  // model: every evicted layer or none
  if (due.empty()) {
    book.end_step();
    return 0;
  }
  const Index window = policy.params().window;  // 0 for a positional policy (StreamingLLM)
  if (book.step() < window) return 0;           // not yet: the window is the step's last w queries
  std::vector<Selection> selections;
  if (model_wide) {
    auto plan = policy.template plan<S>(budget, book.evicted_layers());  // every evicted layer is due, in order
    for (Index l : due) plan.add(book.layer(l).describe(inputs_of(l)));
    selections = plan.apply();
  } else {
    for (Index l : due)
      selections.push_back(policy.template select<S>(book.layer(l).describe(inputs_of(l)), budget, l));
  }
  for (std::size_t i = 0; i < due.size(); ++i) apply(due[i], selections[i]);
  book.end_step(static_cast<Index>(due.size()));
  return static_cast<Index>(due.size());
}

/// The same on a sharded model (docs/algorithms.md#sharded-streams): `book` holds this rank's layers (book layer i is
/// global layer shard.layers[i]) and its KV heads of each (shard.kv_heads, in order); inputs_of(i) and apply(i, s)
/// take the book's layer index. Every rank calls it after every step alike (the same tokens appended). Whether the
/// model or a layer is over budget is decided from every rank's entries (one all_gather over shard.comm: each held
/// (layer, KV head) and its length), so every rank decides alike; the due layers are then selected with
/// Policy::select(layers, budget, shard), the layers not due passed with LayerInputs::evict = false (kept as they
/// are), so each rank evicts exactly what the one-rank evict_over_budget of the whole model evicts for its heads and
/// layers. Returns how many of this rank's layers were evicted. Bad input on any rank (a book that does not match the
/// shard, ranks at different steps, an exception from inputs_of) throws kvevict::invalid_argument on every rank,
/// before anything is evicted.
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, const Budget& budget, const shard::ModelShard& shard,
                        Inputs&& inputs_of, Apply&& apply) {
  const std::string where = policy.name() + "::evict_over_budget (sharded model)";
  const char* at = where.c_str();
  detail::require(shard.comm != nullptr, at, "the shard needs a communicator (ModelShard::comm)");
  shard::Communicator& comm = *shard.comm;
  std::string failed;
  try {
    detail::require(budget.kind() == Budget::Kind::tokens, at,
                    "a cache that grows is evicted to a token budget (Budget::tokens), got a ratio or a threshold");
    detail::require(static_cast<std::size_t>(book.layers()) == shard.layers.size(), at, "the book holds ",
                    book.layers(), " layers, the shard names ", shard.layers.size(), " (ModelShard::layers)");
    for (Index l = 0; l < book.layers(); ++l)
      detail::require(book.layer(l).kv_heads() == static_cast<Index>(shard.kv_heads.size()), at, "book layer ", l,
                      " holds ", book.layer(l).kv_heads(), " KV heads, the shard names ", shard.kv_heads.size(),
                      " (ModelShard::kv_heads)");
  } catch (const invalid_argument& e) {
    failed = detail::shard_message(e, where);
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  // Every rank's step, then (layer, KV head, entries, evicted) for each pair it holds: 32 bytes a pair.
  std::vector<std::int64_t> mine{book.step()};
  for (Index l = 0; l < book.layers(); ++l)
    for (std::size_t h = 0; h < shard.kv_heads.size(); ++h)
      mine.insert(mine.end(), {shard.layers[static_cast<std::size_t>(l)], shard.kv_heads[h],
                               book.layer(l).length(static_cast<Index>(h)), book.evicts(l) ? 1 : 0});
  struct Layer {
    Index kv_heads = 0, entries = 0;
    bool evicts = true;
  };
  std::map<std::int64_t, Layer> model;  // global layer id -> the whole layer
  std::map<std::pair<std::int64_t, std::int64_t>, int> holder;
  const std::vector<std::vector<std::int64_t>> all = shard::all_gather(comm, mine);
  for (std::size_t r = 0; r < all.size(); ++r) {  // every rank reads the same: its checks throw alike
    detail::require(all[r].front() == all.front().front(), at,
                    "the ranks' books are at different steps (rank 0: ", all.front().front(), ", rank ", r, ": ",
                    all[r].front(), " tokens appended since the last eviction): every rank appends the same tokens");
    for (std::size_t i = 1; i + 3 < all[r].size(); i += 4) {
      const auto [it, first] = holder.emplace(std::make_pair(all[r][i], all[r][i + 1]), static_cast<int>(r));
      detail::require(first, at, "layer ", all[r][i], ", KV head ", all[r][i + 1], " is held by rank ", it->second,
                      " and rank ", r, ": each (layer, KV head) must be on one rank");
      const bool fresh = model.count(all[r][i]) == 0;
      Layer& layer = model[all[r][i]];
      detail::require(fresh || layer.evicts == (all[r][i + 3] != 0), at, "layer ", all[r][i],
                      " is evicted on one rank and kept whole on another (CacheBook's kept_whole must agree)");
      layer.kv_heads += 1;
      layer.entries += static_cast<Index>(all[r][i + 2]);
      layer.evicts = all[r][i + 3] != 0;
    }
  }
  // The one-rank decision on the whole model (evict_over_budget above).
  const auto n = static_cast<Index>(budget.value()) + static_cast<Index>(budget.extra());
  Index held = 0, allowed = 0;
  std::map<std::int64_t, bool> due;  // every evicted layer of the model -> due now
  for (const auto& [id, layer] : model)
    if (layer.evicts) {
      due[id] = layer.entries > layer.kv_heads * n;
      held += layer.entries;
      allowed += layer.kv_heads * n;
    }
  if (detail::selects_model(policy))
    for (auto& d : due) d.second = held > allowed;  // model: every evicted layer or none
  if (std::none_of(due.begin(), due.end(), [](const auto& d) { return d.second; })) {
    book.end_step();
    return 0;
  }
  if (book.step() < policy.params().window) return 0;  // not yet (the step agreed on every rank)
  using In = std::decay_t<decltype(book.layer(0).describe(inputs_of(Index{0})))>;
  std::vector<In> layers;
  try {  // the engine's views; a rank whose inputs_of throws must not leave the others at the selection's collectives
    for (Index l = 0; l < book.layers(); ++l) {
      layers.push_back(book.layer(l).describe(inputs_of(l)));
      layers.back().evict = due[shard.layers[static_cast<std::size_t>(l)]];  // not due: kept as it is
    }
  } catch (const std::exception& e) {
    failed = e.what();
  }
  shard::require_on_every_rank(comm, failed.empty(), at, failed);
  const std::vector<Selection> selections = policy.template select<S>(layers, budget, shard);
  Index evicted = 0;
  for (Index l = 0; l < book.layers(); ++l)
    if (layers[static_cast<std::size_t>(l)].evict) apply(l, selections[static_cast<std::size_t>(l)]), ++evicted;
  book.end_step(evicted);
  return evicted;
}

/// The same under Budget::tokens(n).
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, Index n, const shard::ModelShard& shard, Inputs&& inputs_of,
                        Apply&& apply) {
  return evict_over_budget<S>(policy, book, Budget::tokens(n), shard, std::forward<Inputs>(inputs_of),
                              std::forward<Apply>(apply));
}

}  // namespace kvevict
