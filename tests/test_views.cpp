// core/views.hpp and core/inputs.hpp: zero-copy strided views over both KV layouts.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_views {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::HeadsView;
using kvevict::Index;
using kvevict_test::MessageContains;
using kvevict_test::sz;

namespace {

std::vector<double> iota_vector(std::size_t n) {
  std::vector<double> x(n);
  std::iota(x.begin(), x.end(), 0.0);
  return x;
}

}  // namespace

TEST_CASE("heads_major view: extents, strides, rows and head maps address the caller's storage", "[views]") {
  const Index H = 3, R = 5, C = 4;
  std::vector<double> buf = iota_vector(sz(H * R * C));
  const auto v = HeadsView<const double>::heads_major(buf.data(), H, R, C);
  CHECK(v.data() == buf.data());
  CHECK(v.heads() == H);
  CHECK(v.rows() == R);
  CHECK(v.cols() == C);
  CHECK(v.head_stride() == R * C);
  CHECK(v.row_stride() == C);
  for (Index h = 0; h < H; ++h) {
    const auto m = v.head(h);
    REQUIRE(m.rows() == R);
    REQUIRE(m.cols() == C);
    CHECK(m.data() == buf.data() + h * R * C);  // a map into the buffer, not a copy
    for (Index r = 0; r < R; ++r) {
      CHECK(v.row(h, r) == buf.data() + (h * R + r) * C);
      for (Index c = 0; c < C; ++c) CHECK(m(r, c) == buf[sz((h * R + r) * C + c)]);
    }
  }
}

TEST_CASE("rows_major view (rows x heads x cols, llama.cpp / vLLM) addresses the transposed storage", "[views]") {
  const Index H = 3, R = 5, C = 4;
  std::vector<double> buf = iota_vector(sz(H * R * C));  // [R, H, C]
  const auto v = HeadsView<const double>::rows_major(buf.data(), R, H, C);
  CHECK(v.data() == buf.data());
  CHECK(v.heads() == H);
  CHECK(v.rows() == R);
  CHECK(v.cols() == C);
  CHECK(v.head_stride() == C);
  CHECK(v.row_stride() == H * C);
  for (Index h = 0; h < H; ++h) {
    const auto m = v.head(h);
    CHECK(m.data() == buf.data() + h * C);
    CHECK(m.outerStride() == H * C);
    for (Index r = 0; r < R; ++r) {
      CHECK(v.row(h, r) == buf.data() + (r * H + h) * C);
      for (Index c = 0; c < C; ++c) CHECK(m(r, c) == buf[sz((r * H + h) * C + c)]);
    }
  }
}

TEST_CASE("kv_heads_major and kv_tokens_major see the same tensor over transposed storage", "[views]") {
  kvevict_test::Rng rng(11);
  const int Hkv = 4, L = 9, d = 16;
  const std::vector<float> hm = kvevict_test::cast_to<float>(kvevict_test::normal_vector(sz(Hkv * L * d), rng));
  const std::vector<float> tm = kvevict_test::to_tokens_major(hm, Hkv, L, d);
  const auto a = kvevict::kv_heads_major<const float>(hm.data(), Hkv, L, d);
  const auto b = kvevict::kv_tokens_major<const float>(tm.data(), L, Hkv, d);
  CHECK(a.data() == hm.data());
  CHECK(b.data() == tm.data());
  REQUIRE(a.heads() == b.heads());
  REQUIRE(a.rows() == b.rows());
  REQUIRE(a.cols() == b.cols());
  for (Index h = 0; h < Hkv; ++h) {
    CHECK(a.head(h) == b.head(h));
    CHECK(b.head(h).data() >= tm.data());
    CHECK(b.head(h).data() < tm.data() + tm.size());
  }
}

TEST_CASE("a writable view writes through to the caller's buffer and converts to a const view", "[views]") {
  std::vector<float> buf(2 * 3 * 4, 0.0f);
  const auto v = HeadsView<float>::rows_major(buf.data(), 3, 2, 4);
  v.row(1, 2)[3] = 7.0f;
  CHECK(buf[sz((2 * 2 + 1) * 4 + 3)] == 7.0f);
  v.head(0)(1, 0) = 5.0f;
  CHECK(buf[sz((1 * 2 + 0) * 4 + 0)] == 5.0f);
  const HeadsView<const float> c = v;
  CHECK(c.data() == buf.data());
  CHECK(c.heads() == v.heads());
  CHECK(c.rows() == v.rows());
  CHECK(c.cols() == v.cols());
  CHECK(c.head_stride() == v.head_stride());
  CHECK(c.row_stride() == v.row_stride());
}

TEST_CASE("general strides: a padded sub-block of a larger buffer", "[views]") {
  // [heads = 2, rows = 3, cols = 4] inside rows of 6 with 2 padding columns, heads 20 apart.
  std::vector<double> buf = iota_vector(40);
  const HeadsView<const double> v(buf.data() + 1, 2, 3, 4, 20, 6);
  for (Index h = 0; h < 2; ++h)
    for (Index r = 0; r < 3; ++r)
      for (Index c = 0; c < 4; ++c) CHECK(v.head(h)(r, c) == buf[sz(1 + h * 20 + r * 6 + c)]);
}

TEST_CASE("an empty default view has no data and zero extents", "[views]") {
  const HeadsView<const float> v;
  CHECK(v.data() == nullptr);
  CHECK(v.heads() == 0);
  CHECK(v.rows() == 0);
  CHECK(v.cols() == 0);
}

TEST_CASE("HeadsView rejects bad extents, strides and null data", "[views][errors]") {
  std::vector<double> buf(64);
  REQUIRE_THROWS_MATCHES(HeadsView<const double>(buf.data(), -1, 2, 2, 4, 2), kvevict::invalid_argument,
                         MessageContains("extents must be non-negative, got [-1, 2, 2]"));
  REQUIRE_THROWS_MATCHES(HeadsView<const double>(nullptr, 1, 2, 2, 4, 2), kvevict::invalid_argument,
                         MessageContains("data must not be null"));
  REQUIRE_THROWS_MATCHES(HeadsView<const double>(buf.data(), 1, 2, 4, 8, 3), kvevict::invalid_argument,
                         MessageContains("row_stride (3) must be >= cols (4)"));
  REQUIRE_THROWS_MATCHES(HeadsView<const double>(buf.data(), 1, 2, 4, -8, 4), kvevict::invalid_argument,
                         MessageContains("head_stride (-8) >= 0"));
  CHECK_NOTHROW(HeadsView<const double>(nullptr, 0, 5, 5, 0, 5));  // empty views may be null
}

TEST_CASE("LayerInputs holds views of the caller's buffers, never copies", "[views][inputs]") {
  kvevict_test::Rng rng(12);
  const kvevict_test::Shape s{8, 2, 4, 40, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  for (auto layout : {kvevict_test::Layout::heads_major, kvevict_test::Layout::tokens_major}) {
    const auto st = kvevict_test::store<float>(l, layout, /*with_values=*/true);
    CHECK(st.in.queries.data() == st.q.data());
    CHECK(st.in.keys.data() == st.k.data());
    CHECK(st.in.values.data() == st.v.data());
    for (Index h = 0; h < s.Hkv; ++h) {
      const float* p = st.in.keys.head(h).data();
      CHECK(p >= st.k.data());
      CHECK(p < st.k.data() + st.k.size());
      CHECK(st.in.values.head(h).data() ==
            st.v.data() + (layout == kvevict_test::Layout::heads_major ? h * s.L * s.d : h * s.d));
    }
    for (Index q = 0; q < s.H; ++q) CHECK(st.in.queries.head(q).data() == st.q.data() + q * s.w * s.d);
    // A copy of LayerInputs still points at the same buffers.
    const kvevict::LayerInputs<float> copy = st.in;
    CHECK(copy.keys.data() == st.k.data());
    CHECK(copy.queries.data() == st.q.data());
  }
}

TEST_CASE("validate_inputs derives the layer shape", "[inputs]") {
  kvevict_test::Rng rng(13);
  const kvevict_test::Shape s{8, 2, 4, 40, 16};
  const auto st = kvevict_test::store<double>(kvevict_test::random_layer(s, rng), kvevict_test::Layout::tokens_major);
  const kvevict::extend::LayerShape shape = kvevict::detail::validate_inputs(st.in, s.w, "select");
  CHECK(shape.query_heads == 8);
  CHECK(shape.kv_heads == 2);
  CHECK(shape.group == 4);
  CHECK(shape.tokens == 40);
  CHECK(shape.window == 4);
  CHECK(shape.prefix == 36);
  CHECK(shape.head_dim == 16);
}

TEST_CASE("selection over padded strided views equals the selection over dense storage (padding never read)",
          "[views][policies]") {
  kvevict_test::Rng rng(14);
  const kvevict_test::Shape s{4, 2, 4, 60, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto dense = kvevict_test::store<double>(l, kvevict_test::Layout::heads_major);
  // Keys tokens-major with 3 padding columns per row filled with NaN, queries with padding rows too.
  const Index pad = 3, ks = s.Hkv * (s.d + pad);
  std::vector<double> keys(sz(s.L * ks), std::numeric_limits<double>::quiet_NaN());
  for (int h = 0; h < s.Hkv; ++h)
    for (int j = 0; j < s.L; ++j)
      for (int c = 0; c < s.d; ++c) keys[sz(j * ks + h * (s.d + pad) + c)] = l.k[sz((h * s.L + j) * s.d + c)];
  const Index qs = s.d + pad;
  std::vector<double> queries(sz(s.H * s.w * qs), std::numeric_limits<double>::infinity());
  for (int q = 0; q < s.H; ++q)
    for (int i = 0; i < s.w; ++i)
      for (int c = 0; c < s.d; ++c) queries[sz((q * s.w + i) * qs + c)] = l.q[sz((q * s.w + i) * s.d + c)];
  kvevict::LayerInputs<double> padded;
  padded.keys = kvevict::KVView<const double>(keys.data(), s.Hkv, s.L, s.d, s.d + pad, ks);
  padded.queries = HeadsView<const double>(queries.data(), s.H, s.w, s.d, s.w * qs, qs);
  kvevict::SnapKV::Params p;
  p.window = s.w;
  const kvevict::SnapKV snap(p);
  kvevict::AdaKV::Params pa;
  pa.window = s.w;
  const kvevict::AdaKV ada(pa);
  for (std::int64_t n : {1, 3, 4, 5, 17, 60}) {
    const auto b = kvevict::Budget::tokens(n);
    CHECK(kvevict_test::kept_of(snap.select<double>(padded, b)) ==
          kvevict_test::kept_of(snap.select<double>(dense.in, b)));
    CHECK(kvevict_test::kept_of(ada.select<double>(padded, b)) ==
          kvevict_test::kept_of(ada.select<double>(dense.in, b)));
  }
}

TEST_CASE("last_rows: the last n rows of every head, no copy, in both layouts", "[views]") {
  std::vector<float> buf(2 * 5 * 3);
  std::iota(buf.begin(), buf.end(), 0.0f);
  for (const auto& v : {kvevict::HeadsView<const float>::heads_major(buf.data(), 2, 5, 3),
                        kvevict::HeadsView<const float>::rows_major(buf.data(), 5, 2, 3)}) {
    const auto last = kvevict::last_rows(v, 2);
    CHECK(last.heads() == 2);
    CHECK(last.rows() == 2);
    CHECK(last.cols() == 3);
    for (kvevict::Index h = 0; h < 2; ++h)
      for (kvevict::Index r = 0; r < 2; ++r) CHECK(last.row(h, r) == v.row(h, 3 + r));
    CHECK(kvevict::last_rows(v, 5).row(1, 0) == v.row(1, 0));
    CHECK(kvevict::last_rows(v, 0).rows() == 0);
    REQUIRE_THROWS_WITH(kvevict::last_rows(v, 6),
                        Catch::Contains("last_rows: n must be in [0, 5] (the view's rows), got 6"));
    REQUIRE_THROWS_WITH(kvevict::last_rows(v, -1), Catch::Contains("got -1"));
  }
}

}  // namespace test_views
