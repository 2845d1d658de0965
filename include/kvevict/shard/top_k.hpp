#pragma once
/// Sharded selection (docs/algorithms.md#sharded): one top-k over score maps spread across ranks. Every rank gets
/// exactly the counts the unsharded top-k (extend::top_k_counts of one layer, extend::allocate_layer_global of
/// many) gives its own heads, whatever the split: the order is total over global ids, and only comparisons are made.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"
#include "kvevict/shard/communicator.hpp"

namespace kvevict::shard {

/// One of this rank's score maps: a layer's map over some of its KV heads, named by their global ids.
template <class S>
struct ShardMap {
  const extend::ScoreMap<S>* map = nullptr;
  Index layer = 0;           ///< the layer's global id (its place in the model)
  std::vector<Index> heads;  ///< [map->heads] the global KV head id of each of the map's heads
};

namespace detail {

/// One candidate as a rank sends it (40 bytes).
template <class S>
struct Candidate {
  S score;
  std::int64_t position;
  std::int64_t layer;
  std::int64_t head;
  std::uint8_t tier;
};

/// docs/algorithms.md#ties with global ids: higher tier, higher score, more recent position, lower layer, lower head.
template <class S>
bool ranks_before(const Candidate<S>& a, const Candidate<S>& b) {
  if (a.tier != b.tier) return a.tier > b.tier;
  if (a.score != b.score) return a.score > b.score;
  if (a.position != b.position) return a.position > b.position;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.head < b.head;
}

}  // namespace detail

/// counts[m][h]: how many entries of map m's local head h are among the top `k` of every rank's maps together, the
/// entries accepted by `eligible(m, flat index)` competing (absent entries never do). One layer's maps split over
/// tensor-parallel ranks give extend::top_k_counts; every layer's maps over all ranks, allocate_layer_global.
/// Exchange: each rank's best min(k, its candidates) entries, one all_gather of counts and one of candidates (plus
/// one of the maps' ids, to refuse a (layer, head) held twice). Every rank throws the same error on bad input.
template <class S, class Eligible>
std::vector<std::vector<Index>> top_k_counts(Communicator& comm, const std::vector<ShardMap<S>>& maps, Index k,
                                             Eligible eligible, const char* where = "shard::top_k_counts") {
  using Key = detail::Candidate<S>;
  // The (layer, head) ids every rank holds: each at most once over all ranks.
  std::string bad;
  std::vector<std::int64_t> ids;
  for (std::size_t m = 0; m < maps.size() && bad.empty(); ++m) {
    const ShardMap<S>& s = maps[m];
    if (s.map == nullptr || static_cast<Index>(s.heads.size()) != s.map->heads)
      bad = kvevict::detail::concat("map ", m, " (layer ", s.layer, ") needs one global head id per head of its map (",
                                    s.map == nullptr ? 0 : s.map->heads, "), got ", s.heads.size());
    for (Index h : s.heads) ids.insert(ids.end(), {static_cast<std::int64_t>(s.layer), static_cast<std::int64_t>(h)});
  }
  if (bad.empty() && k < 0) bad = kvevict::detail::concat("k must be >= 0, got ", k);
  require_on_every_rank(comm, bad.empty(), where, bad);
  {
    const std::vector<std::vector<std::int64_t>> all = all_gather(comm, ids);
    std::set<std::pair<std::int64_t, std::int64_t>> seen;
    for (std::size_t r = 0; r < all.size(); ++r)
      for (std::size_t i = 0; i + 1 < all[r].size(); i += 2)
        kvevict::detail::require(seen.insert({all[r][i], all[r][i + 1]}).second, where, "layer ", all[r][i],
                                 ", KV head ", all[r][i + 1], " is held twice (again by rank ", r,
                                 "): each (layer, KV head) must be on one rank");
  }

  // This rank's candidates, and its best min(k, n) of them.
  std::vector<Key> mine;
  for (std::size_t m = 0; m < maps.size(); ++m) {
    const extend::ScoreMap<S>& map = *maps[m].map;
    for (std::size_t f = 0; f < map.score.size(); ++f) {
      if (map.tier[f] == extend::Tier::absent || !eligible(m, f)) continue;
      Key key;
      std::memset(&key, 0, sizeof key);  // the padding too: the bytes go to other ranks
      key.score = map.score[f];
      key.position = map.position_of(f);
      key.layer = static_cast<std::int64_t>(maps[m].layer);
      key.head = static_cast<std::int64_t>(maps[m].heads[f / static_cast<std::size_t>(map.tokens)]);
      key.tier = static_cast<std::uint8_t>(map.tier[f]);
      mine.push_back(key);
    }
  }
  const auto n = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> ns(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&n, sizeof n, ns.data());
  std::int64_t available = 0;
  for (std::int64_t c : ns) available += c;
  kvevict::detail::require(k <= available, where, "k (", k, ") must be <= the entries that compete on all ranks (",
                           available, ")");
  std::vector<std::vector<Index>> counts(maps.size());
  for (std::size_t m = 0; m < maps.size(); ++m) counts[m].assign(static_cast<std::size_t>(maps[m].map->heads), 0);
  if (k == 0) return counts;

  std::vector<Key> best = mine;
  const auto sent = static_cast<std::size_t>(std::min<std::int64_t>(k, n));
  if (sent < best.size())
    std::nth_element(best.begin(), best.begin() + static_cast<std::ptrdiff_t>(sent - 1), best.end(),
                     detail::ranks_before<S>);
  best.resize(sent);
  // The global top k lies within the ranks' own top k: its k-th entry is the last one kept.
  std::vector<Key> pool;
  for (std::vector<Key>& r : all_gather(comm, best)) pool.insert(pool.end(), r.begin(), r.end());
  const auto last = pool.begin() + static_cast<std::ptrdiff_t>(k - 1);
  std::nth_element(pool.begin(), last, pool.end(), detail::ranks_before<S>);
  const Key kth = *last;
  for (std::size_t m = 0, i = 0; m < maps.size(); ++m) {
    const extend::ScoreMap<S>& map = *maps[m].map;
    for (std::size_t f = 0; f < map.score.size(); ++f) {
      if (map.tier[f] == extend::Tier::absent || !eligible(m, f)) continue;
      if (!detail::ranks_before(kth, mine[i++])) ++counts[m][f / static_cast<std::size_t>(map.tokens)];
    }
  }
  return counts;
}

/// Every entry competes.
template <class S>
std::vector<std::vector<Index>> top_k_counts(Communicator& comm, const std::vector<ShardMap<S>>& maps, Index k) {
  return top_k_counts(comm, maps, k, [](std::size_t, std::size_t) { return true; });
}

}  // namespace kvevict::shard
