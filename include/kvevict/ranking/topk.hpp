#pragma once
/// Stages "forcing" and "ties" (docs/algorithms.md#forcing, docs/algorithms.md#ties): deterministic top-k over a
/// ScoreMap in linear expected time (nth_element, no full sort). Order: tier descending, score descending, then the
/// more recent token (higher original position), then the lower KV head. It is a strict
/// total order, so the kept set never depends on the algorithm, the platform or the thread count.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/ranking/score_map.hpp"

namespace kvevict::extend {

/// Per-entry keep flags [kv_heads, tokens], row-major like ScoreMap.
using KeepFlags = std::vector<std::uint8_t>;

}  // namespace kvevict::extend

namespace kvevict::detail {

/// The order of every top-k up to the position (docs/algorithms.md#ties), between flat entry a of map ma and flat
/// entry b of map mb: -1 when a ranks before b (higher tier, then higher score, then the more recent position), 1
/// when after, 0 when they tie so far (the callers then put the lower layer, then the lower KV head first).
template <class S>
int compare_ranks(const extend::ScoreMap<S>& ma, std::size_t a, const extend::ScoreMap<S>& mb, std::size_t b) {
  const extend::Tier ta = ma.tier[a], tb = mb.tier[b];
  if (ta != tb) return ta > tb ? -1 : 1;
  const S sa = ma.score[a], sb = mb.score[b];
  if (sa != sb) return sa > sb ? -1 : 1;
  const std::int64_t pa = ma.position_of(a), pb = mb.position_of(b);
  if (pa != pb) return pa > pb ? -1 : 1;
  return 0;
}

/// True when flat entry a ranks strictly before flat entry b.
template <class S>
struct RanksBefore {
  const extend::ScoreMap<S>* map;
  bool operator()(std::size_t a, std::size_t b) const {
    const int c = compare_ranks(*map, a, *map, b);
    return c != 0 ? c < 0 : a < b;  // same position: the lower head
  }
};

/// Reorders `candidates` so that its first k entries are the top k (in no particular order among themselves).
template <class S>
void partition_top_k(const extend::ScoreMap<S>& map, std::vector<std::size_t>& candidates, std::size_t k) {
  KVEVICT_ASSERT(k <= candidates.size());
  if (k == 0 || k == candidates.size()) return;
  std::nth_element(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(k - 1), candidates.end(),
                   RanksBefore<S>{&map});
}

}  // namespace kvevict::detail

namespace kvevict::extend {

/// Flags the top `k` entries of head h in `keep` ([kv_heads, tokens]) among those not flagged yet (so a second
/// call adds the next best); other heads' flags are untouched.
template <class S>
void top_k_of_head(const ScoreMap<S>& map, Index h, Index k, KeepFlags& keep) {
  KVEVICT_ASSERT(k >= 0 && keep.size() == map.score.size());
  std::vector<std::size_t> cand;
  cand.reserve(static_cast<std::size_t>(map.length(h)));
  for (Index j = 0; j < map.length(h); ++j)
    if (!keep[map.flat(h, j)]) cand.push_back(map.flat(h, j));
  KVEVICT_ASSERT(static_cast<std::size_t>(k) <= cand.size());
  detail::partition_top_k(map, cand, static_cast<std::size_t>(k));
  for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i) keep[cand[i]] = 1;
}

/// Top `k` entries over the whole layer [kv_heads * tokens]; returns how many each head got [kv_heads].
/// Only entries accepted by `eligible(flat index)` compete (absent entries never do).
template <class S, class Pred>
std::vector<Index> top_k_counts(const ScoreMap<S>& map, Index k, Pred eligible) {
  std::vector<std::size_t> cand;
  cand.reserve(map.score.size());
  for (std::size_t f = 0; f < map.score.size(); ++f)
    if (map.tier[f] != Tier::absent && eligible(f)) cand.push_back(f);
  KVEVICT_ASSERT(k >= 0 && static_cast<std::size_t>(k) <= cand.size());
  detail::partition_top_k(map, cand, static_cast<std::size_t>(k));
  std::vector<Index> counts(static_cast<std::size_t>(map.heads), 0);
  for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i)
    ++counts[cand[i] / static_cast<std::size_t>(map.tokens)];
  return counts;
}

template <class S>
std::vector<Index> top_k_counts(const ScoreMap<S>& map, Index k) {
  return top_k_counts(map, k, [](std::size_t) { return true; });
}

/// Per-(layer, KV head) budgets from one top-k of `total` entries over all layers' maps. Order: the tiers of
/// ScoreMap (safeguard, window, forced, scored), score descending within a tier (0 in the window), then the more
/// recent token (higher original position), the lower layer, the lower KV head (docs/algorithms.md#ties): the
/// per-layer order with the layer between the position and the head. Linear expected time.
template <class S>
std::vector<std::vector<Index>> allocate_layer_global(const std::vector<const ScoreMap<S>*>& layers, Index total) {
  struct Entry {
    std::uint32_t layer;
    std::size_t flat;
  };
  std::vector<Entry> cand;
  std::size_t size = 0;
  for (const ScoreMap<S>* m : layers) size += m->score.size();
  cand.reserve(size);
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (std::size_t f = 0; f < layers[l]->score.size(); ++f)
      if (layers[l]->tier[f] != Tier::absent) cand.push_back({static_cast<std::uint32_t>(l), f});
  KVEVICT_ASSERT(total >= 0 && static_cast<std::size_t>(total) <= cand.size());
  auto ranks_before = [&](const Entry& a, const Entry& b) {
    const int c = detail::compare_ranks(*layers[a.layer], a.flat, *layers[b.layer], b.flat);
    if (c != 0) return c < 0;
    return a.layer != b.layer ? a.layer < b.layer : a.flat < b.flat;  // then the lower layer, the lower KV head
  };
  const auto k = static_cast<std::size_t>(total);
  if (k > 0 && k < cand.size())
    std::nth_element(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k - 1), cand.end(), ranks_before);
  std::vector<std::vector<Index>> budgets(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) budgets[l].assign(static_cast<std::size_t>(layers[l]->heads), 0);
  for (std::size_t i = 0; i < k; ++i)
    ++budgets[cand[i].layer][cand[i].flat / static_cast<std::size_t>(layers[cand[i].layer]->tokens)];
  return budgets;
}

/// The top-k an allocation that ranks across KV heads calls: how many of each head's entries are among the top k of
/// the layer. This one ranks the map alone; shard::LayerTopK ranks a layer whose heads are split across ranks, and
/// shard::ModelTopK layers split across ranks (docs/algorithms.md#sharded). heads(map): the layer's KV heads (the
/// map's, or every rank's).
struct LocalTopK {
  template <class S, class Pred>
  std::vector<Index> operator()(const ScoreMap<S>& map, Index k, Pred eligible) const {
    return top_k_counts(map, k, eligible);
  }
  /// One top-k over several layers' maps (a layer-global allocation): allocate_layer_global.
  template <class S>
  std::vector<std::vector<Index>> across_layers(const std::vector<const ScoreMap<S>*>& layers, Index total) const {
    return allocate_layer_global(layers, total);
  }
  template <class S>
  Index heads(const ScoreMap<S>& map) const {
    return map.heads;
  }
};

}  // namespace kvevict::extend
