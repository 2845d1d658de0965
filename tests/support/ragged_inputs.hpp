// Random ragged layers (docs/algorithms.md#ragged) in float64, and their storage in the library's views: any
// layout, capacity and padding. Shared by tests/test_ragged.cpp and tests/test_ragged_reference.cpp.
#ifndef KVEVICT_TESTS_SUPPORT_RAGGED_INPUTS_HPP
#define KVEVICT_TESTS_SUPPORT_RAGGED_INPUTS_HPP

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/reference_ragged.hpp"

namespace kvevict_test {

/// A ragged layer in float64 (the reference's form): KV head h holds L_h entries at positions heads[h].pos
/// (ascending), keys/values [L_h, d] each; queries [H, w, d]; W_o [D, H * d].
using Ragged = kvevict_ref::ragged::Layer;

/// A Selection as the reference's kept rows: [Hkv] row indices per head, ascending.
inline kvevict_ref::ragged::KeptRows rows_of(const kvevict::Selection& s) {
  kvevict_ref::ragged::KeptRows out(static_cast<std::size_t>(s.heads()));
  for (kvevict::Index h = 0; h < s.heads(); ++h)
    out[static_cast<std::size_t>(h)].assign(s.head(h).begin(), s.head(h).end());
  return out;
}
/// One per layer.
inline std::vector<kvevict_ref::ragged::KeptRows> rows_of(const std::vector<kvevict::Selection>& layers) {
  std::vector<kvevict_ref::ragged::KeptRows> out;
  for (const kvevict::Selection& s : layers) out.push_back(rows_of(s));
  return out;
}

inline kvevict::Index length(const Ragged& r, int h) {
  return static_cast<kvevict::Index>(r.heads[static_cast<std::size_t>(h)].pos.size());
}
inline kvevict::Index longest(const Ragged& r) {
  kvevict::Index m = 0;
  for (int h = 0; h < r.Hkv; ++h) m = std::max(m, length(r, h));
  return m;
}

/// Every head holds the last w positions of [0, T) and a random subset of the others (at least one), keys and values
/// drawn per (head, position) from one table, so two heads holding a position hold the same row for it.
inline Ragged random_ragged(Rng& rng, int H, int Hkv, int w, int d, int T, double keep_probability) {
  Ragged r;
  r.H = H;
  r.Hkv = Hkv;
  r.w = w;
  r.d = d;
  r.D = 8;
  const std::vector<double> k_all = kvevict_test::normal_vector(static_cast<std::size_t>(Hkv * T * d), rng);
  const std::vector<double> v_all = kvevict_test::normal_vector(static_cast<std::size_t>(Hkv * T * d), rng);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int h = 0; h < Hkv; ++h) {
    std::vector<std::int64_t> p;
    for (int t = 0; t < T - w; ++t)
      if (u(rng) < keep_probability) p.push_back(t);
    if (p.empty()) p.push_back(static_cast<std::int64_t>(u(rng) * (T - w)));
    for (int t = T - w; t < T; ++t) p.push_back(t);
    std::vector<double> k, v;
    for (std::int64_t t : p)
      for (int c = 0; c < d; ++c) {
        k.push_back(k_all[static_cast<std::size_t>((h * T + t) * d + c)]);
        v.push_back(v_all[static_cast<std::size_t>((h * T + t) * d + c)]);
      }
    r.heads.push_back({k, v, p});
  }
  r.q = kvevict_test::normal_vector(static_cast<std::size_t>(H * w * d), rng, 1.5);
  r.w_o = kvevict_test::normal_vector(static_cast<std::size_t>(r.D * H * d), rng, 0.5);
  return r;
}

/// A ragged layer stored in T: keys/values [Hkv, capacity, d] heads-major or [capacity, Hkv, d] tokens-major, the rows
/// beyond each head's length filled with `junk`; positions likewise (+ `shift`).
template <class T>
struct RaggedStored {
  std::vector<T> k, v, q, w_o, scores;  // scores [Hkv, capacity, 1]: engine_score() of each entry
  std::vector<std::int64_t> lengths, positions;
  kvevict::LayerInputs<T> in;
};

template <class T>
RaggedStored<T> store(const Ragged& r, kvevict::Index capacity, bool tokens_major, T junk, std::int64_t shift = 0,
                      bool with_positions = true) {
  RaggedStored<T> s;
  const auto n = static_cast<std::size_t>(r.Hkv * capacity * r.d);
  s.k.assign(n, junk);
  s.v.assign(n, junk);
  s.positions.assign(static_cast<std::size_t>(r.Hkv * capacity), -7);
  s.scores.assign(static_cast<std::size_t>(r.Hkv * capacity), junk);
  for (int h = 0; h < r.Hkv; ++h) {
    const auto& head = r.heads[static_cast<std::size_t>(h)];
    s.lengths.push_back(length(r, h));
    for (kvevict::Index j = 0; j < length(r, h); ++j) {
      const std::size_t row =
          tokens_major ? static_cast<std::size_t>(j * r.Hkv + h) : static_cast<std::size_t>(h * capacity + j);
      s.positions[row] = head.pos[static_cast<std::size_t>(j)] + shift;
      s.scores[row] = static_cast<T>(engine_score(h, head.pos[static_cast<std::size_t>(j)]));
      for (int c = 0; c < r.d; ++c) {
        s.k[row * static_cast<std::size_t>(r.d) + static_cast<std::size_t>(c)] =
            static_cast<T>(head.keys[static_cast<std::size_t>(j * r.d + c)]);
        s.v[row * static_cast<std::size_t>(r.d) + static_cast<std::size_t>(c)] =
            static_cast<T>(head.values[static_cast<std::size_t>(j * r.d + c)]);
      }
    }
  }
  s.q = kvevict_test::cast_to<T>(r.q);
  s.w_o = kvevict_test::cast_to<T>(r.w_o);
  s.in.queries = kvevict::HeadsView<const T>::heads_major(s.q.data(), r.H, r.w, r.d);
  s.in.keys = tokens_major ? kvevict::kv_tokens_major<const T>(s.k.data(), capacity, r.Hkv, r.d)
                           : kvevict::kv_heads_major<const T>(s.k.data(), r.Hkv, capacity, r.d);
  s.in.values = tokens_major ? kvevict::kv_tokens_major<const T>(s.v.data(), capacity, r.Hkv, r.d)
                             : kvevict::kv_heads_major<const T>(s.v.data(), r.Hkv, capacity, r.d);
  s.in.w_o = kvevict::output_projection<const T>(s.w_o.data(), r.D, r.H, r.d);
  s.in.scores = tokens_major ? kvevict::HeadsView<const T>::rows_major(s.scores.data(), capacity, r.Hkv, 1)
                             : kvevict::HeadsView<const T>::heads_major(s.scores.data(), r.Hkv, capacity, 1);
  s.in.lengths = s.lengths.data();
  if (with_positions)
    s.in.positions = tokens_major ? kvevict::positions_tokens_major(s.positions.data(), capacity, r.Hkv)
                                  : kvevict::positions_heads_major(s.positions.data(), r.Hkv, capacity);
  return s;
}

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_RAGGED_INPUTS_HPP
