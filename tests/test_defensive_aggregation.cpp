// aggregation/defensive.hpp (docs/algorithms.md#aggregation): DefensiveKV's worst-case aggregation with the
// adaptive prior floor against hand-worked numbers and the float64 reference, and its structural properties.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_defensive_aggregation {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Pooling;
using kvevict::RowMatrix;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

// H = 4, Hkv = 2 (G = 2), w = 4, L = 12, P = 8. Rows in units of 1/32, each summing to 32/32 and causal (window row i
// sees keys <= 8 + i). Query heads 0, 1 belong to KV head 0; 2, 3 to KV head 1.
const std::vector<std::vector<double>> kRows = {
    // q0: three different rows and one with no prefix mass at all.
    {0, 8, 0, 0, 4, 0, 0, 0, 20, 0, 0, 0},
    {0, 0, 0, 12, 0, 0, 8, 0, 4, 8, 0, 0},
    {2, 0, 0, 0, 0, 0, 0, 2, 4, 8, 16, 0},
    {0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8},
    // q1: the same row four times.
    {0, 0, 6, 0, 0, 0, 0, 0, 26, 0, 0, 0},
    {0, 0, 6, 0, 0, 0, 0, 0, 26, 0, 0, 0},
    {0, 0, 6, 0, 0, 0, 0, 0, 26, 0, 0, 0},
    {0, 0, 6, 0, 0, 0, 0, 0, 26, 0, 0, 0},
    // q2: a spike on the first prefix token, then three equal rows.
    {16, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0},
    {0, 0, 0, 0, 0, 3, 3, 0, 26, 0, 0, 0},
    {0, 0, 0, 0, 0, 3, 3, 0, 26, 0, 0, 0},
    {0, 0, 0, 0, 0, 3, 3, 0, 26, 0, 0, 0},
    // q3
    {0, 0, 9, 0, 0, 0, 3, 0, 20, 0, 0, 0},
    {0, 0, 9, 0, 0, 0, 3, 0, 20, 0, 0, 0},
    {0, 0, 9, 0, 0, 0, 3, 0, 20, 0, 0, 0},
    {0, 0, 9, 0, 0, 0, 3, 0, 20, 0, 0, 0},
};

std::vector<double> hand_attention() {
  std::vector<double> a;
  for (const auto& r : kRows)
    for (double x : r) a.push_back(x / 32.0);
  return a;
}

std::vector<double> over32(std::vector<double> v) {
  for (double& x : v) x /= 32.0;
  return v;
}

const Shape kShape{4, 2, 4, 12, 1};

/// M through DefensiveAggregator fed one query head at a time, as RowMatrix rows [w, L].
std::vector<double> aggregate(const std::vector<double>& attn, const Shape& s, Index kernel, Pooling pooling,
                              bool floor) {
  kvevict::extend::DefensiveAggregator<double> agg(kvevict_test::layer_shape(s), kernel, pooling, floor);
  kvevict_test::for_each_head_rows<double>(attn, s, [&](int q, const RowMatrix<double>& rows) { agg.add(q, rows); });
  const RowMatrix<double> m = agg.finish();
  REQUIRE(m.rows() == s.Hkv);
  REQUIRE(m.cols() == s.P());
  std::vector<double> out;
  for (Index h = 0; h < m.rows(); ++h)
    for (Index j = 0; j < m.cols(); ++j) out.push_back(m(h, j));
  return out;
}

/// M through defensive_scores over a WindowObservation of `in`.
template <class S, class T>
std::vector<double> defensive_of(const kvevict::LayerInputs<T>& in, Index window, Index kernel, Pooling pooling,
                                 bool floor) {
  const kvevict::extend::LayerShape shape = kvevict::detail::validate_inputs(in, window, "test");
  const kvevict::extend::WindowObservation<S, T> obs(in, shape);
  const RowMatrix<S> m = kvevict::extend::defensive_scores(obs, kernel, pooling, floor);
  std::vector<double> out;
  for (Index h = 0; h < m.rows(); ++h)
    for (Index j = 0; j < m.cols(); ++j) out.push_back(static_cast<double>(m(h, j)));
  return out;
}

}  // namespace

TEST_CASE("defensive aggregation on a hand-worked 2-KV-head, 12-token layer (kernels 1, 3, 5, floor on and off)",
          "[defensive_aggregation]") {
  const std::vector<double> attn = hand_attention();
  struct Case {
    Index kernel;
    Pooling pooling;
    bool floor;
    std::vector<double> want;  // M [2, 8] in units of 1/32
  };
  // Kernel 3, avg (R per row = pooled row renormalised to the row's prefix mass):
  //   q0 row 0 [0 8 0 0 4 0 0 0]: pooled [8 8 8 4 4 4 0 0]/3, sum 12 = mass (no edge mass) -> [8/3 8/3 8/3 4/3 4/3 4/3
  //   0 0] q0 row 1 [0 0 0 12 0 0 8 0] -> [0 0 4 4 4 8/3 8/3 8/3] q0 row 2 [2 0 0 0 0 0 0 2]: pooled [2 2 0 0 0 0 2
  //   2]/3, sum 8/3, mass 4 -> x 3/2 -> [1 1 0 0 0 0 1 1] q0 row 3: no prefix mass -> pooled sum 0 -> zeros (no NaN) q1
  //   [0 0 6 0 0 0 0 0] -> [0 2 2 2 0 0 0 0] M[0] = max = [8/3 8/3 4 4 4 8/3 8/3 8/3], mean 19/6 -> floor [19/6 19/6 4
  //   4 4 19/6 19/6 19/6] q2 row 0 [16 0 ...]: pooled [16 16 0 ...]/3, sum 32/3, mass 16 -> x 3/2 -> [8 8 0 0 0 0 0 0]
  //   q2 rows 1-3 [0 0 0 0 0 3 3 0] -> [0 0 0 0 1 2 2 1];  q3 [0 0 9 0 0 0 3 0] -> [0 3 3 3 0 1 1 1]
  //   M[1] = [8 8 3 3 1 2 2 1], mean 7/2 -> floor [8 8 7/2 7/2 7/2 7/2 7/2 7/2]
  // Kernel 3, max: the same renormalised spikes, except q2 rows 1-3: pooled [0 0 0 0 3 3 3 3], sum 12, mass 6 ->
  //   x 1/2 -> [0 0 0 0 3/2 3/2 3/2 3/2], so M[1] = [8 8 3 3 3/2 3/2 3/2 3/2] (mean 7/2 again).
  // Kernel 1 (no smoothing, R = A): M[0] = [2 8 6 12 4 0 8 2] (mean 21/4), M[1] = [16 0 9 0 0 3 3 0] (mean 31/8).
  // Kernel 5, avg: q0 row 0 pooled [8 8 12 12 4 4 4 0]/5, sum 52/5, mass 12 -> x 15/13 -> [24 24 36 36 12 12 12 0]/13;
  //   q0 row 1 pooled [0 12 12 12 20 20 8 8]/5, sum 92/5, mass 20 -> x 25/23 -> [0 60 60 60 100 100 40 40]/23;
  //   q0 row 2 pooled [2 2 2 0 0 2 2 2]/5 -> x 5/3 -> [2 2 2 0 0 2 2 2]/3; q1 pooled [6 6 6 6 6 0 0 0]/5, sum 6 = mass;
  //   q2 row 0 pooled [16 16 16 0 ...]/5 -> x 5/3 -> [16 16 16 0 ...]/3; q2 rows 1-3 pooled [0 0 0 3 6 6 6 6]/5,
  //   sum 27/5, mass 6 -> x 10/9 -> [0 0 0 2/3 4/3 4/3 4/3 4/3]; q3 pooled [9 9 9 9 12 3 3 3]/5, sum 57/5, mass 12 ->
  //   x 20/19 -> [36 36 36 36 48 12 12 12]/19.
  //   M[0] = [24/13 60/23 36/13 36/13 100/23 100/23 40/23 40/23], M[1] = [16/3 16/3 16/3 36/19 48/19 4/3 4/3 4/3].
  const std::vector<Case> cases = {
      {3, Pooling::avg, false, {8. / 3, 8. / 3, 4, 4, 4, 8. / 3, 8. / 3, 8. / 3, 8, 8, 3, 3, 1, 2, 2, 1}},
      {3,
       Pooling::avg,
       true,
       {19. / 6, 19. / 6, 4, 4, 4, 19. / 6, 19. / 6, 19. / 6, 8, 8, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5}},
      {3, Pooling::max, false, {8. / 3, 8. / 3, 4, 4, 4, 8. / 3, 8. / 3, 8. / 3, 8, 8, 3, 3, 1.5, 1.5, 1.5, 1.5}},
      {3,
       Pooling::max,
       true,
       {19. / 6, 19. / 6, 4, 4, 4, 19. / 6, 19. / 6, 19. / 6, 8, 8, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5}},
      {1, Pooling::avg, false, {2, 8, 6, 12, 4, 0, 8, 2, 16, 0, 9, 0, 0, 3, 3, 0}},
      {1, Pooling::max, true, {5.25, 8, 6, 12, 5.25, 5.25, 8, 5.25, 16, 3.875, 9, 3.875, 3.875, 3.875, 3.875, 3.875}},
  };
  for (const Case& c : cases) {
    INFO("kernel " << c.kernel << " " << kvevict::to_string(c.pooling) << " floor " << c.floor);
    const std::vector<double> want = over32(c.want);
    CHECK(kvevict_test::compare_close(aggregate(attn, kShape, c.kernel, c.pooling, c.floor), want, 1e-15, 1e-17) == "");
    const std::vector<double> keys(12 * 2, 0.0);
    const auto in = kvevict_test::attention_inputs(attn, keys, kShape);
    CHECK(kvevict_test::compare_close(defensive_of<double>(in, 4, c.kernel, c.pooling, c.floor), want, 1e-15, 1e-17) ==
          "");
    const std::vector<float> attn_f = kvevict_test::cast_to<float>(attn), keys_f(12 * 2, 0.0f);
    const auto in_f = kvevict_test::attention_inputs(attn_f, keys_f, kShape);
    CHECK(kvevict_test::compare_close(defensive_of<float>(in_f, 4, c.kernel, c.pooling, c.floor), want, 1e-6, 1e-8) ==
          "");
    // The reference agrees.
    CHECK(kvevict_test::compare_close(kvevict_ref::defensive_scores(attn, 4, 2, 4, 12, static_cast<int>(c.kernel),
                                                                    kvevict_test::ref_pool(c.pooling), c.floor),
                                      want, 1e-15, 1e-17) == "");
  }
  // Kernel 5, avg, without and with the floor (q3 dominates tokens 3 and 4 of KV head 1).
  const std::vector<double> k5 = {24. / 13, 60. / 23, 36. / 13, 36. / 13, 100. / 23, 100. / 23, 40. / 23, 40. / 23,
                                  16. / 3,  16. / 3,  16. / 3,  36. / 19, 48. / 19,  4. / 3,    4. / 3,   4. / 3};
  CHECK(kvevict_test::compare_close(aggregate(attn, kShape, 5, Pooling::avg, false), over32(k5), 1e-14, 1e-17) == "");
  std::vector<double> k5f = k5;
  const double mean0 = std::accumulate(k5.begin(), k5.begin() + 8, 0.0) / 8,
               mean1 = std::accumulate(k5.begin() + 8, k5.end(), 0.0) / 8;
  CHECK(mean0 == Approx(1657. / 598).epsilon(1e-14));
  CHECK(mean1 == Approx(58. / 19).epsilon(1e-14));
  for (int j = 0; j < 8; ++j) k5f[sz(j)] = std::max(k5f[sz(j)], mean0);
  for (int j = 8; j < 16; ++j) k5f[sz(j)] = std::max(k5f[sz(j)], mean1);
  CHECK(kvevict_test::compare_close(aggregate(attn, kShape, 5, Pooling::avg, true), over32(k5f), 1e-14, 1e-17) == "");
}

TEST_CASE("defensive aggregation matches the float64 reference on random layers", "[defensive_aggregation]") {
  Rng rng(501);
  const Shape shapes[] = {{1, 1, 1, 2, 16},   {2, 1, 4, 40, 16},  {8, 2, 32, 120, 16}, {8, 8, 4, 64, 64},
                          {4, 4, 32, 90, 16}, {8, 1, 4, 300, 16}, {2, 2, 4, 2000, 16}};
  const std::pair<int, Pooling> knobs[] = {{5, Pooling::avg}, {7, Pooling::max}, {1, Pooling::avg},
                                           {5, Pooling::max}, {7, Pooling::avg}, {1, Pooling::max}};
  int i = 0;
  for (const Shape& s : shapes) {
    const auto k = knobs[sz(i++) % 6];
    INFO(kvevict_test::describe(s) << " kernel=" << k.first << " " << kvevict::to_string(k.second));
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    const auto from_attn = kvevict_test::attention_inputs(attn, l.k, s);
    const auto from_q =
        kvevict_test::store<double>(l, i % 2 ? kvevict_test::Layout::heads_major : kvevict_test::Layout::tokens_major);
    const auto stf = kvevict_test::store<float>(l, kvevict_test::Layout::heads_major);
    for (bool floor : {true, false}) {
      INFO("floor " << floor);
      const std::vector<double> want =
          kvevict_ref::defensive_scores(attn, s.H, s.Hkv, s.w, s.L, k.first, kvevict_test::ref_pool(k.second), floor);
      CHECK(kvevict_test::compare_close(defensive_of<double>(from_attn, s.w, k.first, k.second, floor), want, 1e-12,
                                        1e-300) == "");
      CHECK(kvevict_test::compare_close(defensive_of<double>(from_q.in, s.w, k.first, k.second, floor), want, 1e-9,
                                        1e-300) == "");
      // Float storage, float arithmetic: softmax in float, relative to the row's scale.
      CHECK(kvevict_test::compare_close(defensive_of<float>(stf.in, s.w, k.first, k.second, floor), want, 1e-3, 1e-6) ==
            "");
    }
  }
}

TEST_CASE(
    "defensive aggregation: floor = max(no floor, head mean), group = max of its query heads, rows keep their "
    "prefix mass",
    "[defensive_aggregation]") {
  Rng rng(502);
  for (int t = 0; t < 12; ++t) {
    const Shape s = kvevict_test::random_shape(rng, 150);
    const int kernel = t % 3 == 0 ? 1 : (t % 3 == 1 ? 5 : 7);
    const Pooling pooling = t % 2 ? Pooling::max : Pooling::avg;
    INFO(kvevict_test::describe(s) << " kernel=" << kernel << " " << kvevict::to_string(pooling));
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    const std::vector<double> raw = aggregate(attn, s, kernel, pooling, false);
    const std::vector<double> floored = aggregate(attn, s, kernel, pooling, true);
    for (int h = 0; h < s.Hkv; ++h) {
      double sum = 0.0;
      for (int j = 0; j < s.P(); ++j) sum += raw[sz(h * s.P() + j)];
      const double mean = sum / s.P();
      for (int j = 0; j < s.P(); ++j) {
        const double x = raw[sz(h * s.P() + j)];
        CHECK(x >= 0.0);
        CHECK(floored[sz(h * s.P() + j)] == Approx(std::max(x, mean)).epsilon(1e-12).margin(1e-300));
        CHECK(floored[sz(h * s.P() + j)] >= x);
      }
    }
    // Group max: KV head h's M is the elementwise max of the M of each of its query heads taken alone (G = 1).
    Shape alone = s;
    alone.Hkv = s.H;
    const std::vector<double> per_head = aggregate(attn, alone, kernel, pooling, false);
    for (int h = 0; h < s.Hkv; ++h)
      for (int j = 0; j < s.P(); ++j) {
        double m = 0.0;
        for (int g = 0; g < s.G(); ++g) m = std::max(m, per_head[sz((h * s.G() + g) * s.P() + j)]);
        CHECK(raw[sz(h * s.P() + j)] == m);
      }
    // One query head, one row (w = 1): M without the floor is that row's R, whose sum is the row's prefix mass.
    Shape one{1, 1, 1, s.L, s.d};
    // Window row 0 of query head 0 sees keys 0 .. P: as a layer of its own, L = P + 1 with w = 1 leaves prefix P.
    const std::vector<double> row(attn.begin(), attn.begin() + s.P() + 1);
    one.L = s.P() + 1;
    double mass = 0.0;
    for (int j = 0; j < s.P(); ++j) mass += row[sz(j)];
    const std::vector<double> r = aggregate(row, one, kernel, pooling, false);
    CHECK(std::accumulate(r.begin(), r.end(), 0.0) == Approx(mass).epsilon(1e-12));
  }
}

TEST_CASE("defensive aggregation: a window row with no prefix mass contributes zeros, never NaN",
          "[defensive_aggregation]") {
  // H = Hkv = 1, w = 2, L = 6, P = 4: row 0 puts everything on the window, row 1 on token 2.
  const Shape s{1, 1, 2, 6, 1};
  const std::vector<double> attn = {0, 0, 0, 0, 1, 0, 0, 0, 0.5, 0, 0.25, 0.25};
  for (Pooling pooling : {Pooling::avg, Pooling::max}) {
    // Kernel 3 spreads token 2 over 1..3; renormalised to mass 0.5: [0, 1/6, 1/6, 1/6]. Floor at the mean 1/8.
    CHECK(kvevict_test::compare_close(aggregate(attn, s, 3, pooling, false), {0, 1. / 6, 1. / 6, 1. / 6}, 1e-15,
                                      1e-17) == "");
    CHECK(kvevict_test::compare_close(aggregate(attn, s, 3, pooling, true), {0.125, 1. / 6, 1. / 6, 1. / 6}, 1e-15,
                                      1e-17) == "");
  }
  // Every row without prefix mass: M is all zero (the floor of zeros is zero).
  const std::vector<double> none = {0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0.5, 0.5};
  CHECK(aggregate(none, s, 5, Pooling::avg, true) == std::vector<double>{0, 0, 0, 0});
}

}  // namespace test_defensive_aggregation
