// forcing/mass_forcing.hpp: DefensiveKV's cumulative-attention-mass forcing (docs/algorithms.md#forcing), corrected
// and under reference_quirks (window bias of the prefix tail, cap int(P (1 - cr) - w), negative cap = "all but the last
// |cap|"), against hand-worked numbers and kvevict_ref::mass_forced.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_mass_forcing {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::RowMatrix;
using kvevict::extend::MassStatistics;
using kvevict_test::Forced;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;
using Idx = std::vector<Index>;

namespace {

// H = 4, Hkv = 2 (G = 2), w = 4, L = 12, P = 8. Every window row of a query head is the same; its window mass sits on
// key 8 (visible to all four rows). Multiples of 1/32 and G * w = 8: every sum, mean and quotient below is the same
// double in the library and the reference, so exact ties stay exact ties.
const std::vector<std::vector<double>> kRows = {
    {1, 10, 2, 3, 0, 4, 1, 2, 9, 0, 0, 0},   // q0: prefix 23/32, window 9/32, prefix tail [4, 8) 7/32
    {1, 10, 0, 1, 0, 8, 3, 0, 9, 0, 0, 0},   // q1: prefix 23/32, window 9/32, tail 11/32
    {6, 0, 0, 0, 0, 0, 0, 16, 10, 0, 0, 0},  // q2: prefix 22/32, window 10/32, tail 16/32
    {10, 0, 4, 0, 0, 0, 6, 4, 8, 0, 0, 0},   // q3: prefix 24/32, window 8/32, tail 10/32
};
const Shape kShape{4, 2, 4, 12, 1};

// KV 0: summed mass [1 10 1 2 0 6 2 1] -> p = that / 23; order (p desc, ties: the more recent token first)
//   1, 5, 6, 3, 7, 2, 0, 4; cumulative c = 10 16 18 20 21 22 23 23 (/23) = .435 .696 .783 .870 .913 .957 1 1.
// KV 1: summed mass [8 0 2 0 0 0 3 10] -> order 7, 0, 6, 2, 5, 4, 3, 1; c = 10 18 21 23 23 23 23 23 (/23).
const Idx kOrder0 = {1, 5, 6, 3, 7, 2, 0, 4};
const Idx kOrder1 = {7, 0, 6, 2, 5, 4, 3, 1};

template <class S = double>
MassStatistics<S> statistics(const std::vector<double>& attn, const Shape& s, bool quirks) {
  MassStatistics<S> m(kvevict_test::layer_shape(s), quirks);
  kvevict_test::for_each_head_rows<S>(attn, s, [&](int q, const RowMatrix<S>& rows) { m.add(q, rows); });
  return m;
}

Idx sorted(Idx v) {
  std::sort(v.begin(), v.end());
  return v;
}

Idx first(const Idx& order, std::size_t n) {
  return Idx(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n));
}

// Both heads' forced tokens, ascending, in the reference's form.
template <class S>
Forced forced_of(const MassStatistics<S>& m, int heads, double tau, Index cap) {
  Forced out;
  for (int h = 0; h < heads; ++h) {
    out.emplace_back();
    for (Index j : m.forced_tokens(h, tau, cap)) out.back().push_back(j);
    std::sort(out.back().begin(), out.back().end());
  }
  return out;
}

// The caps of docs/algorithms.md#forcing, as the selector computes them.
Index corrected_cap(std::int64_t n_kept, Index w) { return std::max<Index>(0, static_cast<Index>(n_kept) - w); }
Index quirk_cap(Index P, Index w, double cr) {
  return static_cast<Index>(static_cast<double>(P) * (1.0 - cr) - static_cast<double>(w));
}

}  // namespace

TEST_CASE("mass forcing on a hand-worked 2-KV-head, 12-token layer: window bias in both modes", "[mass_forcing]") {
  const std::vector<double> attn = kvevict_test::repeated_rows(kRows, 4, 32.0);
  // Corrected: the mass the window puts on itself, mean over 4 heads x 4 rows: (9 + 9 + 10 + 8) / 4 / 32 = 9/32.
  CHECK(statistics(attn, kShape, false).window_bias() == 9.0 / 32);
  // Quirks: the mass on the prefix tail [P - w, P) = [4, 8): (7 + 11 + 16 + 10) / 4 / 32 = 11/32.
  CHECK(statistics(attn, kShape, true).window_bias() == 11.0 / 32);
  // Float arithmetic: the same (exact in float too).
  CHECK(statistics<float>(attn, kShape, false).window_bias() == 9.0 / 32);
  // P < w under quirks: the tail is the whole prefix. H = Hkv = 1, w = 3, L = 5, P = 2: row masses on [0, 2):
  // .8, .4, .4 -> mean .8 / 1.6 ... (0.5 + 0.3) + (0.2 + 0.2) + (0.1 + 0.3) = 1.6 over 3 rows.
  const std::vector<double> tiny = {0.5, 0.3, 0.2, 0.0, 0.0, 0.2, 0.2, 0.2, 0.4, 0.0, 0.1, 0.3, 0.2, 0.2, 0.2};
  CHECK(statistics(tiny, Shape{1, 1, 3, 5, 1}, true).window_bias() == Approx(1.6 / 3).epsilon(1e-15));
  CHECK(statistics(tiny, Shape{1, 1, 3, 5, 1}, false).window_bias() == Approx(1.4 / 3).epsilon(1e-15));
}

TEST_CASE("mass forcing on a hand-worked layer, corrected mode: tau = threshold - window self-mass, cap = n_kept - w",
          "[mass_forcing]") {
  const std::vector<double> attn = kvevict_test::repeated_rows(kRows, 4, 32.0);
  const MassStatistics<double> m = statistics(attn, kShape, false);
  const double bias = 9.0 / 32;
  const Index no_cap = corrected_cap(12, 4);  // 8
  // threshold .9 -> tau .61875: KV 0 crosses at index 1 (c = .696) -> the token before it {1}; KV 1 at 1 (.783) -> {7}.
  CHECK(m.forced_tokens(0, 0.9 - bias, no_cap) == Idx{1});
  CHECK(m.forced_tokens(1, 0.9 - bias, no_cap) == Idx{7});
  // threshold 1.0 -> tau .71875: KV 0 at index 2 (.783) -> {1, 5} (in the sorted order); KV 1 at 1 -> {7}.
  CHECK(m.forced_tokens(0, 1.0 - bias, no_cap) == Idx{1, 5});
  CHECK(m.forced_tokens(1, 1.0 - bias, no_cap) == Idx{7});
  // threshold 1.1 -> tau .81875: KV 0 at 3 (.870) -> {1, 5, 6}; KV 1 at 2 (.913) -> {7, 0}.
  CHECK(m.forced_tokens(0, 1.1 - bias, no_cap) == Idx{1, 5, 6});
  CHECK(m.forced_tokens(1, 1.1 - bias, no_cap) == Idx{7, 0});
  // The cap n_kept - w cuts the sorted order: n_kept 6 -> 2, n_kept 5 -> 1, n_kept <= w -> nothing.
  CHECK(m.forced_tokens(0, 1.1 - bias, corrected_cap(6, 4)) == Idx{1, 5});
  CHECK(m.forced_tokens(0, 1.1 - bias, corrected_cap(5, 4)) == Idx{1});
  CHECK(m.forced_tokens(0, 1.1 - bias, corrected_cap(4, 4)).empty());
  CHECK(m.forced_tokens(1, 1.1 - bias, corrected_cap(2, 4)).empty());
  // tau never reached (threshold 1.5 -> tau 1.21875 > 1): nothing forced, whatever the cap.
  CHECK(m.forced_tokens(0, 1.5 - bias, no_cap).empty());
  CHECK(m.forced_tokens(1, 1.5 - bias, no_cap).empty());
  // tau below the first p (threshold .5 -> tau .21875 < 10/23): the crossing is index 0, whose token is not included.
  CHECK(m.forced_tokens(0, 0.5 - bias, no_cap).empty());
  // The reference agrees on every case above.
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.1, 6, false, 0.0) == Forced{{1, 5}, {0, 7}});
  CHECK(forced_of(m, 2, 1.1 - bias, corrected_cap(6, 4)) ==
        kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 1.1, 6, false, 0.0));
  for (double threshold : {0.5, 0.9, 1.0, 1.1, 1.5})
    for (std::int64_t n_kept : {2, 4, 5, 6, 12})
      CHECK(forced_of(m, 2, threshold - bias, corrected_cap(n_kept, 4)) ==
            kvevict_ref::mass_forced(attn, 4, 2, 4, 12, threshold, n_kept, false, 0.0));
}

TEST_CASE("mass forcing on a hand-worked layer under reference_quirks, including the short-context negative cap",
          "[mass_forcing]") {
  const std::vector<double> attn = kvevict_test::repeated_rows(kRows, 4, 32.0);
  const MassStatistics<double> m = statistics(attn, kShape, true);
  const double bias = 11.0 / 32;
  // cap = int(P (1 - cr) - w) = int(8 (1 - cr) - 4), in double, truncated toward zero.
  CHECK(quirk_cap(8, 4, 0.2) == 2);  // int(2.4)
  CHECK(quirk_cap(8, 4, 0.0) == 4);
  CHECK(quirk_cap(8, 4, 0.5) == 0);
  CHECK(quirk_cap(8, 4, 0.55) == 0);   // int(-0.4) = 0: truncation, not floor
  CHECK(quirk_cap(8, 4, 0.8) == -2);   // int(-2.4)
  CHECK(quirk_cap(8, 4, 0.95) == -3);  // int(-3.6)
  // threshold 1.0 -> tau .65625: KV 0 crosses at index 1 -> {1} (the corrected mode forced {1, 5}); KV 1 {7}.
  CHECK(m.forced_tokens(0, 1.0 - bias, quirk_cap(8, 4, 0.2)) == Idx{1});
  CHECK(m.forced_tokens(1, 1.0 - bias, quirk_cap(8, 4, 0.2)) == Idx{7});
  // threshold 1.2 -> tau .85625: KV 0 at 3, KV 1 at 2; cr .2 caps KV 0 at 2; cr 0 (cap 4) does not.
  CHECK(m.forced_tokens(0, 1.2 - bias, quirk_cap(8, 4, 0.2)) == Idx{1, 5});
  CHECK(m.forced_tokens(0, 1.2 - bias, quirk_cap(8, 4, 0.0)) == Idx{1, 5, 6});
  CHECK(m.forced_tokens(1, 1.2 - bias, quirk_cap(8, 4, 0.0)) == Idx{7, 0});
  // cr .5: cap 0 -> nothing.
  CHECK(m.forced_tokens(0, 1.2 - bias, quirk_cap(8, 4, 0.5)).empty());
  // Short context, cr .8: cap -2 -> all but the last 2 of the sorted order, even when tau is never reached
  // (k = 0, min(0, -2) = -2): KV 0 {1, 5, 6, 3, 7, 2}, KV 1 {7, 0, 6, 2, 5, 4}.
  for (double threshold : {0.9, 1.5, 0.0}) {
    CHECK(m.forced_tokens(0, threshold - bias, quirk_cap(8, 4, 0.8)) == first(kOrder0, 6));
    CHECK(m.forced_tokens(1, threshold - bias, quirk_cap(8, 4, 0.8)) == first(kOrder1, 6));
  }
  // cr .95: cap -3 -> the first 5; a cap of -P or less forces nothing.
  CHECK(m.forced_tokens(0, 0.9 - bias, quirk_cap(8, 4, 0.95)) == first(kOrder0, 5));
  CHECK(m.forced_tokens(1, 0.9 - bias, -8).empty());
  CHECK(m.forced_tokens(1, 0.9 - bias, -20).empty());
  CHECK(m.forced_tokens(1, 0.9 - bias, -7) == Idx{7});
  // The reference agrees.
  const Forced short_ctx = {sorted(first(kOrder0, 6)), sorted(first(kOrder1, 6))};
  CHECK(kvevict_ref::mass_forced(attn, 4, 2, 4, 12, 0.9, 2, true, 0.8) == short_ctx);
  CHECK(forced_of(m, 2, 0.9 - bias, quirk_cap(8, 4, 0.8)) == short_ctx);
  for (double threshold : {0.5, 0.9, 1.0, 1.1, 1.2, 1.5})
    for (double cr : {0.0, 0.2, 0.5, 0.55, 0.8, 0.95})
      CHECK(forced_of(m, 2, threshold - bias, quirk_cap(8, 4, cr)) ==
            kvevict_ref::mass_forced(attn, 4, 2, 4, 12, threshold, 2, true, cr));
}

TEST_CASE("mass forcing: c >= tau at an exact crossing (dyadic masses), ties to the more recent token",
          "[mass_forcing]") {
  // H = Hkv = 1, w = 1, L = 6, P = 5: row [1/4 1/8 1/16 1/16 0 | 1/2] -> p = [1/2 1/4 1/8 1/8 0] exactly; order 0, 1,
  // then the tie 3 before 2, then 4; c = 1/2, 3/4, 7/8, 1, 1. Window bias (corrected) 1/2.
  const std::vector<double> attn = {0.25, 0.125, 0.0625, 0.0625, 0.0, 0.5};
  const Shape s{1, 1, 1, 6, 1};
  const MassStatistics<double> m = statistics(attn, s, false);
  CHECK(m.window_bias() == 0.5);
  CHECK(m.forced_tokens(0, 1.25 - m.window_bias(), 5) == Idx{0});  // tau 3/4 == c[1]: crosses at index 1
  CHECK(m.forced_tokens(0, 0.75 + 1e-12, 5) == Idx{0, 1});         // just above: index 2
  CHECK(m.forced_tokens(0, 0.75 - 1e-12, 5) == Idx{0});
  CHECK(m.forced_tokens(0, 1.5 - m.window_bias(), 5) == Idx{0, 1, 3});  // tau 1 == c[3]: token 2 loses the tie
  CHECK(m.forced_tokens(0, 1.0 + 1e-12, 5).empty());                    // never reached
  CHECK(m.forced_tokens(0, 0.5, 5).empty());                            // crosses at index 0
  CHECK(m.forced_tokens(0, 1.0, 2) == Idx{0, 1});                       // capped
  CHECK(kvevict_ref::mass_forced(attn, 1, 1, 1, 6, 1.5, 6, false, 0.0) == Forced{{0, 1, 3}});
  CHECK(kvevict_ref::mass_forced(attn, 1, 1, 1, 6, 1.25, 6, false, 0.0) == Forced{{0}});
}

TEST_CASE("mass forcing: a KV head with no prefix mass forces nothing (unless a negative cap says all but |cap|)",
          "[mass_forcing]") {
  // H = Hkv = 2, w = 1, L = 4, P = 3. Head 0 row [0 0 0 | 1]; head 1 row [.25 .5 .125 | .125] -> p = [2 4 1] / 7,
  // order 1, 0, 2; c = 4/7, 6/7, 1.
  const std::vector<double> attn = {0, 0, 0, 1, 0.25, 0.5, 0.125, 0.125};
  const Shape s{2, 2, 1, 4, 1};
  const MassStatistics<double> corrected = statistics(attn, s, false);
  CHECK(corrected.window_bias() == Approx(0.5625));
  CHECK(corrected.forced_tokens(0, 0.5, 3).empty());
  CHECK(corrected.forced_tokens(1, 0.5, 3).empty());       // tau <= 4/7 at index 0
  CHECK(corrected.forced_tokens(1, 0.8, 3) == Idx{1});     // crosses at 6/7
  CHECK(corrected.forced_tokens(1, 0.9, 3) == Idx{1, 0});  // crosses at 1
  const MassStatistics<double> quirks = statistics(attn, s, true);
  // cap -1: all but the last of the order; the zero-mass head's order is positions descending 2, 1, 0.
  CHECK(quirks.forced_tokens(0, 0.9, -1) == Idx{2, 1});
  CHECK(quirks.forced_tokens(1, 0.9, -1) == Idx{1, 0});
  CHECK(kvevict_ref::mass_forced(attn, 2, 2, 1, 4, 1.5, 4, true, 1.0) == Forced{{1, 2}, {0, 1}});
}

TEST_CASE("mass forcing matches the reference on random layers (both modes, near-ties of c vs tau skipped)",
          "[mass_forcing]") {
  Rng rng(601);
  int cases = 0, skipped = 0;
  for (int t = 0; t < 12; ++t) {
    const Shape s = t == 0 ? Shape{8, 2, 32, 1200, 16} : kvevict_test::random_shape(rng, 200);
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng, t % 3 == 0 ? 3.0 : 1.5);
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    for (bool quirks : {false, true}) {
      const MassStatistics<double> m = statistics(attn, s, quirks);
      for (double threshold : {0.5, 0.9, 1.0}) {
        INFO(kvevict_test::describe(s) << " quirks=" << quirks << " threshold=" << threshold);
        ++cases;
        if (kvevict_test::mass_margin(attn, s, threshold, quirks) < 1e-9) {
          ++skipped;
          continue;
        }
        const double tau = threshold - m.window_bias();
        if (quirks) {
          for (double cr : {0.0, 0.3, 0.5, 0.8, 0.95}) {
            INFO("cr=" << cr);
            CHECK(forced_of(m, s.Hkv, tau, quirk_cap(s.P(), s.w, cr)) ==
                  kvevict_ref::mass_forced(attn, s.H, s.Hkv, s.w, s.L, threshold, 1, true, cr));
          }
        } else {
          for (std::int64_t n_kept : kvevict_test::some_budgets(s, rng, 5)) {
            INFO("n_kept=" << n_kept);
            const Forced f = forced_of(m, s.Hkv, tau, corrected_cap(n_kept, s.w));
            CHECK(f == kvevict_ref::mass_forced(attn, s.H, s.Hkv, s.w, s.L, threshold, n_kept, false, 0.0));
            for (const auto& head : f) CHECK(static_cast<Index>(head.size()) <= corrected_cap(n_kept, s.w));
          }
        }
        // The returned order is p descending: the forced tokens are the heaviest ones.
        for (int h = 0; h < s.Hkv; ++h) {
          const Idx f = m.forced_tokens(h, tau, s.P());
          std::vector<double> p(sz(s.P()), 0.0);
          for (int q = h * s.G(); q < (h + 1) * s.G(); ++q)
            for (int i = 0; i < s.w; ++i)
              for (int j = 0; j < s.P(); ++j) p[sz(j)] += attn[(sz(q) * sz(s.w) + sz(i)) * sz(s.L) + sz(j)];
          for (std::size_t a = 1; a < f.size(); ++a) CHECK(p[sz(f[a - 1])] >= p[sz(f[a])]);
          if (!f.empty() && static_cast<int>(f.size()) < s.P()) {
            double lightest_forced = p[sz(f.back())], heaviest_other = 0.0;
            for (int j = 0; j < s.P(); ++j)
              if (std::find(f.begin(), f.end(), j) == f.end()) heaviest_other = std::max(heaviest_other, p[sz(j)]);
            CHECK(lightest_forced >= heaviest_other);
          }
        }
      }
    }
  }
  INFO("skipped " << skipped << " of " << cases << " cases as near-ties");
  CHECK(skipped * 20 <= cases);
}

TEST_CASE("mass forcing on quantised attention (exact ties, exact crossings) matches the reference exactly",
          "[mass_forcing]") {
  // Multiples of 1/8 and G * w a power of two: the library and the reference compute the same doubles, so no case is
  // skipped, even where c == tau exactly.
  Rng rng(602);
  for (int t = 0; t < 30; ++t) {
    const Shape s = kvevict_test::random_shape(rng, 120);
    const std::vector<double> attn = kvevict_test::quantised_scores(sz(s.H * s.w * s.L), 1 + t % 4, rng);
    for (bool quirks : {false, true}) {
      const MassStatistics<double> m = statistics(attn, s, quirks);
      for (double threshold : {0.25, 0.5, 0.75, 1.0}) {
        INFO(kvevict_test::describe(s) << " quirks=" << quirks << " threshold=" << threshold);
        const double tau = threshold - m.window_bias();
        if (quirks)
          for (double cr : {0.0, 0.5, 0.75, 0.875})
            CHECK(forced_of(m, s.Hkv, tau, quirk_cap(s.P(), s.w, cr)) ==
                  kvevict_ref::mass_forced(attn, s.H, s.Hkv, s.w, s.L, threshold, 1, true, cr));
        else
          for (std::int64_t n_kept : kvevict_test::budget_sweep(s, rng))
            CHECK(forced_of(m, s.Hkv, tau, corrected_cap(n_kept, s.w)) ==
                  kvevict_ref::mass_forced(attn, s.H, s.Hkv, s.w, s.L, threshold, n_kept, false, 0.0));
      }
    }
  }
}

namespace {

// The full ranking forced_tokens used before it ranked lazily (p descending, ties to the more recent token).
Idx full_sort_order(const std::vector<float>& p) {
  const Index P = static_cast<Index>(p.size());
  Idx order(p.size());
  for (Index j = 0; j < P; ++j) order[sz(j)] = j;
  std::sort(order.begin(), order.end(),
            [&](Index a, Index b) { return p[sz(a)] != p[sz(b)] ? p[sz(a)] > p[sz(b)] : a > b; });
  return order;
}

}  // namespace

TEST_CASE(
    "mass forcing ranks lazily (stopping at the cap when tau is surely reached) yet forces exactly what a full "
    "sort does",
    "[mass_forcing]") {
  Rng rng(20261130);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  int cases = 0, stopped_early = 0;
  for (const Index P : {Index{1}, Index{2}, Index{7}, Index{300}, Index{5000}, Index{40000}}) {
    for (int kind = 0; kind < 4; ++kind) {
      // One KV head, one query head, w = 1: the mass row is the prefix of the single window row.
      const Index L = P + 1;
      const kvevict::extend::LayerShape shape{1, 1, 1, L, 1, P, 1, {}, {}};
      RowMatrix<float> rows(1, L);
      for (Index j = 0; j < P; ++j) {
        const double u = u01(rng);
        rows(0, j) = kind == 0   ? static_cast<float>(u)                          // diffuse
                     : kind == 1 ? static_cast<float>(std::pow(u, 12.0))          // peaked
                     : kind == 2 ? static_cast<float>(std::floor(u * 4.0) / 4.0)  // exact ties, zeros
                                 : (j % 3 == 0 ? static_cast<float>(u) : 0.0f);   // sparse
      }
      rows(0, P) = 0.5f;
      MassStatistics<float> m(shape, false);
      m.add(0, rows);
      const std::vector<float> p(rows.data(), rows.data() + P);
      const Idx order = full_sort_order(p);
      const RowMatrix<float> mass = rows.leftCols(P).colwise().sum();
      const float total = mass.row(0).sum();  // the same Eigen expression as the library's (the same rounding)
      for (const double tau : {0.0, 0.5, 0.9, u01(rng), 1.0 - 1e-7, 1.0, 1.0 + 1e-7, 1.5}) {
        for (const Index cap : {-P - 1, Index{-3}, Index{0}, Index{1}, P / 5, P - 1, P, P + 5}) {
          // The walk of the full-sort version, verbatim (float arithmetic in the same order: identical, not close).
          Index k = 0;
          if (total > 0.0f) {
            float c = 0;
            for (k = 0; k < P; ++k) {
              c += p[sz(order[sz(k)])] / total;
              if (static_cast<double>(c) >= tau) break;
            }
            if (k == P) k = 0;
          }
          k = std::min(k, cap);
          if (k < 0) k = std::max<Index>(0, P + k);
          const Idx got = m.forced_tokens(0, tau, cap);
          INFO("P " << P << " kind " << kind << " tau " << tau << " cap " << cap);
          REQUIRE(got == first(order, sz(k)));
          ++cases;
          stopped_early += (cap > 0 && cap < P && k == cap) ? 1 : 0;
        }
      }
    }
  }
  CHECK(cases == 6 * 4 * 8 * 8);
  CHECK(stopped_early > 50);  // the early stop is exercised, not only the full walk
}

}  // namespace test_mass_forcing
