// What the engine adapters' golden tests share (tests/test_adapter_*.cpp, docs/engines.md): one request's cache
// read out of a simulated engine into the library's views, what compact + rerotate_kept make of it, the float64
// K-shift the simulated engines apply, and hand-made selections.
#ifndef KVEVICT_TESTS_SUPPORT_ENGINE_SIM_HPP
#define KVEVICT_TESTS_SUPPORT_ENGINE_SIM_HPP

#include <kvevict/adapters/shared_set.hpp>
#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace kvevict_test {
namespace engine_sim {

using kvevict::Index;
using Rng = std::mt19937_64;
inline std::size_t sz(Index v) { return static_cast<std::size_t>(v); }

/// The simulated model: layers, query heads, KV heads, window, head dim, hidden size.
constexpr Index kLayers = 3, kH = 4, kHkv = 2, kW = 4, kD = 16, kHidden = 8;

/// Turns one key row [d] by `shift` positions in float64 (pairs as `layout` says, every dimension rotary), stored
/// back as float: the engine's own K-shift, written apart from the library's rerotate.
inline void rotate_row(float* row, std::int64_t shift, kvevict::RopeLayout layout, double theta) {
  for (Index i = 0; i < kD / 2; ++i) {
    const Index x = layout == kvevict::RopeLayout::half ? i : 2 * i;
    const Index y = layout == kvevict::RopeLayout::half ? i + kD / 2 : 2 * i + 1;
    const double a =
        static_cast<double>(shift) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(kD));
    const double xv = row[x], yv = row[y];
    row[x] = static_cast<float>(xv * std::cos(a) - yv * std::sin(a));
    row[y] = static_cast<float>(xv * std::sin(a) + yv * std::cos(a));
  }
}

/// A token's key or value row [d] of layer l, KV head h, in the simulated engine.
using RowOf = std::function<const float*(Index l, Index token, Index h)>;

/// One request's cache as the library reads it: per layer keys and values [Hkv, L, d] heads-major, positions
/// [Hkv, L], with random window queries, W_o and engine scores.
struct SeqView {
  Index L = 0;
  std::vector<std::int64_t> pos;
  std::vector<std::vector<float>> q, k, v, w_o, scores;
  std::vector<kvevict::LayerInputs<float>> layers;

  /// `positions` [L]: the tokens' positions in order; key(l, j, h), value(l, j, h): token j's rows.
  SeqView(const std::vector<std::int64_t>& positions, const RowOf& key, const RowOf& value, Rng& rng)
      : L(static_cast<Index>(positions.size())),
        q(sz(kLayers)),
        k(sz(kLayers)),
        v(sz(kLayers)),
        w_o(sz(kLayers)),
        scores(sz(kLayers)) {
    for (Index h = 0; h < kHkv; ++h) pos.insert(pos.end(), positions.begin(), positions.end());
    std::normal_distribution<float> normal(0.f, 1.f);
    for (Index l = 0; l < kLayers; ++l) {
      auto& kl = k[sz(l)];
      auto& vl = v[sz(l)];
      for (Index h = 0; h < kHkv; ++h)
        for (Index j = 0; j < L; ++j) {
          kl.insert(kl.end(), key(l, j, h), key(l, j, h) + kD);
          vl.insert(vl.end(), value(l, j, h), value(l, j, h) + kD);
        }
      for (Index i = 0; i < kH * kW * kD; ++i) q[sz(l)].push_back(normal(rng));
      for (Index i = 0; i < kHidden * kH * kD; ++i) w_o[sz(l)].push_back(0.2f * normal(rng));
      for (Index i = 0; i < kHkv * L; ++i) scores[sz(l)].push_back(normal(rng));
      kvevict::LayerInputs<float> in;
      in.queries = kvevict::HeadsView<const float>::heads_major(q[sz(l)].data(), kH, kW, kD);
      in.keys = kvevict::kv_heads_major<const float>(kl.data(), kHkv, L, kD);
      in.values = kvevict::kv_heads_major<const float>(vl.data(), kHkv, L, kD);
      in.w_o = kvevict::output_projection<const float>(w_o[sz(l)].data(), kHidden, kH, kD);
      in.scores = kvevict::HeadsView<const float>::heads_major(scores[sz(l)].data(), kHkv, L, 1);
      in.positions = kvevict::positions_heads_major(pos.data(), kHkv, L);
      layers.push_back(in);
    }
  }
};

/// What the request must hold after an adapter's plan: per layer its compacted keys (re-rotated when renumbered
/// from first) and values, token-major [kept by the layer's KV head 0, Hkv, d], and layer 0's kept positions.
struct Expected {
  std::vector<std::vector<float>> k, v;
  std::vector<std::int64_t> pos;
};

inline Expected expected(SeqView& view, const std::vector<kvevict::Selection>& sels, bool renumbered,
                         const kvevict::Rope& rope, std::int64_t first = 0) {
  Expected e;
  for (Index l = 0; l < kLayers; ++l) {
    const kvevict::Selection& s = sels[sz(l)];
    const Index n = s.length(0);
    std::vector<float> k = view.k[sz(l)], v = view.v[sz(l)];
    const auto keys = kvevict::HeadsView<float>::heads_major(k.data(), kHkv, view.L, kD);
    const auto values = kvevict::HeadsView<float>::heads_major(v.data(), kHkv, view.L, kD);
    s.compact(keys, keys);
    s.compact(values, values);
    if (renumbered) kvevict::rerotate_kept(keys, s, rope, first);
    std::vector<float> kc, vc;
    for (Index j = 0; j < n; ++j)
      for (Index h = 0; h < kHkv; ++h) {
        kc.insert(kc.end(), keys.row(h, j), keys.row(h, j) + kD);
        vc.insert(vc.end(), values.row(h, j), values.row(h, j) + kD);
      }
    e.k.push_back(kc);
    e.v.push_back(vc);
  }
  const kvevict::Selection::HeadIndices p = sels[0].head_positions(0);
  for (Index j = 0; j < p.size(); ++j) e.pos.push_back(renumbered ? first + j : p[j]);
  return e;
}

/// "" when the request, which reports `n` tokens, now holds `e` (key(l, j, h), value(l, j, h): layer l's token j's
/// rows): values exactly, keys within float rounding of the rotation; else what differs.
inline std::string holds(Index n, const RowOf& key, const RowOf& value, const Expected& e) {
  if (n != static_cast<Index>(e.pos.size())) return "holds " + std::to_string(n) + " tokens";
  for (Index l = 0; l < kLayers; ++l)
    for (Index j = 0; j < static_cast<Index>(e.k[sz(l)].size() / sz(kHkv * kD)); ++j)
      for (Index h = 0; h < kHkv; ++h)
        for (Index i = 0; i < kD; ++i) {
          const std::size_t at = (sz(j) * sz(kHkv) + sz(h)) * sz(kD) + sz(i);
          if (value(l, j, h)[i] != e.v[sz(l)][at]) return "value of token " + std::to_string(j);
          if (std::abs(key(l, j, h)[i] - e.k[sz(l)][at]) > 2e-5f) return "key of token " + std::to_string(j);
        }
  return "";
}

/// One case of an adapter's golden test: the policy's block size, the RoPE pair layout, the positions mode and a seed.
struct AdapterCase {
  Index block;
  kvevict::Rope rope;
  kvevict::adapters::Positions mode;
  unsigned seed;
};

/// Runs fn(policy, case) for every catalogue policy under `share` with blocks 1 and `block`, both RoPE pair layouts
/// and positions renumbered and kept (INFO names the case); returns how many cases ran.
template <class Fn>
int for_each_adapter_case(Index block, Fn&& fn, kvevict::Sharing share = kvevict::Sharing::per_model) {
  int ran = 0;
  for (kvevict::RopeLayout layout : {kvevict::RopeLayout::half, kvevict::RopeLayout::interleaved})
    for (kvevict::adapters::Positions mode :
         {kvevict::adapters::Positions::renumbered, kvevict::adapters::Positions::kept})
      for (Index b : {Index{1}, block}) {
        kvevict::Knobs knobs;
        knobs.share = share;
        knobs.block = b;
        knobs.window = kW;
        kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
          INFO(entry.name << " mode " << kvevict::adapters::to_string(mode) << " block " << b << " rope "
                          << (layout == kvevict::RopeLayout::half ? "half" : "interleaved"));
          fn(entry.make(knobs),
             AdapterCase{b, kvevict::Rope{10000.0, 0, layout}, mode, 7u + static_cast<unsigned>(ran)});
          ++ran;
        });
      }
  return ran;
}

/// A selection over `tokens` rows keeping `rows` at `positions` (0, 1, ... when empty), on every one of `heads`.
inline kvevict::Selection hand(Index tokens, const std::vector<std::int64_t>& rows,
                               std::vector<std::int64_t> positions = {}, Index heads = 1) {
  std::vector<char> keep(sz(heads * tokens), 0);
  for (Index h = 0; h < heads; ++h)
    for (std::int64_t r : rows) keep[sz(h * tokens) + static_cast<std::size_t>(r)] = 1;
  if (positions.empty())
    for (Index j = 0; j < tokens; ++j) positions.push_back(j);
  std::vector<std::int64_t> all;
  for (Index h = 0; h < heads; ++h) all.insert(all.end(), positions.begin(), positions.end());
  kvevict::extend::LayerShape shape;
  shape.kv_heads = heads;
  shape.tokens = tokens;
  shape.positions = kvevict::positions_heads_major(all.data(), heads, tokens);
  return kvevict::Selection::from_flags(keep, shape);
}

}  // namespace engine_sim
}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_ENGINE_SIM_HPP
