// core/selection.hpp: the engine-facing output (indices + cu_seqlens offsets, lengths, mask, compact()).
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_selection {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Kept;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::sz;

namespace {

Selection random_selection(Rng& rng, Index heads, Index tokens, double p_keep) {
  std::bernoulli_distribution keep(p_keep);
  std::vector<std::uint8_t> flags(sz(heads * tokens));
  for (auto& f : flags) f = keep(rng) ? 1 : 0;
  return Selection::from_flags(flags, heads, tokens);
}

// Value stored at (head, token, col): unique, so that a misplaced row is detected.
double cell(Index h, Index j, Index c) { return static_cast<double>(h * 1000000 + j * 1000 + c); }

template <class T>
std::vector<T> filled(Index heads, Index tokens, Index dim, bool tokens_major) {
  std::vector<T> buf(sz(heads * tokens * dim));
  for (Index h = 0; h < heads; ++h)
    for (Index j = 0; j < tokens; ++j)
      for (Index c = 0; c < dim; ++c) {
        const Index at = tokens_major ? (j * heads + h) * dim + c : (h * tokens + j) * dim + c;
        buf[sz(at)] = static_cast<T>(cell(h, j, c));
      }
  return buf;
}

template <class T>
HeadsView<T> view(std::vector<T>& buf, Index heads, Index tokens, Index dim, bool tokens_major) {
  return tokens_major ? kvevict::kv_tokens_major<T>(buf.data(), tokens, heads, dim)
                      : kvevict::kv_heads_major<T>(buf.data(), heads, tokens, dim);
}

// Head h's rows [0, length(h)) of `dst` hold its kept tokens in order; rows beyond hold `untouched`.
template <class T>
std::string compact_errors(const Selection& sel, const HeadsView<const T>& dst, bool check_rest, T untouched) {
  for (Index h = 0; h < sel.heads(); ++h) {
    const auto kept = sel.head(h);
    for (Index r = 0; r < dst.rows(); ++r)
      for (Index c = 0; c < dst.cols(); ++c) {
        const T got = dst.row(h, r)[c];
        if (r < kept.size()) {
          if (got != static_cast<T>(cell(h, kept[r], c)))
            return "head " + std::to_string(h) + " row " + std::to_string(r) + " col " + std::to_string(c);
        } else if (check_rest && !(got == untouched || (got != got && untouched != untouched))) {
          return "head " + std::to_string(h) + " row " + std::to_string(r) + " beyond the kept rows was touched";
        }
      }
  }
  return {};
}

}  // namespace

TEST_CASE("Selection::from_flags: offsets, lengths, indices, kept, mask", "[selection]") {
  const std::vector<std::uint8_t> flags = {1, 0, 0, 1, 1,  //
                                           0, 0, 0, 0, 0,  //
                                           0, 1, 1, 1, 0};
  const Selection s = Selection::from_flags(flags, 3, 5);
  CHECK(s.heads() == 3);
  CHECK(s.context_length() == 5);
  CHECK(s.offsets() == std::vector<std::int64_t>{0, 3, 3, 6});
  CHECK(s.indices() == std::vector<std::int64_t>{0, 3, 4, 1, 2, 3});
  CHECK(s.lengths() == std::vector<std::int64_t>{3, 0, 3});
  CHECK(s.total() == 6);
  CHECK(s.max_length() == 3);
  CHECK(s.length(1) == 0);
  CHECK(s.head(1).size() == 0);
  CHECK(s.head(2)[0] == 1);
  CHECK(kvevict_test::kept_of(s) == Kept{{0, 3, 4}, {}, {1, 2, 3}});
  CHECK(s.kept(0, 3));
  CHECK_FALSE(s.kept(0, 2));
  CHECK_FALSE(s.kept(1, 0));
  const auto m = s.mask();
  REQUIRE(m.rows() == 3);
  REQUIRE(m.cols() == 5);
  for (Index h = 0; h < 3; ++h)
    for (Index j = 0; j < 5; ++j) CHECK(m(h, j) == (flags[sz(h * 5 + j)] != 0));
  // Any non-zero flag type works.
  const std::vector<int> ints = {0, 7, -1, 0};
  CHECK(kvevict_test::kept_of(Selection::from_flags(ints, 2, 2)) == Kept{{1}, {0}});
}

TEST_CASE("a default Selection is empty with offsets {0}", "[selection]") {
  const Selection s;
  CHECK(s.heads() == 0);
  CHECK(s.offsets() == std::vector<std::int64_t>{0});
  CHECK(s.indices().empty());
  CHECK(s.total() == 0);
  CHECK(s.max_length() == 0);
  CHECK(s.lengths().empty());
}

TEST_CASE("random selections: structure, mask and kept() agree with indices", "[selection]") {
  Rng rng(101);
  for (int t = 0; t < 40; ++t) {
    const Index heads = std::uniform_int_distribution<Index>(1, 8)(rng);
    const Index tokens = std::uniform_int_distribution<Index>(1, 300)(rng);
    const Selection s = random_selection(rng, heads, tokens, t % 4 == 0 ? 0.02 : 0.4);
    REQUIRE(kvevict_test::structure_errors(s, heads, tokens) == "");
    REQUIRE(kvevict_test::mask_errors(s) == "");
  }
}

TEST_CASE("selections of the policies have a sound structure and a matching mask", "[selection]") {
  Rng rng(102);
  const kvevict_test::Shape s{8, 4, 4, 90, 16};
  const auto st = kvevict_test::store<float>(kvevict_test::random_layer(s, rng), kvevict_test::Layout::heads_major);
  kvevict::AdaKV::Params p;
  p.window = s.w;
  const kvevict::AdaKV ada(p);
  kvevict::SnapKV::Params ps;
  ps.window = s.w;
  const kvevict::SnapKV snap(ps);
  for (std::int64_t n : {1, 3, 4, 5, 20, 89, 90}) {
    for (const Selection& sel :
         {ada.select(st.in, kvevict::Budget::tokens(n)), snap.select(st.in, kvevict::Budget::tokens(n)),
          kvevict::StreamingLLM().select(st.in, kvevict::Budget::tokens(n))}) {
      REQUIRE(kvevict_test::structure_errors(sel, s.Hkv, s.L) == "");
      REQUIRE(kvevict_test::mask_errors(sel) == "");
      CHECK(sel.offsets().size() == sz(s.Hkv) + 1);
      CHECK(sel.offsets()[0] == 0);
      CHECK(sel.total() == s.Hkv * n);
    }
  }
}

TEST_CASE("Selection head index out of range throws", "[selection][errors]") {
  const Selection s = Selection::from_flags(std::vector<std::uint8_t>(6, 1), 2, 3);
  REQUIRE_THROWS_MATCHES(s.length(2), kvevict::invalid_argument, MessageContains("head must be in [0, 2), got 2"));
  REQUIRE_THROWS_MATCHES(s.head(-1), kvevict::invalid_argument, MessageContains("head must be in [0, 2), got -1"));
  REQUIRE_THROWS_MATCHES(s.kept(5, 0), kvevict::invalid_argument, MessageContains("got 5"));
}

TEST_CASE("compact() into a separate buffer, both layouts, float and double", "[selection][compact]") {
  Rng rng(103);
  for (int t = 0; t < 24; ++t) {
    const Index H = std::uniform_int_distribution<Index>(1, 6)(rng);
    const Index L = std::uniform_int_distribution<Index>(1, 80)(rng);
    const Index d = std::uniform_int_distribution<Index>(1, 9)(rng);
    const bool src_tm = t % 2 == 1, dst_tm = (t / 2) % 2 == 1;
    const Selection sel = random_selection(rng, H, L, 0.3);
    INFO("H=" << H << " L=" << L << " d=" << d << " src tokens-major " << src_tm << " dst tokens-major " << dst_tm);
    const Index capacity = sel.max_length() + (t % 3);
    {
      std::vector<double> src = filled<double>(H, L, d, src_tm);
      std::vector<double> dst(sz(H * capacity * d), -1.0);
      const HeadsView<const double> in = view(src, H, L, d, src_tm);
      const HeadsView<double> out = view(dst, H, capacity, d, dst_tm);
      const std::vector<double> src_before = src;
      sel.compact(in, out);
      CHECK(src == src_before);  // the source is read only
      REQUIRE(compact_errors<double>(sel, out, true, -1.0) == "");
    }
    {
      std::vector<float> src = filled<float>(H, L, d, src_tm);
      std::vector<float> dst(sz(H * capacity * d), std::numeric_limits<float>::quiet_NaN());
      sel.compact(HeadsView<const float>(view(src, H, L, d, src_tm)), view(dst, H, capacity, d, dst_tm));
      REQUIRE(compact_errors<float>(sel, view(dst, H, capacity, d, dst_tm), true,
                                    std::numeric_limits<float>::quiet_NaN()) == "");
    }
  }
}

TEST_CASE("compact() in place over the same storage, both layouts", "[selection][compact]") {
  Rng rng(104);
  for (int t = 0; t < 30; ++t) {
    const Index H = std::uniform_int_distribution<Index>(1, 6)(rng);
    const Index L = std::uniform_int_distribution<Index>(1, 100)(rng);
    const Index d = std::uniform_int_distribution<Index>(1, 8)(rng);
    const bool tm = t % 2 == 1;
    const Selection sel = random_selection(rng, H, L, t % 5 == 0 ? 0.9 : 0.35);
    INFO("H=" << H << " L=" << L << " d=" << d << " tokens-major " << tm);
    std::vector<double> buf = filled<double>(H, L, d, tm);
    const HeadsView<double> v = view(buf, H, L, d, tm);
    sel.compact(HeadsView<const double>(v), v);
    REQUIRE(compact_errors<double>(sel, v, false, 0.0) == "");
  }
}

TEST_CASE("compact() of a policy's selection: keys and values of every KV head, in place", "[selection][compact]") {
  Rng rng(105);
  const kvevict_test::Shape s{8, 2, 4, 64, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  for (auto layout : {kvevict_test::Layout::heads_major, kvevict_test::Layout::tokens_major}) {
    auto st = kvevict_test::store<double>(l, layout, true);
    kvevict::AdaKV::Params p;
    p.window = s.w;
    const Selection sel = kvevict::AdaKV(p).select(st.in, kvevict::Budget::keep_ratio(0.25));
    const std::vector<double> k0 = st.k;
    const HeadsView<double> kv = layout == kvevict_test::Layout::heads_major
                                     ? kvevict::kv_heads_major<double>(st.k.data(), s.Hkv, s.L, s.d)
                                     : kvevict::kv_tokens_major<double>(st.k.data(), s.L, s.Hkv, s.d);
    sel.compact(HeadsView<const double>(kv), kv);
    const auto orig = layout == kvevict_test::Layout::heads_major
                          ? kvevict::kv_heads_major<const double>(k0.data(), s.Hkv, s.L, s.d)
                          : kvevict::kv_tokens_major<const double>(k0.data(), s.L, s.Hkv, s.d);
    for (Index h = 0; h < s.Hkv; ++h) {
      Index r = 0;
      for (auto j : sel.head(h)) {
        for (Index c = 0; c < s.d; ++c) REQUIRE(kv.row(h, r)[c] == orig.row(h, j)[c]);
        ++r;
      }
    }
  }
}

TEST_CASE("compact() errors: capacity, heads, tokens, head_dim", "[selection][compact][errors]") {
  const std::vector<std::uint8_t> flags = {1, 1, 1, 0, 0, 1, 0, 0};  // lengths 3 and 1
  const Selection sel = Selection::from_flags(flags, 2, 4);
  std::vector<float> src(2 * 4 * 3, 1.0f), dst(2 * 4 * 3, 0.0f);
  const auto in = kvevict::kv_heads_major<const float>(src.data(), 2, 4, 3);
  REQUIRE_THROWS_MATCHES(sel.compact(in, kvevict::kv_heads_major<float>(dst.data(), 2, 2, 3)),
                         kvevict::invalid_argument,
                         MessageContains("destination capacity (2 rows) must hold the longest head (3 rows)"));
  REQUIRE_THROWS_MATCHES(sel.compact(in, kvevict::kv_tokens_major<float>(dst.data(), 2, 2, 3)),
                         kvevict::invalid_argument, MessageContains("destination capacity (2 rows)"));
  REQUIRE_THROWS_MATCHES(sel.compact(kvevict::kv_heads_major<const float>(src.data(), 1, 4, 3),
                                     kvevict::kv_heads_major<float>(dst.data(), 2, 4, 3)),
                         kvevict::invalid_argument,
                         MessageContains("source heads (1) must equal the selection's KV heads (2)"));
  REQUIRE_THROWS_MATCHES(sel.compact(kvevict::kv_heads_major<const float>(src.data(), 2, 3, 3),
                                     kvevict::kv_heads_major<float>(dst.data(), 2, 4, 3)),
                         kvevict::invalid_argument,
                         MessageContains("source rows (3) must hold the selection's context length (4)"));
  REQUIRE_THROWS_MATCHES(sel.compact(in, kvevict::kv_heads_major<float>(dst.data(), 1, 4, 3)),
                         kvevict::invalid_argument,
                         MessageContains("destination heads (1) must equal the selection's KV heads (2)"));
  REQUIRE_THROWS_MATCHES(sel.compact(in, kvevict::kv_heads_major<float>(dst.data(), 2, 4, 2)),
                         kvevict::invalid_argument,
                         MessageContains("destination head_dim (2) must equal the source head_dim (3)"));
  CHECK(dst == std::vector<float>(24, 0.0f));  // checked before any write
  // Exactly the capacity of the longest head is enough.
  CHECK_NOTHROW(sel.compact(in, kvevict::kv_heads_major<float>(dst.data(), 2, 3, 3)));
  CHECK(dst[0] == 1.0f);
}

TEST_CASE("compact() with a zero-capacity destination for an empty selection", "[selection][compact]") {
  const Selection sel = Selection::from_flags(std::vector<std::uint8_t>(6, 0), 2, 3);
  std::vector<double> src(2 * 3 * 4, 1.0);
  std::vector<double> dst(1, 5.0);
  CHECK_NOTHROW(sel.compact(kvevict::kv_heads_major<const double>(src.data(), 2, 3, 4),
                            HeadsView<double>(dst.data(), 2, 0, 4, 0, 4)));
  CHECK(dst[0] == 5.0);
}

}  // namespace test_selection
