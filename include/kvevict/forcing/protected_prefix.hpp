#pragma once
/// Stage "forcing", the protected prefix (docs/algorithms.md#protected-prefix): an engine that shares a prompt prefix's
/// pages across requests marks the entries at original positions < p protected. They rank above every other entry of
/// every map (Tier::protected_prefix), and a budget that cannot hold them is refused, so they are never evicted.

#include <cstdint>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/ranking/score_map.hpp"

namespace kvevict::detail {

/// Promotes every entry of `map` [Hkv, L] at an original position < p to Tier::protected_prefix.
template <class S>
void protect_prefix(extend::ScoreMap<S>& map, std::int64_t p) {
  if (p <= 0) return;
  for (Index h = 0; h < map.heads; ++h)
    for (Index j = 0; j < map.length(h); ++j)
      if (map.position_of(map.flat(h, j)) < p) map.promote(h, j, extend::Tier::protected_prefix);
}

/// Throws unless every head v of `map` (a KV head, or a group of a unit map: `units`) gets a budget of at least its
/// protected entries (tokens, or blocks holding one).
template <class S>
void require_holds_prefix(const extend::ScoreMap<S>& map, const std::vector<Index>& budgets, bool units,
                          const char* where) {
  for (Index v = 0; v < map.heads; ++v) {
    Index held = 0;
    for (Index j = 0; j < map.length(v); ++j) held += map.tier_of(v, j) == extend::Tier::protected_prefix;
    const Index b = budgets[static_cast<std::size_t>(v)];
    require(b >= held, where, "the budget keeps ", b, units ? " blocks of group " : " entries of KV head ", v,
            ", fewer than the ", held, units ? " blocks that hold" : " entries of",
            " its protected prefix: a budget "
            "that counts the prefix must hold it; raise the budget or keep the prefix on top of it "
            "(Budget::PrefixBudget::extra)");
  }
}

}  // namespace kvevict::detail
