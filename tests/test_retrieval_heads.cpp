// Retrieval heads (docs/algorithms.md#retrieval-heads): induction_scores against independent double loops and on a
// constructed induction head, top_heads, the forced tier on a worked layer, and the errors. The rule under every
// policy and layout is checked against the float64 layout reference in test_layout_reference.cpp.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_retrieval_heads {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::LayerInputs;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::sz;

namespace {

// Independent double loops: s_q = mean over the w window rows of the causal softmax at key t - P + 1, then the max
// over each KV head's G query heads.
std::vector<double> direct_induction(const std::vector<double>& q, const std::vector<double>& k, int H, int Hkv, int w,
                                     int L, int d, int P) {
  std::vector<double> out(sz(Hkv), 0.0);
  for (int h = 0; h < H; ++h) {
    const int kv = h / (H / Hkv);
    double s = 0;
    for (int i = 0; i < w; ++i) {
      const int t = L - w + i;
      std::vector<double> a(sz(t + 1));
      double m = -HUGE_VAL, z = 0;
      for (int j = 0; j <= t; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += q[sz((h * w + i) * d + c)] * k[sz((kv * L + j) * d + c)];
        a[sz(j)] = dot / std::sqrt(static_cast<double>(d));
        m = std::max(m, a[sz(j)]);
      }
      for (double& x : a) z += (x = std::exp(x - m));
      s += a[sz(t - P + 1)] / z;
    }
    out[sz(kv)] = std::max(out[sz(kv)], s / w);
  }
  return out;
}

}  // namespace

TEST_CASE("induction_scores: independent double loops on random layers, queries or attention rows",
          "[retrieval][measure]") {
  Rng rng(886);
  for (int trial = 0; trial < 6; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + trial % 2, H = Hkv * G, w = 1 + trial % 4, d = 4 + 2 * trial;
    const int P = 5 + trial, L = w + P + trial % 3;
    const std::vector<double> q = kvevict_test::normal_vector(sz(H * w * d), rng, 2.0);
    const std::vector<double> k = kvevict_test::normal_vector(sz(Hkv * L * d), rng);
    LayerInputs<double> in;
    in.queries = HeadsView<const double>::heads_major(q.data(), H, w, d);
    in.keys = kvevict::kv_heads_major<const double>(k.data(), Hkv, L, d);
    const std::vector<double> want = direct_induction(q, k, H, Hkv, w, L, d, P);
    const std::vector<double> got = kvevict::induction_scores<double>(in, P);
    REQUIRE(got.size() == want.size());
    for (std::size_t h = 0; h < want.size(); ++h) CHECK(got[h] == Approx(want[h]).epsilon(1e-12).margin(1e-15));
    // The engine's attention rows instead of the queries: the same scores.
    std::vector<double> rows(sz(H * w * L), 0.0);
    for (int h = 0; h < H; ++h) {
      kvevict::RowMatrix<double> r;
      kvevict::extend::window_attention<double, double, double>(in.queries, in.keys, h, G, r);
      for (int i = 0; i < w; ++i)
        for (int j = 0; j < L; ++j) rows[sz((h * w + i) * L + j)] = r(i, j);
    }
    LayerInputs<double> eager;
    eager.attention = HeadsView<const double>::heads_major(rows.data(), H, w, L);
    eager.keys = in.keys;
    const std::vector<double> from_rows = kvevict::induction_scores<double>(eager, P);
    for (std::size_t h = 0; h < want.size(); ++h) CHECK(from_rows[h] == Approx(want[h]).epsilon(1e-12).margin(1e-15));
  }
}

TEST_CASE("induction_scores: a constructed induction head scores near 1, a same-token head near 0, and top_heads",
          "[retrieval][measure]") {
  // Tokens: a permutation of 8 symbols, repeated (P = 8, L = 16), d = 8 one-hot dimensions scaled by 8. KV head 0's
  // key at j encodes the token before it (a previous-token head's output), so the query of token x finds the entry
  // after the last x: the induction target t - P + 1. KV head 1's key encodes the token itself: its query finds
  // t - P and t, never t - P + 1.
  const int P = 8, L = 2 * P, d = 8, w = 4, Hkv = 2;
  const int perm[P] = {3, 0, 6, 1, 7, 4, 2, 5};
  const auto token = [&](int j) { return perm[j % P]; };
  std::vector<double> k(sz(Hkv * L * d), 0.0), q(sz(Hkv * w * d), 0.0);
  for (int j = 0; j < L; ++j) {
    if (j > 0) k[sz((0 * L + j) * d + token(j - 1))] = 8.0;
    k[sz((1 * L + j) * d + token(j))] = 8.0;
  }
  for (int h = 0; h < Hkv; ++h)
    for (int i = 0; i < w; ++i) q[sz((h * w + i) * d + token(L - w + i))] = 8.0;
  LayerInputs<double> in;
  in.queries = HeadsView<const double>::heads_major(q.data(), Hkv, w, d);
  in.keys = kvevict::kv_heads_major<const double>(k.data(), Hkv, L, d);
  const std::vector<double> s = kvevict::induction_scores<double>(in, P);
  // Head 0: exp(64 / sqrt(8)) over it plus the other keys at 1 (except the entry 0, all-zero key: also 1) -> ~1.
  CHECK(s[0] > 0.999);
  CHECK(s[1] < 1e-6);
  const std::vector<std::vector<Index>> top = kvevict::top_heads({{s[1], s[0]}, {0.5, s[0]}}, 2);
  CHECK(top == std::vector<std::vector<Index>>{{1}, {1}});  // equal scores: the earlier layer first
  CHECK(kvevict::top_heads({{0.1, 0.3}, {0.2}}, 2) == std::vector<std::vector<Index>>{{1}, {0}});
  CHECK(kvevict::top_heads({{0.1, 0.3}}, 0) == std::vector<std::vector<Index>>{{}});
}

TEST_CASE("retrieval heads: a worked layer, the head kept whole by a budget across heads", "[retrieval]") {
  // Two KV heads, L = 10, engine scores (KVzip's form, window 0, docs/algorithms.md#engine-scores): head 0 scores 1
  // everywhere, head 1 scores 0.1. One top-k over the layer with 6 entries per head (12): head 0's entries outrank
  // head 1's, so head 0 keeps all 10 and head 1 its 2 most recent (ties: the more recent entry). Naming head 1 a
  // retrieval head forces its entries: head 1 keeps all 10, head 0 its 2 most recent.
  const int Hkv = 2, L = 10, d = 4;
  Rng rng(887);
  const std::vector<double> k = kvevict_test::normal_vector(sz(Hkv * L * d), rng);
  std::vector<double> scores(sz(Hkv * L));
  for (int j = 0; j < L; ++j) {
    scores[sz(j)] = 1.0;
    scores[sz(L + j)] = 0.1;
  }
  LayerInputs<double> in;
  in.keys = kvevict::kv_heads_major<const double>(k.data(), Hkv, L, d);
  in.scores = HeadsView<const double>::heads_major(scores.data(), Hkv, L, 1);
  const auto rows = [](const kvevict::Selection& s, Index h) {
    const auto r = s.head(h);
    return std::vector<Index>(r.begin(), r.end());
  };
  const std::vector<Index> all = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const kvevict::LayerEngineScores layer;
  const auto plain = layer.select(in, Budget::tokens(6));
  CHECK(rows(plain, 0) == all);
  CHECK(rows(plain, 1) == std::vector<Index>{8, 9});
  in.retrieval_heads = {1};
  const auto forced = layer.select(in, Budget::tokens(6));
  CHECK(rows(forced, 0) == std::vector<Index>{8, 9});
  CHECK(rows(forced, 1) == all);
  // Under a uniform allocation each head still holds n_kept: the forced entries rank among themselves by score.
  kvevict::Policy<kvevict::UniformAllocation, kvevict::EngineScoreSelector>::Params u;
  u.window = 0;
  u.kernel = 1;
  const kvevict::Policy<kvevict::UniformAllocation, kvevict::EngineScoreSelector> uniform(u);
  CHECK(rows(uniform.select(in, Budget::tokens(6)), 1) == std::vector<Index>{4, 5, 6, 7, 8, 9});
}

TEST_CASE("retrieval heads: heads outside the layer, named twice, or a bad calibration are refused by name",
          "[retrieval][errors]") {
  const int H = 4, Hkv = 2, L = 12, d = 4, w = 2;
  Rng rng(888);
  const std::vector<double> q = kvevict_test::normal_vector(sz(H * w * d), rng);
  const std::vector<double> k = kvevict_test::normal_vector(sz(Hkv * L * d), rng);
  LayerInputs<double> in;
  in.queries = HeadsView<const double>::heads_major(q.data(), H, w, d);
  in.keys = kvevict::kv_heads_major<const double>(k.data(), Hkv, L, d);
  in.values = in.keys;
  in.retrieval_heads = {2};
  kvevict::SnapKV::Params sp;
  sp.window = w;
  const kvevict::SnapKV snap(sp);
  REQUIRE_THROWS_MATCHES(snap.select(in, Budget::tokens(6)), kvevict::invalid_argument,
                         MessageContains("retrieval_heads names KV head 2, expected a KV head of the layer in [0, 2)"));
  in.retrieval_heads = {1, 1};
  REQUIRE_THROWS_MATCHES(snap.select(in, Budget::tokens(6)), kvevict::invalid_argument,
                         MessageContains("retrieval_heads names KV head 1 twice"));
  in.retrieval_heads = {-1};
  REQUIRE_THROWS_MATCHES(snap.select(in, Budget::tokens(6)), kvevict::invalid_argument,
                         MessageContains("names KV head -1"));
  in.retrieval_heads = {};
  REQUIRE_THROWS_MATCHES(kvevict::induction_scores(in, 11), kvevict::invalid_argument,
                         MessageContains("period must be in [1, L - w] = [1, 10]"));
  REQUIRE_THROWS_MATCHES(kvevict::induction_scores(in, 0), kvevict::invalid_argument, MessageContains("got 0"));
  const std::int64_t full[Hkv] = {12, 12};  // lengths saying that every head holds all L entries: a fresh prefill
  in.lengths = full;
  CHECK(kvevict::induction_scores(in, 4).size() == 2);
  const std::int64_t lengths[Hkv] = {12, 9};
  in.lengths = lengths;
  REQUIRE_THROWS_MATCHES(kvevict::induction_scores(in, 4), kvevict::invalid_argument,
                         MessageContains("every KV head holding the entries at positions 0 .. L - 1, got KV head 1"));
  REQUIRE_THROWS_MATCHES(kvevict::top_heads({{0.1, std::nan("")}}, 1), kvevict::invalid_argument,
                         MessageContains("the score of layer 0, KV head 1 is not finite"));
  REQUIRE_THROWS_MATCHES(kvevict::top_heads({{0.1, 0.2}}, 3), kvevict::invalid_argument,
                         MessageContains("count must be in [0, 2]"));
}

}  // namespace test_retrieval_heads
