// measure/perturbation.hpp (docs/algorithms.md#measured): retained attention mass and output perturbation of a
// selection, measured with future queries; a hand-checked tiny case, the full cache, consistency of mean / min /
// relative with per_query, an independent double-loop computation, and errors.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_measure {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

Selection selection_of(const std::vector<std::vector<Index>>& kept, Index tokens) {
  std::vector<std::uint8_t> flags(sz(static_cast<std::int64_t>(kept.size()) * tokens), 0);
  for (std::size_t h = 0; h < kept.size(); ++h)
    for (Index j : kept[h]) flags[h * sz(tokens) + sz(j)] = 1;
  return Selection::from_flags(flags, static_cast<Index>(kept.size()), tokens);
}

Selection everything(Index heads, Index tokens) {
  return Selection::from_flags(std::vector<std::uint8_t>(sz(heads * tokens), 1), heads, tokens);
}

// Independent double loops: softmax over all L keys for future query f of head q, then the sums of
// docs/algorithms.md#measured.
struct Direct {
  std::vector<double> mass;          // [H, F]
  std::vector<double> perturbation;  // [F]
  std::vector<double> relative;      // [F]
};

Direct direct(const std::vector<double>& fq, const kvevict_test::VLayer& l, int F, const Selection& sel) {
  const Shape& s = l.s;
  Direct out;
  out.mass.assign(sz(s.H * F), 0.0);
  std::vector<double> full(sz(F * l.D), 0.0), kept(sz(F * l.D), 0.0);
  for (int q = 0; q < s.H; ++q) {
    const int h = q / s.G();
    for (int f = 0; f < F; ++f) {
      std::vector<double> a(sz(s.L));
      double m = -HUGE_VAL;
      for (int j = 0; j < s.L; ++j) {
        double dot = 0;
        for (int c = 0; c < s.d; ++c) dot += fq[sz((q * F + f) * s.d + c)] * l.k[sz((h * s.L + j) * s.d + c)];
        a[sz(j)] = dot / std::sqrt(static_cast<double>(s.d));
        m = std::max(m, a[sz(j)]);
      }
      double z = 0;
      for (double& x : a) z += (x = std::exp(x - m));
      for (double& x : a) x /= z;
      double km = 0;
      for (auto j : sel.head(h)) km += a[sz(j)];
      out.mass[sz(q * F + f)] = km;
      for (int j = 0; j < s.L; ++j) {
        const double ak = sel.kept(h, j) && km > 0 ? a[sz(j)] / km : 0.0;
        for (int r = 0; r < l.D; ++r) {
          double vw = 0;  // V[h][j] . W_o[r, q*d : (q+1)*d]
          for (int c = 0; c < s.d; ++c) vw += l.v[sz((h * s.L + j) * s.d + c)] * l.w_o[sz(r * s.H * s.d + q * s.d + c)];
          full[sz(f * l.D + r)] += a[sz(j)] * vw;
          kept[sz(f * l.D + r)] += ak * vw;
        }
      }
    }
  }
  for (int f = 0; f < F; ++f) {
    double e = 0, n = 0;
    for (int r = 0; r < l.D; ++r) {
      const double x = full[sz(f * l.D + r)] - kept[sz(f * l.D + r)];
      e += x * x;
      n += full[sz(f * l.D + r)] * full[sz(f * l.D + r)];
    }
    out.perturbation.push_back(std::sqrt(e));
    out.relative.push_back(n > 0 ? std::sqrt(e) / std::sqrt(n) : 0.0);
  }
  return out;
}

}  // namespace

TEST_CASE("retained mass and output perturbation on a hand-checked tiny case", "[measure]") {
  // H = 2 query heads on Hkv = 1 (G = 2), head_dim 1, L = 3, F = 2 future queries, D = 2.
  // Keys [0, ln 2, ln 3]: query q gives softmax proportional to [1, 2^q, 3^q].
  //   head 0: f0 q = 1 -> [1 2 3] / 6;  f1 q = 0 -> [1 1 1] / 3.   head 1: f0 q = 0 -> uniform;  f1 q = 2 -> [1 4 9]
  //   / 14.
  // Kept {1, 2}: mass head 0 = 5/6, 2/3; head 1 = 2/3, 13/14. Mean (5/6 + 2/3 + 2/3 + 13/14) / 4, min 2/3.
  const std::vector<double> keys = {0.0, std::log(2.0), std::log(3.0)};
  const std::vector<double> fq = {1, 0, 0, 2};  // [H = 2, F = 2, d = 1]
  const auto k = kvevict::kv_heads_major<const double>(keys.data(), 1, 3, 1);
  const auto f = HeadsView<const double>::heads_major(fq.data(), 2, 2, 1);
  const Selection sel = selection_of({{1, 2}}, 3);
  const kvevict::RetainedMass m = kvevict::retained_attention_mass(f, k, sel);
  REQUIRE(m.per_query.rows() == 2);
  REQUIRE(m.per_query.cols() == 2);
  CHECK(m.per_query(0, 0) == Approx(5.0 / 6).epsilon(1e-14));
  CHECK(m.per_query(0, 1) == Approx(2.0 / 3).epsilon(1e-14));
  CHECK(m.per_query(1, 0) == Approx(2.0 / 3).epsilon(1e-14));
  CHECK(m.per_query(1, 1) == Approx(13.0 / 14).epsilon(1e-14));
  CHECK(m.mean == Approx((5.0 / 6 + 2.0 / 3 + 2.0 / 3 + 13.0 / 14) / 4).epsilon(1e-14));
  CHECK(m.min == Approx(2.0 / 3).epsilon(1e-14));
  // Values [1, 0, -1]; W_o = [[1, 0], [0, 2]]: head 0 writes v to output 0, head 1 writes 2 v to output 1.
  //   f0: full = (-1/3, 0) (head 1 uniform: 0); kept: head 0 [0 2 3]/5 -> -3/5, head 1 [0 1 1]/2 -> -1/2 x 2:
  //       (-3/5, -1); error (4/15, 1), |error| = sqrt(241)/15, relative sqrt(241)/15 / (1/3) = sqrt(241)/5.
  //   f1: full = (0, 2 (1 - 9)/14) = (0, -8/7); kept: head 0 -> -1/2, head 1 [0 4 9]/13 -> -9/13 x 2:
  //       (-1/2, -18/13); error (1/2, 22/91), relative |error| / (8/7).
  const std::vector<double> values = {1, 0, -1}, w_o = {1, 0, 0, 2};
  kvevict::LayerInputs<double> in;
  in.keys = k;
  in.values = kvevict::kv_heads_major<const double>(values.data(), 1, 3, 1);
  in.w_o = kvevict::output_projection<const double>(w_o.data(), 2, 2, 1);
  const kvevict::OutputPerturbation p = kvevict::output_perturbation(f, in, sel);
  const double e0 = std::sqrt(241.0) / 15, e1 = std::sqrt(0.25 + (22.0 / 91) * (22.0 / 91));
  REQUIRE(p.per_query.size() == 2);
  CHECK(p.per_query[0] == Approx(e0).epsilon(1e-13));
  CHECK(p.per_query[1] == Approx(e1).epsilon(1e-13));
  CHECK(p.mean == Approx((e0 + e1) / 2).epsilon(1e-13));
  CHECK(p.relative == Approx((e0 * 3 + e1 * 7.0 / 8) / 2).epsilon(1e-13));
  // Keep everything: mass 1, no perturbation.
  const Selection all = everything(1, 3);
  const kvevict::RetainedMass m_all = kvevict::retained_attention_mass(f, k, all);
  CHECK(m_all.min == Approx(1.0).epsilon(1e-15));
  CHECK(m_all.mean == Approx(1.0).epsilon(1e-15));
  const kvevict::OutputPerturbation p_all = kvevict::output_perturbation(f, in, all);
  CHECK(p_all.mean <= 1e-15);
  CHECK(p_all.relative <= 1e-14);
  // Keep only token 0 of a head: mass 1/6, 1/3, 1/3, 1/14.
  const kvevict::RetainedMass m0 = kvevict::retained_attention_mass(f, k, selection_of({{0}}, 3));
  CHECK(m0.min == Approx(1.0 / 14).epsilon(1e-14));
}

TEST_CASE("measurement on random layers: full cache, consistency of the summaries, an independent computation",
          "[measure]") {
  Rng rng(1001);
  const Shape shapes[] = {{4, 2, 4, 50, 16}, {8, 8, 4, 30, 16}, {8, 1, 32, 80, 64}, {2, 2, 4, 300, 16}};
  int t = 0;
  for (const Shape& s : shapes) {
    INFO(kvevict_test::describe(s));
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 12, rng);
    const int F = 3 + t;
    const std::vector<double> fq = kvevict_test::normal_vector(sz(s.H * F * s.d), rng, 1.5);
    const auto hm = kvevict_test::store_v<double>(l, Layout::heads_major);
    const auto tm = kvevict_test::store_v<double>(l, Layout::tokens_major);
    const auto f = HeadsView<const double>::heads_major(fq.data(), s.H, F, s.d);
    // The full cache (n_kept = L, what every policy keeps at the full budget).
    kvevict::DefensiveKV::Params p;
    p.window = s.w;
    const Selection full = kvevict::DefensiveKV(p).select<double>(hm.in, Budget::tokens(s.L));
    CHECK(full.total() == s.Hkv * s.L);
    const kvevict::RetainedMass m_full = kvevict::retained_attention_mass(f, hm.in.keys, full);
    CHECK(m_full.min == Approx(1.0).epsilon(1e-12));
    CHECK(m_full.mean == Approx(1.0).epsilon(1e-12));
    const kvevict::OutputPerturbation p_full = kvevict::output_perturbation(f, hm.in, full);
    CHECK(p_full.mean <= 1e-12);
    CHECK(p_full.relative <= 1e-12);
    for (double e : p_full.per_query) CHECK(e <= 1e-12);
    for (std::int64_t n : {std::int64_t(1), std::int64_t(s.w + 2), std::int64_t(s.L / 3)}) {
      INFO("n_kept " << n);
      const Selection sel = kvevict::DefensiveKV(p).select<double>(hm.in, Budget::tokens(n));
      const kvevict::RetainedMass m = kvevict::retained_attention_mass(f, hm.in.keys, sel);
      const kvevict::OutputPerturbation o = kvevict::output_perturbation(f, hm.in, sel);
      // Summaries consistent with per_query.
      REQUIRE(m.per_query.rows() == s.H);
      REQUIRE(m.per_query.cols() == F);
      double sum = 0, lo = HUGE_VAL;
      for (Index q = 0; q < s.H; ++q)
        for (Index i = 0; i < F; ++i) {
          CHECK(m.per_query(q, i) >= 0.0);
          CHECK(m.per_query(q, i) <= 1.0 + 1e-12);
          sum += m.per_query(q, i);
          lo = std::min(lo, m.per_query(q, i));
        }
      CHECK(m.mean == Approx(sum / (s.H * F)).epsilon(1e-14));
      CHECK(m.min == lo);
      REQUIRE(o.per_query.size() == sz(F));
      double es = 0;
      for (double e : o.per_query) es += e;
      CHECK(o.mean == Approx(es / F).epsilon(1e-14));
      // An independent computation.
      const Direct d = direct(fq, l, F, sel);
      for (Index q = 0; q < s.H; ++q)
        for (Index i = 0; i < F; ++i) CHECK(m.per_query(q, i) == Approx(d.mass[sz(q * F + i)]).epsilon(1e-12));
      CHECK(kvevict_test::compare_close(o.per_query, d.perturbation, 1e-10, 1e-14) == "");
      double rel = 0;
      for (double r : d.relative) rel += r / F;
      CHECK(o.relative == Approx(rel).epsilon(1e-10));
      // Layout invariance, float storage.
      const kvevict::RetainedMass mt = kvevict::retained_attention_mass(f, tm.in.keys, sel);
      CHECK(mt.mean == Approx(m.mean).epsilon(1e-14));
      CHECK(kvevict_test::compare_close(kvevict::output_perturbation(f, tm.in, sel).per_query, o.per_query, 1e-12,
                                        1e-15) == "");
      const auto fl = kvevict_test::store_v<float>(l, Layout::heads_major);
      const std::vector<float> fqf = kvevict_test::cast_to<float>(fq);
      const auto ff = HeadsView<const float>::heads_major(fqf.data(), s.H, F, s.d);
      CHECK(kvevict::retained_attention_mass(ff, fl.in.keys, sel).mean == Approx(m.mean).epsilon(1e-4));
      // A superset keeps at least as much mass for every query.
      const Selection more =
          kvevict::DefensiveKV(p).select<double>(hm.in, Budget::tokens(std::min<std::int64_t>(s.L, 2 * n)));
      bool superset = true;
      for (Index h = 0; h < s.Hkv; ++h)
        for (auto j : sel.head(h)) superset = superset && more.kept(h, j);
      if (superset) {
        const kvevict::RetainedMass mm = kvevict::retained_attention_mass(f, hm.in.keys, more);
        for (Index q = 0; q < s.H; ++q)
          for (Index i = 0; i < F; ++i) CHECK(mm.per_query(q, i) >= m.per_query(q, i) - 1e-15);
      }
    }
    ++t;
  }
}

TEST_CASE("measurement errors", "[measure][errors]") {
  Rng rng(1002);
  const Shape s{4, 2, 4, 20, 8};
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 6, rng);
  const auto st = kvevict_test::store_v<double>(l, Layout::heads_major);
  const std::vector<double> fq = kvevict_test::normal_vector(sz(4 * 3 * 8), rng);
  const auto f = HeadsView<const double>::heads_major(fq.data(), 4, 3, 8);
  const Selection sel = everything(2, 20);
  REQUIRE_THROWS_MATCHES(
      kvevict::retained_attention_mass(HeadsView<const double>::heads_major(fq.data(), 3, 4, 8), st.in.keys, sel),
      kvevict::invalid_argument,
      MessageContains("kvevict::retained_attention_mass: future_queries heads (3) must be a multiple "
                      "of the KV heads (2)"));
  REQUIRE_THROWS_MATCHES(
      kvevict::retained_attention_mass(HeadsView<const double>::heads_major(fq.data(), 4, 6, 4), st.in.keys, sel),
      kvevict::invalid_argument, MessageContains("future_queries head_dim (4) must equal the keys head_dim (8)"));
  REQUIRE_THROWS_MATCHES(kvevict::retained_attention_mass(HeadsView<const double>(), st.in.keys, sel),
                         kvevict::invalid_argument,
                         MessageContains("future_queries must be a non-empty [H, F, head_dim] view"));
  REQUIRE_THROWS_MATCHES(
      kvevict::retained_attention_mass(f, st.in.keys, everything(2, 19)), kvevict::invalid_argument,
      MessageContains("the selection (2 heads over 19 tokens) must match the keys (2 heads over 20 tokens)"));
  REQUIRE_THROWS_MATCHES(kvevict::retained_attention_mass(f, st.in.keys, everything(1, 20)), kvevict::invalid_argument,
                         MessageContains("must match the keys"));
  kvevict::LayerInputs<double> bad = st.in;
  bad.w_o = kvevict::output_projection<const double>(st.w_o.data(), 6, 2, 8);
  REQUIRE_THROWS_MATCHES(
      kvevict::output_perturbation(f, bad, sel), kvevict::invalid_argument,
      MessageContains("kvevict::output_perturbation: w_o must be W_o [hidden, H * head_dim] with H = 4"));
  bad = st.in;
  bad.values = {};
  REQUIRE_THROWS_MATCHES(kvevict::output_perturbation(f, bad, sel), kvevict::invalid_argument,
                         MessageContains("values must be [2, 20, head_dim] like the keys"));
  bad = st.in;
  bad.w_o = {};
  REQUIRE_THROWS_MATCHES(kvevict::output_perturbation(f, bad, sel), kvevict::invalid_argument,
                         MessageContains("w_o must be"));
}

}  // namespace test_measure
