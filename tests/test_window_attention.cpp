// observation/window_attention.hpp: stage "window attention" (docs/algorithms.md#window-attention) against the
// float64 reference.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <cmath>
#include <vector>

#include "support/random_inputs.hpp"

namespace test_window_attention {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

// Random shapes of the sweep plus a few large contexts (kept small in H, w, d: Eigen in Debug is slow).
std::vector<Shape> attention_shapes(Rng& rng, int n_random) {
  std::vector<Shape> shapes = {{1, 1, 1, 2, 16},    {2, 1, 1, 2, 16},    {4, 4, 4, 5, 64},  {8, 2, 32, 33, 16},
                               {8, 8, 1, 3, 128},   {4, 2, 32, 40, 128}, {8, 1, 4, 17, 64}, {2, 2, 1, 1500, 16},
                               {4, 1, 4, 5000, 16}, {1, 1, 32, 2048, 16}};
  for (int i = 0; i < n_random; ++i) shapes.push_back(kvevict_test::random_shape(rng, 200));
  return shapes;
}

// Checks structural properties of full softmax rows [H, w, L]: masked entries exactly 0, rows sum to 1.
void check_rows(const std::vector<double>& attn, const Shape& s, double tol) {
  for (int q = 0; q < s.H; ++q)
    for (int i = 0; i < s.w; ++i) {
      const double* row = &attn[(sz(q) * sz(s.w) + sz(i)) * sz(s.L)];
      double sum = 0.0;
      bool masked_zero = true, non_negative = true;
      for (int j = 0; j < s.L; ++j) {
        sum += row[j];
        if (j > s.P() + i && row[j] != 0.0) masked_zero = false;
        if (!(row[j] >= 0.0)) non_negative = false;
      }
      INFO("query head " << q << ", window row " << i);
      CHECK(masked_zero);
      CHECK(non_negative);
      CHECK(std::fabs(sum - 1.0) <= tol);
    }
}

}  // namespace

TEST_CASE("window_attention<double> matches the float64 reference (both KV layouts)", "[window_attention]") {
  Rng rng(31);
  for (const Shape& s : attention_shapes(rng, 24)) {
    INFO(kvevict_test::describe(s));
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const std::vector<double> want = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    for (Layout layout : {Layout::heads_major, Layout::tokens_major}) {
      const auto st = kvevict_test::store<double>(l, layout);
      const std::vector<double> got = kvevict_test::library_attention<double, double>(st.in.queries, st.in.keys);
      REQUIRE(kvevict_test::compare_close(got, want, 1e-12, 1e-15) == "");
      check_rows(got, s, 1e-12);
    }
  }
}

TEST_CASE("window_attention<float> over float storage matches the reference to float precision", "[window_attention]") {
  Rng rng(32);
  for (const Shape& s : attention_shapes(rng, 24)) {
    INFO(kvevict_test::describe(s));
    kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    // The reference sees exactly the float-rounded inputs.
    l.q = kvevict_test::to_double(kvevict_test::cast_to<float>(l.q));
    l.k = kvevict_test::to_double(kvevict_test::cast_to<float>(l.k));
    const std::vector<double> want = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    for (Layout layout : {Layout::heads_major, Layout::tokens_major}) {
      const auto st = kvevict_test::store<float>(l, layout);
      const std::vector<double> got =
          kvevict_test::to_double(kvevict_test::library_attention<float, float>(st.in.queries, st.in.keys));
      REQUIRE(kvevict_test::compare_close(got, want, 1e-5, 1e-9) == "");
      check_rows(got, s, 1e-5);
      // Float storage computed in double is as exact as the reference.
      const std::vector<double> wide = kvevict_test::library_attention<double, float>(st.in.queries, st.in.keys);
      REQUIRE(kvevict_test::compare_close(wide, want, 1e-12, 1e-15) == "");
    }
  }
}

TEST_CASE("window_attention is numerically stable for large logits", "[window_attention]") {
  Rng rng(33);
  for (const Shape& s : {Shape{2, 1, 4, 50, 64}, Shape{4, 2, 32, 64, 16}}) {
    INFO(kvevict_test::describe(s));
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng, /*query_scale=*/200.0);  // logits ~ +-2000
    const std::vector<double> want = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    const auto st = kvevict_test::store<float>(l, Layout::tokens_major);
    const std::vector<double> got =
        kvevict_test::to_double(kvevict_test::library_attention<float, float>(st.in.queries, st.in.keys));
    check_rows(got, s, 1e-5);
    for (double v : got) REQUIRE(std::isfinite(v));
    // Rounding the queries to float moves logits by ~1e-4 here: only the row maxima are comparable; they agree.
    const auto std_ = kvevict_test::store<double>(l, Layout::heads_major);
    const std::vector<double> got_d = kvevict_test::library_attention<double, double>(std_.in.queries, std_.in.keys);
    REQUIRE(kvevict_test::compare_close(got_d, want, 1e-9, 1e-12) == "");
  }
}

TEST_CASE("window row i sees exactly keys 0 .. P + i (causal mask inside the window)", "[window_attention]") {
  // All-zero queries: every visible key gets the same weight 1 / (P + i + 1).
  const Shape s{2, 1, 4, 10, 16};
  std::vector<double> q(sz(s.H * s.w * s.d), 0.0), k(sz(s.Hkv * s.L * s.d), 1.0);
  const auto queries = kvevict::HeadsView<const double>::heads_major(q.data(), s.H, s.w, s.d);
  const auto keys = kvevict::kv_heads_major<const double>(k.data(), s.Hkv, s.L, s.d);
  kvevict::RowMatrix<double> rows;
  kvevict::extend::window_attention<double, double>(queries, keys, 1, 2, rows);
  REQUIRE(rows.rows() == s.w);
  REQUIRE(rows.cols() == s.L);
  for (Index i = 0; i < s.w; ++i)
    for (Index j = 0; j < s.L; ++j) {
      const double want = j <= s.P() + i ? 1.0 / static_cast<double>(s.P() + i + 1) : 0.0;
      CHECK(rows(i, j) == Approx(want).epsilon(1e-15).margin(0.0));
    }
}

TEST_CASE("window_attention divides the logits by sqrt(head_dim)", "[window_attention]") {
  // One query, two keys: logits (q.k0, q.k1) / sqrt(d), here (4, 0) / 2 -> softmax (e^2, 1) / (e^2 + 1).
  const Index d = 4, L = 2, w = 1;
  std::vector<double> q = {1, 1, 1, 1};
  std::vector<double> k = {1, 1, 1, 1, 0, 0, 0, 0};
  kvevict::RowMatrix<double> rows;
  kvevict::extend::window_attention<double, double>(kvevict::HeadsView<const double>::heads_major(q.data(), 1, w, d),
                                                    kvevict::kv_heads_major<const double>(k.data(), 1, L, d), 0, 1,
                                                    rows);
  const double e2 = std::exp(2.0);
  CHECK(rows(0, 0) == Approx(e2 / (e2 + 1.0)).epsilon(1e-14));
  CHECK(rows(0, 1) == Approx(1.0 / (e2 + 1.0)).epsilon(1e-14));
}

TEST_CASE("GQA: query head q reads KV head q / G", "[window_attention]") {
  Rng rng(34);
  const Shape s{8, 2, 4, 30, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto st = kvevict_test::store<double>(l, Layout::heads_major);
  // Single-KV-head layers made of KV head h only: query head q of group h must give the same rows.
  for (int h = 0; h < s.Hkv; ++h) {
    const auto kh = kvevict::kv_heads_major<const double>(st.k.data() + h * s.L * s.d, 1, s.L, s.d);
    for (int q = h * s.G(); q < (h + 1) * s.G(); ++q) {
      kvevict::RowMatrix<double> grouped, single;
      kvevict::extend::window_attention<double, double>(st.in.queries, st.in.keys, q, s.G(), grouped);
      kvevict::extend::window_attention<double, double>(st.in.queries, kh, q, s.H, single);  // group H: all read head 0
      CHECK(grouped == single);
    }
  }
}

TEST_CASE("WindowObservation: queries route computes rows, attention route passes them through", "[window_attention]") {
  Rng rng(35);
  for (const Shape& s : {Shape{4, 2, 4, 20, 16}, Shape{8, 1, 32, 70, 64}, Shape{1, 1, 1, 2, 16}}) {
    INFO(kvevict_test::describe(s));
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const auto st = kvevict_test::store<double>(l, Layout::tokens_major);
    const kvevict::extend::LayerShape shape = kvevict::detail::validate_inputs(st.in, s.w, "select");
    const kvevict::extend::WindowObservation<double, double> from_q(st.in, shape);
    CHECK(from_q.shape().query_heads == s.H);
    const std::vector<double> attn = kvevict_test::library_attention<double, double>(st.in.queries, st.in.keys);
    const auto in_a = kvevict_test::attention_inputs(attn, st.k, s);
    // attention_inputs views the keys heads-major; the keys storage here is tokens-major but only the shape is
    // read on the attention route.
    const kvevict::extend::LayerShape shape_a = kvevict::detail::validate_inputs(in_a, s.w, "select");
    const kvevict::extend::WindowObservation<double, double> from_a(in_a, shape_a);
    Index expected = 0;
    from_q.for_each_head([&](Index q, const kvevict::RowMatrix<double>& rows) {
      CHECK(q == expected++);
      kvevict::RowMatrix<double> direct, passed;
      kvevict::extend::window_attention<double, double>(st.in.queries, st.in.keys, q, s.G(), direct);
      CHECK(rows == direct);
      from_a.head_rows(q, passed);
      CHECK(passed == direct);  // exact copy of the caller's rows
    });
    CHECK(expected == s.H);
    // Float storage of the attention, double arithmetic: exact widening.
    const std::vector<float> attn_f = kvevict_test::cast_to<float>(attn);
    const std::vector<float> keys_f = kvevict_test::cast_to<float>(st.k);
    const auto in_f = kvevict_test::attention_inputs(attn_f, keys_f, s);
    const kvevict::extend::WindowObservation<double, float> from_f(in_f,
                                                                   kvevict::detail::validate_inputs(in_f, s.w, "x"));
    kvevict::RowMatrix<double> rows_f;
    from_f.head_rows(s.H - 1, rows_f);
    for (Index i = 0; i < s.w; ++i)
      for (Index j = 0; j < s.L; ++j)
        CHECK(rows_f(i, j) == static_cast<double>(attn_f[sz(((s.H - 1) * s.w + i) * s.L + j)]));
  }
}

}  // namespace test_window_attention
