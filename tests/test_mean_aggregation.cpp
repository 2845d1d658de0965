// aggregation/mean.hpp: stage "aggregation" (docs/algorithms.md#aggregation: mean over window rows, pool, mean over the
// GQA group) against the reference.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <random>
#include <vector>

#include "support/random_inputs.hpp"

namespace test_mean_aggregation {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Pooling;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

kvevict_ref::Pool ref_pool(Pooling p) { return p == Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max; }

template <class S, class T>
std::vector<double> library_scores(const kvevict::LayerInputs<T>& in, Index w, Index kernel, Pooling p) {
  const kvevict::extend::LayerShape shape = kvevict::detail::validate_inputs(in, w, "test");
  const kvevict::extend::WindowObservation<S, T> obs(in, shape);
  const kvevict::RowMatrix<S> m = kvevict::extend::mean_scores(obs, kernel, p);
  REQUIRE(m.rows() == shape.kv_heads);
  REQUIRE(m.cols() == shape.prefix);
  std::vector<double> out(sz(m.size()));
  for (Index h = 0; h < m.rows(); ++h)
    for (Index j = 0; j < m.cols(); ++j) out[sz(h * m.cols() + j)] = static_cast<double>(m(h, j));
  return out;
}

std::vector<Shape> shapes(Rng& rng, int n_random) {
  std::vector<Shape> out = {{1, 1, 1, 2, 16},    {2, 2, 1, 3, 16},   {8, 2, 4, 9, 64},    {8, 8, 32, 33, 16},
                            {4, 1, 32, 90, 128}, {8, 4, 4, 12, 128}, {2, 1, 4, 3000, 16}, {1, 1, 32, 1200, 16}};
  for (int i = 0; i < n_random; ++i) out.push_back(kvevict_test::random_shape(rng, 200));
  return out;
}

}  // namespace

TEST_CASE("mean_scores from queries matches the reference (double and float arithmetic)", "[mean_aggregation]") {
  Rng rng(51);
  int turn = 0;
  for (const Shape& s : shapes(rng, 16)) {
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    // Float-rounded inputs so that the float run and the reference see the same numbers.
    kvevict_test::Layer lf = l;
    lf.q = kvevict_test::to_double(kvevict_test::cast_to<float>(l.q));
    lf.k = kvevict_test::to_double(kvevict_test::cast_to<float>(l.k));
    const std::vector<double> attn = kvevict_ref::window_attention(lf.q, lf.k, s.H, s.Hkv, s.w, s.L, s.d);
    const Layout layout = s.L % 2 ? Layout::heads_major : Layout::tokens_major;
    const auto st_d = kvevict_test::store<double>(lf, layout);
    const auto st_f = kvevict_test::store<float>(lf, layout);
    ++turn;
    for (int kernel : {1, 5, 7}) {
      // Both poolings for every kernel across the sweep, one per (shape, kernel) to keep Debug runs short.
      const Pooling p = (turn + kernel) % 2 ? Pooling::max : Pooling::avg;
      {
        INFO(kvevict_test::describe(s) << " kernel=" << kernel << " " << kvevict::to_string(p));
        const std::vector<double> want = kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, kernel, ref_pool(p));
        REQUIRE(kvevict_test::compare_close(library_scores<double>(st_d.in, s.w, kernel, p), want, 1e-11, 1e-18) == "");
        REQUIRE(kvevict_test::compare_close(library_scores<float>(st_f.in, s.w, kernel, p), want, 2e-5, 1e-10) == "");
        REQUIRE(kvevict_test::compare_close(library_scores<double>(st_f.in, s.w, kernel, p), want, 1e-11, 1e-18) == "");
      }
    }
  }
}

TEST_CASE("mean_scores from precomputed attention rows matches the reference on the same rows", "[mean_aggregation]") {
  Rng rng(52);
  for (const Shape& s : shapes(rng, 12)) {
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    const auto in = kvevict_test::attention_inputs(attn, l.k, s);
    for (int kernel : {1, 5, 7})
      for (Pooling p : {Pooling::avg, Pooling::max}) {
        INFO(kvevict_test::describe(s) << " kernel=" << kernel << " " << kvevict::to_string(p));
        const std::vector<double> want = kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, kernel, ref_pool(p));
        REQUIRE(kvevict_test::compare_close(library_scores<double>(in, s.w, kernel, p), want, 1e-13, 1e-20) == "");
      }
  }
}

TEST_CASE("mean_scores on quantised attention is bitwise equal to the reference (exact ties preserved)",
          "[mean_aggregation]") {
  Rng rng(53);
  for (int t = 0; t < 20; ++t) {
    const Shape s = kvevict_test::random_shape(rng, 120);
    const std::vector<double> attn = kvevict_test::quantised_scores(sz(s.H * s.w * s.L), 4, rng);
    const std::vector<double> keys(sz(s.Hkv * s.L * s.d), 0.0);
    const auto in = kvevict_test::attention_inputs(attn, keys, s);
    for (int kernel : {1, 5, 7})
      for (Pooling p : {Pooling::avg, Pooling::max}) {
        INFO(kvevict_test::describe(s) << " kernel=" << kernel << " " << kvevict::to_string(p));
        REQUIRE(library_scores<double>(in, s.w, kernel, p) ==
                kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, kernel, ref_pool(p)));
      }
  }
}

TEST_CASE("mean_scores: order of operations is mean, then pool, then group mean", "[mean_aggregation]") {
  // H = 2, Hkv = 1, w = 2, L = 5 (P = 3), max pooling with kernel 3 distinguishes the orders.
  const Shape s{2, 1, 2, 5, 16};
  // Rows of head 0: [1, 0, 0 | ...], [0, 0, 1 | ...]; head 1: [0, 1, 0], [0, 1, 0] (window columns arbitrary).
  const std::vector<double> attn = {1, 0, 0, 7, 0,  //
                                    0, 0, 1, 7, 7,  //
                                    0, 1, 0, 7, 0,  //
                                    0, 1, 0, 7, 7};
  const std::vector<double> keys(sz(s.L * s.d), 0.0);
  const auto in = kvevict_test::attention_inputs(attn, keys, s);
  // Head 0: row mean (0.5, 0, 0.5) -> max3 (0.5, 0.5, 0.5); head 1: (0, 1, 0) -> (1, 1, 1). Group mean 0.75.
  CHECK(library_scores<double>(in, s.w, 3, Pooling::max) == std::vector<double>{0.75, 0.75, 0.75});
  // avg3: head 0 (0.5/3, 1/3, 0.5/3); head 1 (1/3, 1/3, 1/3); mean (0.25, 1/3, 0.25).
  const std::vector<double> got = library_scores<double>(in, s.w, 3, Pooling::avg);
  CHECK(got[0] == Approx(0.25).epsilon(1e-15));
  CHECK(got[1] == Approx(1.0 / 3.0).epsilon(1e-15));
  CHECK(got[2] == Approx(0.25).epsilon(1e-15));
  // Kernel 1: plain mean over rows and the group; window columns never enter.
  CHECK(library_scores<double>(in, s.w, 1, Pooling::avg) == std::vector<double>{0.25, 0.5, 0.25});
}

TEST_CASE("mean_scores with kernel 1: each head's scores sum to the mean prefix mass of its group",
          "[mean_aggregation]") {
  Rng rng(54);
  const Shape s{8, 2, 4, 50, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto st = kvevict_test::store<double>(l, Layout::heads_major);
  const std::vector<double> scores = library_scores<double>(st.in, s.w, 1, Pooling::avg);
  const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
  for (int h = 0; h < s.Hkv; ++h) {
    double total = 0.0, mass = 0.0;
    for (int j = 0; j < s.P(); ++j) total += scores[sz(h * s.P() + j)];
    for (int q = h * s.G(); q < (h + 1) * s.G(); ++q)
      for (int i = 0; i < s.w; ++i)
        for (int j = 0; j < s.P(); ++j) mass += attn[sz((q * s.w + i) * s.L + j)];
    CHECK(total == Approx(mass / (s.G() * s.w)).epsilon(1e-12));
  }
}

}  // namespace test_mean_aggregation
