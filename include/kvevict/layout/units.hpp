#pragma once
/// The layout stage (docs/algorithms.md#layouts): groups of KV heads that keep one set, and the *unit* maps the
/// allocations rank when a selection is shared or made of blocks. A unit map has one head per group and one entry
/// per whole block of B rows; each group's tail (its last, partial block) is kept outside the ranking.
///   tokens -> units:  to_units(maps of the group's layers, grouping, reduce)    [V, max U_v]
///   budget:           unit_budget(token budget, grouping)                      n_kept, total in blocks
///   units -> tokens:  expand(unit keep flags, grouping, layer, shape)          [Hkv, L] of one layer

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/layout/params.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

namespace kvevict::extend {

/// KV heads that keep one common set: members (layer slot in the maps given to group_maps, KV head), all holding
/// the same `length` entries at the same positions; `blocks` = U = floor(length / B) whole blocks, `tail` = r rows.
struct Group {
  std::vector<std::pair<std::size_t, Index>> members;
  Index length = 0;
  Index blocks = 0;
  Index tail = 0;
};

/// The groups of one allocation scope (one unit map), with the block size B.
struct Grouping {
  Index block = 1;
  std::vector<Group> groups;

  Index tails() const {
    Index r = 0;
    for (const Group& g : groups) r += g.tail;
    return r;
  }
  Index entries() const {
    Index n = 0;
    for (const Group& g : groups) n += g.length;
    return n;
  }
};

/// Groups the KV heads of `maps` (one layer's map; every layer's for per_model) under `share`, with blocks of B.
/// Throws unless the members of each group hold the same entries (lengths and positions).
template <class S>
Grouping group_maps(const std::vector<const ScoreMap<S>*>& maps, Sharing share, Index block, const char* where) {
  KVEVICT_ASSERT(!maps.empty());
  Grouping g;
  g.block = block;
  auto add = [&](Group& group, std::size_t l, Index h) {
    const ScoreMap<S>& m = *maps[l];
    if (group.members.empty()) {
      group.length = m.length(h);
    } else {
      const auto [l0, h0] = group.members.front();
      const ScoreMap<S>& m0 = *maps[l0];
      const char* scope = share == Sharing::per_layer ? "per_layer sharing needs every KV head of the layer"
                                                      : "per_model sharing needs every KV head of every layer";
      detail::require(m.length(h) == group.length, where, scope, " to hold the same entries: layer ", l, " KV head ", h,
                      " holds ", m.length(h), ", layer ", l0, " KV head ", h0, " holds ", group.length);
      for (Index j = 0; j < group.length; ++j) {
        const std::int64_t p = m.position_of(m.flat(h, j)), p0 = m0.position_of(m0.flat(h0, j));
        detail::require(p == p0, where, scope, " to hold the same positions: entry ", j, " of layer ", l, " KV head ",
                        h, " is at position ", p, ", of layer ", l0, " KV head ", h0, " at ", p0);
      }
    }
    group.members.emplace_back(l, h);
  };
  if (share == Sharing::per_model) g.groups.resize(1);
  for (std::size_t l = 0; l < maps.size(); ++l) {
    if (share == Sharing::per_layer) g.groups.emplace_back();
    for (Index h = 0; h < maps[l]->heads; ++h) {
      if (share == Sharing::per_head) g.groups.emplace_back();
      add(g.groups.back(), l, h);
    }
  }
  for (Group& group : g.groups) {
    group.blocks = group.length / block;
    group.tail = group.length - group.blocks * block;
  }
  return g;
}

/// The unit map of `grouping` over `maps` (the same maps group_maps saw): head v = group v, entry u = its whole
/// block u (rows [uB, uB + B)). Rows are first reduced over the members (tier: the highest; score: max, or the mean
/// summed in member order), then over the block's rows the same way; a block's position is its last row's.
template <class S>
ScoreMap<S> to_units(const std::vector<const ScoreMap<S>*>& maps, const Grouping& grouping, Reduce reduce) {
  const auto V = static_cast<Index>(grouping.groups.size());
  const Index B = grouping.block;
  Index widest = 0;
  bool equal = true;
  for (const Group& g : grouping.groups) {
    widest = std::max(widest, g.blocks);
    equal = equal && g.blocks == grouping.groups.front().blocks;
  }
  ScoreMap<S> u(V, widest);
  if (!equal)
    for (const Group& g : grouping.groups) u.lengths.push_back(g.blocks);
  bool positions = B > 1;
  for (const ScoreMap<S>* m : maps) positions = positions || !m->position.empty();
  if (positions) u.position.assign(u.score.size(), 0);
  for (Index v = 0; v < V; ++v) {
    const Group& g = grouping.groups[static_cast<std::size_t>(v)];
    const auto members = static_cast<Index>(g.members.size());
    for (Index k = 0; k < widest; ++k) {
      const std::size_t f = u.flat(v, k);
      if (k >= g.blocks) {
        u.tier[f] = Tier::absent;
        continue;
      }
      Tier block_tier = Tier::absent;
      S block_score = S(0);
      for (Index j = k * B; j < (k + 1) * B; ++j) {
        Tier row_tier = Tier::absent;
        S row_score = S(0);
        for (Index i = 0; i < members; ++i) {
          const auto [l, h] = g.members[static_cast<std::size_t>(i)];
          const std::size_t src = maps[l]->flat(h, j);
          row_tier = std::max(row_tier, maps[l]->tier[src]);
          const S s = maps[l]->score[src];
          row_score = reduce == Reduce::mean ? row_score + s : (i == 0 ? s : std::max(row_score, s));
        }
        if (reduce == Reduce::mean) row_score /= static_cast<S>(members);
        block_tier = std::max(block_tier, row_tier);
        block_score = reduce == Reduce::mean ? block_score + row_score
                                             : (j == k * B ? row_score : std::max(block_score, row_score));
      }
      if (reduce == Reduce::mean) block_score /= static_cast<S>(B);
      u.tier[f] = block_tier;
      u.score[f] = block_tier == Tier::window ? S(0) : block_score;  // forced blocks rank by their rows' scores
      if (positions) {
        const auto [l, h] = g.members.front();
        u.position[f] = maps[l]->position_of(maps[l]->flat(h, (k + 1) * B - 1));
      }
    }
  }
  return u;
}

/// The budget of one allocation scope in blocks: with V groups keeping T = V * n_kept tokens (n_kept of `tokens`),
/// total = floor((T - sum of tails) / B) whole blocks, n_kept = floor(total / V) per group, window = the most
/// blocks a group's window spans past its tail. Throws unless B <= n_kept.
inline LayerBudget unit_budget(const LayerBudget& tokens, const Grouping& grouping, const char* where) {
  const Index B = grouping.block;
  detail::require(B <= tokens.n_kept, where, "block (", B, ") must be <= n_kept (", tokens.n_kept,
                  "): a budget smaller than one block keeps no whole block");
  const auto V = static_cast<Index>(grouping.groups.size());
  LayerBudget u = tokens;
  u.total = (V * static_cast<Index>(tokens.n_kept) - grouping.tails()) / B;
  u.n_kept = u.total / V;
  u.window = 0;
  for (const Group& g : grouping.groups)
    u.window = std::max(u.window, (std::max<Index>(0, tokens.window - g.tail) + B - 1) / B);
  return u;
}

/// The forcing cap of a group (docs/algorithms.md#forcing-cap) from its scope's budget in blocks (unit_budget): the
/// blocks a group's share holds next to its window, max(0, n_kept - window), as DefensiveKV caps a head's mass forcing
/// at n_kept - w.
inline Index forcing_cap(const LayerBudget& units) {
  return std::max<Index>(0, static_cast<Index>(units.n_kept) - units.window);
}

/// Caps the forced tier of every group of a unit map [V, U] at `cap` units: a group whose forced units outnumber it
/// keeps the `cap` that rank first (score, then recency: docs/algorithms.md#ties) forced and returns the others to
/// the scored tier with their scores.
template <class S>
void cap_forcing(ScoreMap<S>& units, Index cap) {
  std::vector<std::size_t> forced;
  for (Index v = 0; v < units.heads; ++v) {
    forced.clear();
    for (Index k = 0; k < units.length(v); ++k)
      if (units.tier_of(v, k) == Tier::forced) forced.push_back(units.flat(v, k));
    if (static_cast<Index>(forced.size()) <= cap) continue;
    const auto keep = forced.begin() + cap;
    std::nth_element(forced.begin(), keep, forced.end(), detail::RanksBefore<S>{&units});
    for (auto f = keep; f != forced.end(); ++f) units.tier[*f] = Tier::scored;
  }
}

/// Puts every unit of the groups flagged in `whole` [V] (a group holding a retrieval head,
/// docs/algorithms.md#retrieval-heads) in the forced tier; units in a higher tier stay there.
template <class S>
void force_groups(ScoreMap<S>& units, const std::vector<bool>& whole) {
  for (Index v = 0; v < units.heads; ++v)
    if (whole[static_cast<std::size_t>(v)])
      for (Index k = 0; k < units.length(v); ++k) units.promote(v, k, Tier::forced);
}

/// Token keep flags [Hkv, L] of layer slot `layer` (shape `shape`) from the unit keep flags [V, stride] of
/// `grouping`'s unit map (stride: its `tokens`): every member head keeps its group's kept blocks and its tail.
inline KeepFlags expand(const KeepFlags& unit_keep, Index stride, const Grouping& grouping, std::size_t layer,
                        const LayerShape& shape) {
  KeepFlags keep(static_cast<std::size_t>(shape.kv_heads * shape.tokens), 0);
  const Index B = grouping.block;
  for (std::size_t v = 0; v < grouping.groups.size(); ++v) {
    const Group& g = grouping.groups[v];
    for (const auto& [l, h] : g.members) {
      if (l != layer) continue;
      std::uint8_t* row = keep.data() + h * shape.tokens;
      for (Index k = 0; k < g.blocks; ++k)
        if (unit_keep[static_cast<std::size_t>(static_cast<Index>(v) * stride + k)])
          std::fill(row + k * B, row + (k + 1) * B, 1);
      std::fill(row + g.blocks * B, row + g.length, 1);  // the tail
    }
  }
  return keep;
}

}  // namespace kvevict::extend

namespace kvevict::detail {

/// Whether Selector declares `static auto score_maps(Layer& l)` (a tuple of references to every ScoreMap of its
/// Layer<S>); selectors whose Layer holds only `allocation` need not.
template <class Selector, class L, class = void>
struct has_score_maps : std::false_type {};
template <class Selector, class L>
struct has_score_maps<Selector, L, std::void_t<decltype(Selector::score_maps(std::declval<L&>()))>> : std::true_type {};

/// Every ScoreMap of a selector's Layer<S> (const or not), as a tuple of references.
template <class Selector, class L>
auto score_maps(L& layer) {
  if constexpr (has_score_maps<Selector, L>::value)
    return Selector::score_maps(layer);
  else
    return std::tie(layer.allocation);
}

/// The selector state of one allocation scope in units: a copy of the first layer's state with each of its maps
/// replaced by to_units() of that map over every layer of the scope.
template <class Selector, class L>
L unit_layer(const std::vector<const L*>& layers, const extend::Grouping& grouping, Reduce reduce) {
  L out = *layers.front();
  auto out_maps = score_maps<Selector>(out);
  std::apply(
      [&](auto&... maps) {
        std::size_t k = 0;
        auto convert = [&](auto& target) {
          using Map = std::remove_reference_t<decltype(target)>;
          std::vector<const Map*> sources;
          for (const L* l : layers) {
            auto in = score_maps<Selector>(*l);
            std::size_t i = 0;
            std::apply([&](const auto&... m) { ((i++ == k ? sources.push_back(&m) : void()), ...); }, in);
          }
          target = extend::to_units(sources, grouping, reduce);
          ++k;
        };
        (convert(maps), ...);
      },
      out_maps);
  return out;
}

}  // namespace kvevict::detail
