#pragma once
/// The ranking every allocator and top-k works on: one (tier, score) per (KV head, entry) of a layer.

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict::extend {

/// Entries of a higher tier rank before every entry of a lower tier (docs/algorithms.md#ties), without magic values:
///   safeguard  an allocation's per-head guarantee (AdaKV's top n_safe): the reference's "scatter the dtype maximum",
///              above everything; it always fits (n_safe <= n_kept)
///   window     the observation window, by recency (its score is ignored, set to 0): the reference's "pad the window
///              with the layer maximum"
///   forced     a selector's forcing (mass forcing, sinks), by its own score, then recency: per head it always fits
///              next to the window; in a shared group or blocks, where the members' union may not, the best that the
///              group's share holds stay forced (the forcing cap) and the window is never cut for them
///              (docs/algorithms.md#layouts); also every entry of a named retrieval head
///   protected_prefix  a shared prompt prefix the engine keeps (Budget::protect_prefix,
///   docs/algorithms.md#protected-prefix):
///              never evicted; the pipeline refuses a budget that cannot hold it
/// `absent` marks the padding of a ragged layer (rows beyond a head's L_h, docs/algorithms.md#ragged): never ranked,
/// never kept.
enum class Tier : std::uint8_t {
  absent = 0,           ///< not an entry (the padding beyond a head's L_h)
  scored = 1,           ///< ranked by score
  forced = 2,           ///< forced by a selector (mass forcing, sinks): kept before any scored entry
  window = 3,           ///< the observation window: kept before any forced entry
  safeguard = 4,        ///< an allocation's per-head guarantee (AdaKV's safeguard)
  protected_prefix = 5  ///< an entry of the protected prefix: kept first, always
};

/// Scores and tiers [kv_heads, tokens] of one layer, row-major, flat index f = h * tokens + j (tokens: the longest
/// head's entries). On a ragged layer the entries j >= length(h) are `absent`; `position` holds the entries'
/// original positions when the layer has them (ties across heads compare positions, docs/algorithms.md#ties).
template <class S>
struct ScoreMap {
  Index heads = 0;
  Index tokens = 0;
  std::vector<S> score;
  std::vector<Tier> tier;
  std::vector<Index> lengths;          ///< L_h [heads] on a ragged layer; empty: every head holds `tokens`
  std::vector<std::int64_t> position;  ///< [heads * tokens] original positions; empty: entry j is at position j

  ScoreMap() = default;
  /// A dense map (every head holds n_tokens entries at positions 0 .. n_tokens - 1), all scored 0.
  ScoreMap(Index kv_heads, Index n_tokens)
      : heads(kv_heads),
        tokens(n_tokens),
        score(static_cast<std::size_t>(kv_heads * n_tokens), S(0)),
        tier(static_cast<std::size_t>(kv_heads * n_tokens), Tier::scored) {}
  /// The map of a validated layer: [Hkv, L], every entry scored 0, padding absent, positions from the layer.
  explicit ScoreMap(const LayerShape& shape) : ScoreMap(shape.kv_heads, shape.tokens) {
    lengths = shape.lengths;
    for (Index h = 0; h < heads; ++h)
      for (Index j = length(h); j < tokens; ++j) tier[flat(h, j)] = Tier::absent;
    if (shape.positions.heads() > 0) {
      position.assign(score.size(), 0);
      for (Index h = 0; h < heads; ++h)
        for (Index j = 0; j < length(h); ++j) position[flat(h, j)] = shape.position(h, j);
    }
  }

  /// Prefix scores [Hkv, P] followed by a window of `window` tokens in the window tier (a dense layer).
  static ScoreMap with_window(const RowMatrix<S>& prefix_scores, Index window) {
    ScoreMap m(prefix_scores.rows(), prefix_scores.cols() + window);
    for (Index h = 0; h < m.heads; ++h) {
      for (Index j = 0; j < prefix_scores.cols(); ++j) m.at(h, j) = prefix_scores(h, j);
      for (Index j = prefix_scores.cols(); j < m.tokens; ++j) m.promote(h, j, Tier::window);
    }
    return m;
  }
  /// The same on the layer of `shape`: head h's scores are prefix_scores(h, 0 .. P_h - 1), its window the entries
  /// P_h .. L_h - 1.
  static ScoreMap with_window(const RowMatrix<S>& prefix_scores, const LayerShape& shape) {
    ScoreMap m(shape);
    for (Index h = 0; h < m.heads; ++h) {
      const Index P = shape.prefix_of(h);
      for (Index j = 0; j < P; ++j) m.at(h, j) = prefix_scores(h, j);
      for (Index j = P; j < shape.length(h); ++j) m.promote(h, j, Tier::window);
    }
    return m;
  }

  /// L_h, the entries of head h.
  Index length(Index h) const { return lengths.empty() ? tokens : lengths[static_cast<std::size_t>(h)]; }
  std::size_t flat(Index h, Index j) const { return static_cast<std::size_t>(h * tokens + j); }
  S& at(Index h, Index j) { return score[flat(h, j)]; }
  S at(Index h, Index j) const { return score[flat(h, j)]; }
  Tier tier_of(Index h, Index j) const { return tier[flat(h, j)]; }
  /// The original position of flat entry f.
  std::int64_t position_of(std::size_t f) const {
    return position.empty() ? static_cast<std::int64_t>(f % static_cast<std::size_t>(tokens)) : position[f];
  }

  /// Moves entry (h, j) up to tier t (never down). A window entry's score no longer matters (0); any other keeps its
  /// score (forced entries rank among themselves by it).
  void promote(Index h, Index j, Tier t) {
    const std::size_t f = flat(h, j);
    KVEVICT_ASSERT(tier[f] != Tier::absent);
    if (t > tier[f]) {
      tier[f] = t;
      if (t == Tier::window) score[f] = S(0);
    }
  }

  /// Throws kvevict::invalid_argument naming the first non-finite scored entry (NaN or Inf inputs).
  void require_finite(const char* where) const {
    for (Index h = 0; h < heads; ++h)
      for (Index j = 0; j < tokens; ++j)
        if (tier_of(h, j) == Tier::scored && !std::isfinite(at(h, j)))
          throw invalid_argument(detail::concat("kvevict::", where, ": score of KV head ", h, ", token ", j,
                                                " is not finite (", at(h, j), "): the scores overflowed ",
                                                sizeof(S) == sizeof(float) ? "float" : "double",
                                                " (inputs of huge magnitude; select<double>() computes in double)",
                                                " or the inputs contain NaN or Inf values"));
  }
};

}  // namespace kvevict::extend

namespace kvevict::detail {

/// Throws unless `map` was built for the layer of `shape` (ScoreMap(shape)): its extents, ragged lengths and
/// positions; a selector that builds its map otherwise would rank padding or break ties by rows.
template <class S>
void require_layout(const extend::ScoreMap<S>& map, const extend::LayerShape& shape, const char* where) {
  require(map.heads == shape.kv_heads && map.tokens == shape.tokens && map.lengths == shape.lengths &&
              map.position.empty() == (shape.positions.heads() == 0),
          where, "the selector's ScoreMap must have the layer's layout [", shape.kv_heads, ", ", shape.tokens,
          "] with its lengths and positions: build it with ScoreMap(shape) or ScoreMap::with_window(scores, shape)");
}

/// `shape` with its positions viewing the map's copy of them: a plan keeps the map after add(), not the engine's view.
template <class S>
extend::LayerShape with_map_positions(extend::LayerShape shape, const extend::ScoreMap<S>& map) {
  shape.positions =
      map.position.empty() ? PositionsView() : positions_heads_major(map.position.data(), shape.kv_heads, shape.tokens);
  return shape;
}

}  // namespace kvevict::detail
