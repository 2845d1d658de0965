// Key-only selectors (K-norm, KeyDiff: docs/algorithms.md#key-only) and the TOVA preset (docs/algorithms.md#presets):
// worked numbers, brute forces written here from the papers' definitions, the optional observation, composition with
// other bases, and errors. The float64 layout reference (tests/test_layout_reference.cpp) checks them on ragged layers,
// every sharing, block and reduction; tests/test_quantized_storage.cpp and test_half_storage.cpp on every storage.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <kvevict/kvevict.hpp>

#include "support/cases.hpp"
#include "support/random_inputs.hpp"
#include "support/reference.hpp"

namespace test_key_selectors {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

std::vector<std::vector<Index>> kept(const Selection& s) {
  std::vector<std::vector<Index>> out;
  for (Index h = 0; h < s.heads(); ++h) out.emplace_back(s.head(h).begin(), s.head(h).end());
  return out;
}

/// Head h keeps its top (n_kept - w) prefix tokens by `score` (ties: the more recent) and its window.
std::vector<std::vector<Index>> top_with_window(const std::vector<std::vector<double>>& score, int L, int w,
                                                std::int64_t n_kept) {
  std::vector<std::vector<Index>> out;
  for (const auto& s : score) {
    std::vector<Index> order(static_cast<std::size_t>(L - w));
    std::iota(order.begin(), order.end(), Index(0));
    std::sort(order.begin(), order.end(), [&](Index a, Index b) {
      const double x = s[static_cast<std::size_t>(a)], y = s[static_cast<std::size_t>(b)];
      return x != y ? x > y : a > b;
    });
    const std::int64_t n = std::max<std::int64_t>(0, n_kept - w);
    std::vector<Index> k(order.begin(), order.begin() + std::min<std::int64_t>(n, L - w));
    for (Index j = std::max<Index>(L - w, L - n_kept); j < L; ++j) k.push_back(j);
    std::sort(k.begin(), k.end());
    out.push_back(k);
  }
  return out;
}

template <class T>
kvevict::LayerInputs<T> keys_only(const std::vector<T>& k, Index Hkv, Index L, Index d) {
  kvevict::LayerInputs<T> in;
  in.keys = kvevict::kv_heads_major<const T>(k.data(), Hkv, L, d);
  return in;
}

}  // namespace

TEMPLATE_TEST_CASE("key-only selectors: the worked example of docs/algorithms.md#key-only", "[selectors][keys]", float,
                   double) {
  using T = TestType;
  // One KV head, d = 2, keys (3, 4), (1, 0), (0, 2), (0, 0); window 1 (the presets' default).
  const std::vector<T> k = {3, 4, 1, 0, 0, 2, 0, 0};
  const auto in = keys_only(k, 1, 4, 2);
  const kvevict::KNorm knorm;
  const kvevict::KeyDiff keydiff;
  CHECK(knorm.params().window == 1);
  CHECK(keydiff.params().window == 1);
  CHECK_FALSE(knorm.reads_observation());
  CHECK_FALSE(keydiff.reads_observation());
  CHECK(kvevict::SnapKV::reads_observation());
  // K-norm: -5, -1, -2 | window.
  CHECK(kept(knorm.select<T>(in, Budget::tokens(2))) == std::vector<std::vector<Index>>{{1, 3}});
  CHECK(kept(knorm.select<T>(in, Budget::tokens(3))) == std::vector<std::vector<Index>>{{1, 2, 3}});
  // KeyDiff: anchor (0.4, 0.45); scores -0.99654, -0.66436, -0.74741 | window (the zero key adds nothing).
  CHECK(kept(keydiff.select<T>(in, Budget::tokens(2))) == std::vector<std::vector<Index>>{{1, 3}});
  CHECK(kept(keydiff.select<T>(in, Budget::tokens(3))) == std::vector<std::vector<Index>>{{1, 2, 3}});
  // Key 1 flipped to (-1, 0): the anchor turns to (-0.1, 0.45), the cosines to 0.6508, 0.2169, 0.9762, so now key 2
  // (0, 2) is the most aligned and goes first.
  const std::vector<T> k2 = {3, 4, -1, 0, 0, 2, 0, 0};
  CHECK(kept(keydiff.select<T>(keys_only(k2, 1, 4, 2), Budget::tokens(3))) ==
        std::vector<std::vector<Index>>{{0, 1, 3}});
}

TEST_CASE("key-only selectors: the papers' scores by brute force, over shapes and budgets, in double",
          "[selectors][keys]") {
  Rng rng(2504);
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(200); ++c) {
    const Shape s = kvevict_test::random_shape(rng, 90);
    kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    if (c % 5 == 0)  // a zero key in every head: K-norm ranks it first, KeyDiff scores it 0
      for (int h = 0; h < s.Hkv; ++h)
        for (int x = 0; x < s.d; ++x)
          l.k[(static_cast<std::size_t>(h * s.L) + 0) * static_cast<std::size_t>(s.d) + static_cast<std::size_t>(x)] =
              0.0;
    // Every fourth case keeps no window (window 0: a policy that reads no observation may have none; kvpress's
    // KnormPress has none): each head then keeps its top n_kept of all its entries.
    const int w = c % 4 == 3 ? 0 : s.w;
    std::vector<std::vector<double>> norm_score, diff_score;
    for (int h = 0; h < s.Hkv; ++h) {
      const auto key = [&](int j, int x) {
        return l.k[(static_cast<std::size_t>(h) * static_cast<std::size_t>(s.L) + static_cast<std::size_t>(j)) *
                       static_cast<std::size_t>(s.d) +
                   static_cast<std::size_t>(x)];
      };
      const auto norm = [&](int j) {
        double q = 0;
        for (int x = 0; x < s.d; ++x) q += key(j, x) * key(j, x);
        return std::sqrt(q);
      };
      std::vector<double> anchor(static_cast<std::size_t>(s.d), 0.0);
      for (int j = 0; j < s.L; ++j)
        if (norm(j) > 0)
          for (int x = 0; x < s.d; ++x) anchor[static_cast<std::size_t>(x)] += key(j, x) / norm(j) / s.L;
      double an = 0;
      for (double a : anchor) an += a * a;
      an = std::sqrt(an);
      std::vector<double> ns, ds;
      for (int j = 0; j < s.L - w; ++j) {
        double dot = 0;
        for (int x = 0; x < s.d; ++x) dot += key(j, x) * anchor[static_cast<std::size_t>(x)];
        ns.push_back(-norm(j));
        ds.push_back(norm(j) > 0 ? -dot / (norm(j) * an) : 0.0);
      }
      norm_score.push_back(ns);
      diff_score.push_back(ds);
    }
    const auto st =
        kvevict_test::store<double>(l, c % 2 ? kvevict_test::Layout::heads_major : kvevict_test::Layout::tokens_major);
    kvevict::KNorm::Params pn;
    pn.window = w;
    kvevict::KeyDiff::Params pd;
    pd.window = w;
    for (std::int64_t n_kept : kvevict_test::budget_sweep(s, rng)) {
      INFO(kvevict_test::describe(s) << " n_kept " << n_kept << " case " << c);
      CHECK(kept(kvevict::KNorm(pn).select<double>(st.in, Budget::tokens(n_kept))) ==
            top_with_window(norm_score, s.L, w, n_kept));
      CHECK(kept(kvevict::KeyDiff(pd).select<double>(st.in, Budget::tokens(n_kept))) ==
            top_with_window(diff_score, s.L, w, n_kept));
      ++compared;
    }
  }
  CHECK(compared > kvevict_test::cases(400));
}

TEST_CASE("key-only selectors: no observation needed, and one that is given is not read", "[selectors][keys]") {
  Rng rng(11430);
  Shape s;
  s.H = 8, s.Hkv = 2, s.w = 4, s.L = 70, s.d = 16;
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto st = kvevict_test::store<float>(l, kvevict_test::Layout::heads_major);
  kvevict::LayerInputs<float> bare;
  bare.keys = st.in.keys;
  kvevict::LayerInputs<float> odd = bare;  // an observation of another shape: ignored
  const std::vector<float> q(3 * 5 * 16, 1.0f);
  odd.queries = kvevict::HeadsView<const float>::heads_major(q.data(), 3, 5, 16);
  kvevict::KNorm::Params pn;
  pn.window = s.w;
  kvevict::KeyDiff::Params pd;
  pd.window = s.w;
  const Budget b = Budget::tokens(20);
  CHECK(kept(kvevict::KNorm(pn).select(bare, b)) == kept(kvevict::KNorm(pn).select(st.in, b)));
  CHECK(kept(kvevict::KNorm(pn).select(odd, b)) == kept(kvevict::KNorm(pn).select(st.in, b)));
  CHECK(kept(kvevict::KeyDiff(pd).select(bare, b)) == kept(kvevict::KeyDiff(pd).select(st.in, b)));
  CHECK(kept(kvevict::KeyDiff(pd).select(odd, b)) == kept(kvevict::KeyDiff(pd).select(st.in, b)));
  // Attention-scored policies still need one.
  kvevict::SnapKV::Params ps;
  ps.window = s.w;
  REQUIRE_THROWS_WITH(kvevict::SnapKV(ps).select(bare, b),
                      Catch::Contains("exactly one of queries [H, w, head_dim] and attention [H, w, L] must be given, "
                                      "got neither"));
  // Compositions: any base, and one budget across layers.
  const kvevict::Policy<kvevict::AdaKV, kvevict::KeyNormSelector> ada_knorm;
  CHECK_FALSE(ada_knorm.reads_observation());
  kvevict::Policy<kvevict::AdaKV, kvevict::KeyNormSelector>::Params pa;
  pa.window = s.w;
  const Selection a = kvevict::Policy<kvevict::AdaKV, kvevict::KeyNormSelector>(pa).select(bare, b);
  CHECK(a.total() == 2 * 20);
  kvevict::LayerGlobalPolicy<kvevict::KeyDiffSelector>::Params pg;
  pg.window = s.w;
  const auto model = kvevict::LayerGlobalPolicy<kvevict::KeyDiffSelector>(pg).select(
      std::vector<kvevict::LayerInputs<float>>{bare, bare}, b);
  REQUIRE(model.size() == 2);
  CHECK(model[0].total() + model[1].total() == 2 * 2 * 20);
  CHECK(kept(model[0]) == kept(model[1]));  // the same layer twice: ties go to the lower layer, alternately
}

TEST_CASE("key-only selectors: non-finite keys are refused by name", "[selectors][keys][errors]") {
  std::vector<float> k = {3, 4, 1, 0, 0, 2, 0, 0};
  k[5] = std::numeric_limits<float>::quiet_NaN();
  const auto in = keys_only(k, 1, 4, 2);
  REQUIRE_THROWS_WITH(kvevict::KNorm().select(in, Budget::tokens(2)),
                      Catch::Contains("kvevict::KNorm::select: keys[0, 2, 1] is not finite"));
  REQUIRE_THROWS_WITH(kvevict::KeyDiff().select(in, Budget::tokens(2)),
                      Catch::Contains("kvevict::KeyDiff::select: keys[0, 2, 1] is not finite"));
  k[5] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(kvevict::KeyDiff().select(keys_only(k, 1, 4, 2), Budget::tokens(2)),
                      Catch::Contains("keys[0, 2, 1] is not finite (inf)"));
  // A window that does not fit the keys is refused as for every policy.
  kvevict::KNorm::Params p;
  p.window = 4;
  REQUIRE_THROWS_WITH(kvevict::KNorm(p).select(in, Budget::tokens(2)),
                      Catch::Contains("window (4) must be smaller than the context length (4)"));
}

TEST_CASE("TOVA: the last query's attention averaged over all query heads, one set for every KV head",
          "[selectors][tova]") {
  Rng rng(2401);
  int compared = 0;
  for (int c = 0; c < 120; ++c) {
    Shape s = kvevict_test::random_shape(rng, 120);
    s.w = 1;
    if (s.L < 2) s.L = 2;
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    // kvpress TOVAPress: attn [H, 1, L] of the last query, mean over the H heads, the last token padded with the max.
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, 1, s.L, s.d);
    std::vector<double> mean(static_cast<std::size_t>(s.P()), 0.0);
    for (int q = 0; q < s.H; ++q)
      for (int j = 0; j < s.P(); ++j)
        mean[static_cast<std::size_t>(j)] +=
            attn[static_cast<std::size_t>(q) * static_cast<std::size_t>(s.L) + static_cast<std::size_t>(j)] / s.H;
    const std::vector<std::vector<double>> score(static_cast<std::size_t>(s.Hkv), mean);
    const auto st = kvevict_test::store<double>(l, kvevict_test::Layout::heads_major);
    for (std::int64_t n_kept : kvevict_test::budget_sweep(s, rng)) {
      INFO(kvevict_test::describe(s) << " n_kept " << n_kept << " case " << c);
      CHECK(kept(kvevict::TOVA().select<double>(st.in, Budget::tokens(n_kept))) ==
            top_with_window(score, s.L, 1, n_kept));
      ++compared;
    }
  }
  CHECK(compared > 200);
  const kvevict::TOVA t;
  CHECK(t.params().window == 1);
  CHECK(t.params().kernel == 1);
  CHECK(t.params().share == kvevict::Sharing::per_layer);
  CHECK(t.params().reduce == kvevict::Reduce::mean);
  CHECK(t.reads_observation());
}

}  // namespace test_key_selectors
