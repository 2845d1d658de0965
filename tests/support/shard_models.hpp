#pragma once
// Random score maps for the sharded-selection tests (tests/test_shard_top_k.cpp over threads, tests/mpi/ over MPI):
// a model's layers, and a rank's share of a layer's KV heads.

#include <kvevict/extend.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvevict_test {
namespace shard_models {

using kvevict::Index;
using kvevict::extend::ScoreMap;
using kvevict::extend::Tier;
using ShardRng = std::mt19937_64;

inline std::size_t shard_sz(Index v) { return static_cast<std::size_t>(v); }

// A layer's map with ties: scores from four values or continuous, every tier, ragged lengths and shared or
// per-head positions at random.
inline ScoreMap<double> random_map(ShardRng& rng, Index heads, Index tokens) {
  ScoreMap<double> m(heads, tokens);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const bool ties = u(rng) < 0.5, ragged = u(rng) < 0.4, positioned = u(rng) < 0.5, shared = u(rng) < 0.5;
  if (ragged) {
    for (Index h = 0; h < heads; ++h) m.lengths.push_back(1 + static_cast<Index>(u(rng) * static_cast<double>(tokens)));
    m.lengths[shard_sz(static_cast<Index>(u(rng) * static_cast<double>(heads)))] =
        tokens;  // the longest holds `tokens`
  }
  if (positioned) {
    m.position.assign(shard_sz(heads * tokens), 0);
    std::vector<std::int64_t> common(shard_sz(tokens));
    std::int64_t p = 0;
    for (auto& c : common) c = (p += 1 + static_cast<std::int64_t>(u(rng) * 3));
    for (Index h = 0; h < heads; ++h) {
      std::int64_t q = 0;
      for (Index j = 0; j < tokens; ++j)
        m.position[m.flat(h, j)] = shared ? common[shard_sz(j)] : (q += 1 + static_cast<std::int64_t>(u(rng) * 3));
    }
  }
  for (Index h = 0; h < heads; ++h)
    for (Index j = 0; j < tokens; ++j) {
      const std::size_t f = m.flat(h, j);
      if (j >= m.length(h)) {
        m.tier[f] = Tier::absent;
        continue;
      }
      const double t = u(rng);
      m.tier[f] = t < 0.7 ? Tier::scored : t < 0.8 ? Tier::forced : t < 0.9 ? Tier::window : Tier::safeguard;
      m.score[f] = m.tier[f] == Tier::window ? 0.0 : ties ? 0.25 * std::floor(u(rng) * 4) : u(rng);
    }
  return m;
}

// Rows `heads` (global ids, ascending) of map m.
inline ScoreMap<double> rows_of(const ScoreMap<double>& m, const std::vector<Index>& heads) {
  ScoreMap<double> s(static_cast<Index>(heads.size()), m.tokens);
  for (std::size_t i = 0; i < heads.size(); ++i) {
    const Index h = heads[i];
    if (!m.lengths.empty()) s.lengths.push_back(m.length(h));
    for (Index j = 0; j < m.tokens; ++j) {
      s.score[s.flat(static_cast<Index>(i), j)] = m.score[m.flat(h, j)];
      s.tier[s.flat(static_cast<Index>(i), j)] = m.tier[m.flat(h, j)];
    }
  }
  if (!m.position.empty()) {
    s.position.assign(s.score.size(), 0);
    for (std::size_t i = 0; i < heads.size(); ++i)
      for (Index j = 0; j < m.tokens; ++j)
        s.position[s.flat(static_cast<Index>(i), j)] = m.position[m.flat(heads[i], j)];
  }
  return s;
}

// The KV heads of tensor-parallel part t of `parts`: contiguous (as engines split them) or dealt round-robin.
inline std::vector<Index> part_heads(Index heads, int parts, int t, bool contiguous) {
  std::vector<Index> out;
  for (Index h = 0; h < heads; ++h) {
    const int owner = contiguous ? static_cast<int>(h * parts / heads) : static_cast<int>(h % parts);
    if (owner == t) out.push_back(h);
  }
  return out;
}

}  // namespace shard_models

using shard_models::part_heads;
using shard_models::random_map;
using shard_models::rows_of;
using shard_models::shard_sz;
using shard_models::ShardRng;

}  // namespace kvevict_test
