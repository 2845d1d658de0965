#pragma once
/// The ranking every allocator and top-k works on: one (tier, score) per (KV head, token) of a layer.

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict::extend {

/// Entries of a higher tier rank before every entry of a lower tier. Inside the window and forced tiers the
/// score is ignored (set to 0), so they rank by recency: this is exactly the reference's "pad the window with the
/// layer maximum" and "scatter the dtype maximum into the safeguard", without magic values.
enum class Tier : std::uint8_t {
  scored = 0,  ///< ranked by score
  window = 1,  ///< the observation window (kept before any scored token)
  forced = 2   ///< forced by a safeguard or a selector's first stage (kept first)
};

/// Scores and tiers [kv_heads, tokens] of one layer, row-major, flat index f = h * tokens + j.
template <class S>
struct ScoreMap {
  Index heads = 0;
  Index tokens = 0;
  std::vector<S> score;
  std::vector<Tier> tier;

  ScoreMap() = default;
  ScoreMap(Index kv_heads, Index n_tokens)
      : heads(kv_heads),
        tokens(n_tokens),
        score(static_cast<std::size_t>(kv_heads * n_tokens), S(0)),
        tier(static_cast<std::size_t>(kv_heads * n_tokens), Tier::scored) {}

  /// Prefix scores [Hkv, P] followed by a window of `window` tokens in the window tier.
  static ScoreMap with_window(const RowMatrix<S>& prefix_scores, Index window) {
    ScoreMap m(prefix_scores.rows(), prefix_scores.cols() + window);
    for (Index h = 0; h < m.heads; ++h) {
      for (Index j = 0; j < prefix_scores.cols(); ++j) m.at(h, j) = prefix_scores(h, j);
      for (Index j = prefix_scores.cols(); j < m.tokens; ++j) m.promote(h, j, Tier::window);
    }
    return m;
  }

  std::size_t flat(Index h, Index j) const { return static_cast<std::size_t>(h * tokens + j); }
  S& at(Index h, Index j) { return score[flat(h, j)]; }
  S at(Index h, Index j) const { return score[flat(h, j)]; }
  Tier tier_of(Index h, Index j) const { return tier[flat(h, j)]; }

  /// Moves entry (h, j) up to tier t (never down); its score no longer matters.
  void promote(Index h, Index j, Tier t) {
    const std::size_t f = flat(h, j);
    if (t > tier[f]) {
      tier[f] = t;
      score[f] = S(0);
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
