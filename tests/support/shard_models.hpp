#pragma once
// Random score maps for the sharded-selection tests (tests/test_shard_top_k.cpp over threads, tests/mpi/ over MPI):
// a model's layers, and a rank's share of a layer's KV heads.

#include <kvevict/extend.hpp>
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/ragged_inputs.hpp"

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

// Heads [first, first + n) of a view (query-side views: G rows of heads per KV head).
template <class T>
kvevict::HeadsView<const T> heads_of(const kvevict::HeadsView<const T>& v, Index first, Index n) {
  if (v.heads() == 0) return v;
  return kvevict::HeadsView<const T>(v.data() + first * v.head_stride(), n, v.rows(), v.cols(), v.head_stride(),
                                     v.row_stride());
}

// KV heads [h0, h0 + n) of a layer: their keys, values, lengths, positions and scores, their G query heads each and
// those heads' W_o columns (what a tensor-parallel rank holds).
inline kvevict::LayerInputs<float> part_of(const kvevict::LayerInputs<float>& in, Index h0, Index n, Index G) {
  kvevict::LayerInputs<float> p = in;
  p.queries = heads_of(in.queries, h0 * G, n * G);
  p.keys = heads_of(in.keys, h0, n);
  p.values = heads_of(in.values, h0, n);
  p.w_o = heads_of(in.w_o, h0 * G, n * G);
  p.scores = heads_of(in.scores, h0, n);
  p.positions = heads_of(in.positions, h0, n);
  if (in.lengths) p.lengths = in.lengths + h0;
  // The named heads this rank holds, as its own indices (docs/algorithms.md#retrieval-heads).
  p.retrieval_heads.clear();
  for (Index h : in.retrieval_heads)
    if (h >= h0 && h < h0 + n) p.retrieval_heads.push_back(h - h0);
  return p;
}

// A preset with its default parameters and the layers' w window queries (a policy that reads no observation keeps
// its own window, at most w).
template <class P>
P with_window(Index w, typename P::Params p = {}) {
  if (P::reads_observation() || p.window > w) p.window = w;
  return P(p);
}

// A random model: each layer ragged or dense (36 + length_step * l positions), the same Hkv and G; layer `keep_whole`
// (>= 0) is kept whole (LayerInputs::evict = false).
struct Model {
  std::vector<kvevict_test::RaggedStored<float>> stored;
  std::vector<kvevict::LayerInputs<float>> layers;
  Index kv_heads = 0, group = 0;
};
template <class Rng>
Model random_model(Rng& rng, int layers, int Hkv, int G, bool dense, bool tokens_major, int keep_whole,
                   int length_step = 5) {
  Model m;
  m.kv_heads = Hkv;
  m.group = G;
  for (int l = 0; l < layers; ++l) {
    const int T = 36 + length_step * l;
    const kvevict_test::Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, 4, 8, T, dense ? 1.0 : 0.6);
    m.stored.push_back(kvevict_test::store<float>(r, T + 2, tokens_major, 0.0f, 0, true));
  }
  for (auto& s : m.stored) m.layers.push_back(s.in);
  if (keep_whole >= 0) m.layers[shard_sz(keep_whole)].evict = false;
  return m;
}

// Model rank r's part of m split as pp pipeline stages (contiguous layers) of tp tensor-parallel ranks (contiguous
// KV heads): its shard over `model` and `stage`, and its layers' inputs.
struct RankPart {
  kvevict::shard::ModelShard shard;
  std::vector<kvevict::LayerInputs<float>> layers;
};
inline RankPart rank_part(const Model& m, int tp, int pp, kvevict::shard::Communicator& model,
                          kvevict::shard::Communicator& stage) {
  RankPart p;
  const int s = model.rank() / tp;
  const auto L = static_cast<Index>(m.layers.size());
  p.shard = {&model, &stage, {}, part_heads(m.kv_heads, tp, model.rank() % tp, true)};
  for (Index l = L * s / pp; l < L * (s + 1) / pp; ++l) {
    p.shard.layers.push_back(l);
    p.layers.push_back(
        part_of(m.layers[shard_sz(l)], p.shard.kv_heads.front(), static_cast<Index>(p.shard.kv_heads.size()), m.group));
  }
  return p;
}

// Where a rank's selections `got` differ from the one-rank selections `whole` of the model ("layer l, KV head h"),
// and how many heads were compared.
inline std::pair<std::vector<std::string>, int> mismatches(const std::vector<kvevict::Selection>& whole,
                                                           const RankPart& p,
                                                           const std::vector<kvevict::Selection>& got) {
  std::pair<std::vector<std::string>, int> out{{}, 0};
  for (std::size_t i = 0; i < p.shard.layers.size(); ++i)
    for (std::size_t j = 0; j < p.shard.kv_heads.size(); ++j, ++out.second) {
      const auto mine = got[i].head(static_cast<Index>(j));
      const auto one = whole[shard_sz(p.shard.layers[i])].head(p.shard.kv_heads[j]);
      if (!std::equal(mine.begin(), mine.end(), one.begin(), one.end()))
        out.first.push_back("layer " + std::to_string(p.shard.layers[i]) + ", KV head " +
                            std::to_string(p.shard.kv_heads[j]));
    }
  return out;
}

}  // namespace shard_models

using shard_models::heads_of;
using shard_models::mismatches;
using shard_models::Model;
using shard_models::part_heads;
using shard_models::part_of;
using shard_models::random_map;
using shard_models::random_model;
using shard_models::rank_part;
using shard_models::RankPart;
using shard_models::rows_of;
using shard_models::shard_sz;
using shard_models::ShardRng;
using shard_models::with_window;

}  // namespace kvevict_test
