#pragma once
/// Sharded selection (docs/algorithms.md#sharded): the sums a selector takes across a layer's KV heads, over the
/// ranks that hold them, in the one-rank order (so every rank gets the one-rank value bit for bit).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/core/views.hpp"
#include "kvevict/shard/layer_shard.hpp"

namespace kvevict::shard {

/// One term of a sum across heads: its place in the one-rank order (a global query or KV head id) and its value.
struct IndexedTerm {
  std::int64_t index;
  double value;
};

/// The sum of every rank's terms in the order of their indices (unique over the ranks), in double from 0, and how
/// many terms there were: what a one-rank loop over the layer's heads sums.
struct OrderedSum {
  double sum = 0;
  std::size_t terms = 0;
};
inline OrderedSum sum_in_order(Communicator& comm, const std::vector<IndexedTerm>& mine) {
  std::vector<IndexedTerm> all;
  for (const auto& rank : all_gather(comm, mine)) all.insert(all.end(), rank.begin(), rank.end());
  std::sort(all.begin(), all.end(), [](const IndexedTerm& a, const IndexedTerm& b) { return a.index < b.index; });
  OrderedSum out;
  for (const IndexedTerm& term : all) out.sum += term.value;
  out.terms = all.size();
  return out;
}

/// For each of this rank's entries (position, global KV head, value), the sum over every rank's entries at the same
/// position of their values, added in S from 0 in global head order: the per-position sums of a one-rank loop over
/// the layer's heads (docs/algorithms.md#value-term). Returned in the order of `mine`. Sends 24 bytes an entry.
template <class S>
struct PositionTerm {
  std::int64_t position;
  std::int64_t head;
  S value;
};
template <class S>
std::vector<S> sums_by_position(Communicator& comm, const std::vector<PositionTerm<S>>& mine) {
  std::vector<PositionTerm<S>> all;
  for (const auto& rank : all_gather(comm, mine)) all.insert(all.end(), rank.begin(), rank.end());
  const auto before = [](const PositionTerm<S>& a, const PositionTerm<S>& b) {
    return a.position != b.position ? a.position < b.position : a.head < b.head;
  };
  std::sort(all.begin(), all.end(), before);
  std::vector<std::int64_t> positions;  // one per distinct position, ascending
  std::vector<S> totals;
  for (std::size_t first = 0, last = 0; first < all.size(); first = last) {
    S total = 0;
    for (last = first; last < all.size() && all[last].position == all[first].position; ++last) total += all[last].value;
    positions.push_back(all[first].position);
    totals.push_back(total);
  }
  std::vector<S> out;
  out.reserve(mine.size());
  for (const PositionTerm<S>& t : mine)
    out.push_back(totals[static_cast<std::size_t>(std::lower_bound(positions.begin(), positions.end(), t.position) -
                                                  positions.begin())]);
  return out;
}

}  // namespace kvevict::shard
