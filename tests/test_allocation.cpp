// allocation/uniform.hpp, allocation/head_adaptive.hpp: stage "allocation" (docs/algorithms.md#allocation) on identical
// score tensors (no near-tie noise), checked index for index against the reference's snapkv / adakv / adakv_original.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_allocation {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::HeadAdaptiveAllocation;
using kvevict::Index;
using kvevict::extend::KeepFlags;
using kvevict::extend::LayerBudget;
using kvevict::extend::ScoreMap;
using kvevict::extend::Tier;
using kvevict_test::Kept;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::sz;

namespace {

struct Case {
  int Hkv, w, L;
  std::vector<double> scores;  // [Hkv, P]
};

LayerBudget layer_budget(const Case& c, std::int64_t n_kept) {
  LayerBudget b;
  b.n_kept = n_kept;
  b.total = c.Hkv * static_cast<Index>(n_kept);
  b.window = c.w;
  return b;
}

ScoreMap<double> map_of(const Case& c) {
  return ScoreMap<double>::with_window(kvevict_test::to_matrix(c.scores, c.Hkv, c.L - c.w), c.w);
}

template <class Allocation>
Kept run(const Allocation& a, const Case& c, std::int64_t n_kept, std::vector<Index>* budgets_out = nullptr) {
  ScoreMap<double> m = map_of(c);
  const std::vector<Index> budgets = a.allocate(m, layer_budget(c, n_kept));
  REQUIRE(budgets.size() == sz(c.Hkv));
  KeepFlags keep;
  kvevict::extend::select_top_per_head(m, budgets, keep);
  const kvevict::Selection sel = kvevict::Selection::from_flags(keep, c.Hkv, c.L);
  REQUIRE(kvevict_test::structure_errors(sel, c.Hkv, c.L) == "");
  for (Index h = 0; h < c.Hkv; ++h) REQUIRE(sel.length(h) == budgets[sz(h)]);
  if (budgets_out) *budgets_out = budgets;
  return kvevict_test::kept_of(sel);
}

// Random cases: continuous scores, or scores quantised to a few values (many exact ties, also with the layer max).
std::vector<Case> cases(Rng& rng, int n, bool quantised) {
  std::vector<Case> out;
  for (int i = 0; i < n; ++i) {
    const kvevict_test::Shape s = kvevict_test::random_shape(rng, i < n - 1 ? 150 : 3000);
    Case c{s.Hkv, s.w, s.L, {}};
    const std::size_t size = sz(s.Hkv) * sz(s.P());
    if (quantised) {
      c.scores = kvevict_test::quantised_scores(size, std::uniform_int_distribution<int>(1, 4)(rng), rng);
    } else {
      c.scores = kvevict_test::normal_vector(size, rng);
      for (double& v : c.scores) v = std::exp(v);
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::string describe(const Case& c, std::int64_t n_kept) {
  return "Hkv=" + std::to_string(c.Hkv) + " w=" + std::to_string(c.w) + " L=" + std::to_string(c.L) +
         " n_kept=" + std::to_string(n_kept);
}

std::vector<std::int64_t> budgets_of(const Case& c, Rng& rng) {
  return kvevict_test::budget_sweep(kvevict_test::Shape{c.Hkv, c.Hkv, c.w, c.L, 16}, rng);
}

}  // namespace

TEST_CASE("UniformAllocation gives every head n_kept", "[allocation]") {
  ScoreMap<double> m(3, 10);
  LayerBudget b;
  b.n_kept = 7;
  b.total = 21;
  b.window = 2;
  CHECK(kvevict::UniformAllocation().allocate(m, b) == std::vector<Index>{7, 7, 7});
}

TEST_CASE("uniform allocation + per-head top-k equals reference snapkv on identical scores", "[allocation]") {
  Rng rng(71);
  for (bool quantised : {false, true})
    for (const Case& c : cases(rng, 30, quantised))
      for (std::int64_t n : budgets_of(c, rng)) {
        INFO(describe(c, n) << (quantised ? " quantised" : ""));
        std::vector<Index> budgets;
        const Kept got = run(kvevict::UniformAllocation(), c, n, &budgets);
        REQUIRE(kvevict_test::first_difference(got, kvevict_ref::snapkv(c.scores, c.Hkv, c.w, c.L, n)) == "");
        REQUIRE(budgets == std::vector<Index>(sz(c.Hkv), static_cast<Index>(n)));
      }
}

TEST_CASE("head-adaptive allocation (kvpress) equals reference adakv on identical scores", "[allocation]") {
  Rng rng(72);
  for (bool quantised : {false, true})
    for (const Case& c : cases(rng, 30, quantised))
      for (double alpha : {0.2, 0.0, 0.5, 1.0})
        for (std::int64_t n : budgets_of(c, rng)) {
          INFO(describe(c, n) << " alpha=" << alpha << (quantised ? " quantised" : ""));
          HeadAdaptiveAllocation::Params p;
          p.alpha = alpha;
          std::vector<Index> budgets;
          const Kept got = run(HeadAdaptiveAllocation(p), c, n, &budgets);
          REQUIRE(kvevict_test::first_difference(got, kvevict_ref::adakv(c.scores, c.Hkv, c.w, c.L, n, alpha)) == "");
          REQUIRE(std::accumulate(budgets.begin(), budgets.end(), Index(0)) == c.Hkv * n);
        }
}

TEST_CASE("head-adaptive allocation (original AdaKV repo) equals reference adakv_original on identical scores",
          "[allocation]") {
  Rng rng(73);
  for (bool quantised : {false, true})
    for (const Case& c : cases(rng, 30, quantised))
      for (double alpha : {0.2, 0.0, 0.5, 1.0})
        for (std::int64_t n : budgets_of(c, rng)) {
          INFO(describe(c, n) << " alpha=" << alpha << (quantised ? " quantised" : ""));
          HeadAdaptiveAllocation::Params p;
          p.alpha = alpha;
          p.variant = HeadAdaptiveAllocation::Variant::original;
          const Kept got = run(HeadAdaptiveAllocation(p), c, n);
          REQUIRE(kvevict_test::first_difference(
                      got, kvevict_ref::adakv_original(c.scores, c.Hkv, c.w, c.L, n, alpha)) == "");
        }
}

TEST_CASE("kvpress safeguard: exactly n_safe = int(n_kept * alpha) entries per head are safeguarded, its top ones",
          "[allocation]") {
  Rng rng(74);
  struct S {
    std::int64_t n_kept;
    double alpha;
    Index n_safe;
  };
  // The products are computed in double and truncated: 100 * 0.29 = 28.999999999999996 -> 28.
  for (const S t : {S{10, 0.2, 2}, S{15, 0.2, 3}, S{4, 0.2, 0}, S{100, 0.29, 28}, S{10, 0.3, 3}, S{7, 0.2, 1},
                    S{50, 1.0, 50}, S{50, 0.0, 0}}) {
    INFO("n_kept=" << t.n_kept << " alpha=" << t.alpha);
    CHECK(static_cast<Index>(static_cast<double>(t.n_kept) * t.alpha) == t.n_safe);
    Case c{3, 2, 120, kvevict_test::normal_vector(3 * 118, rng)};
    ScoreMap<double> m = map_of(c);
    HeadAdaptiveAllocation::Params p;
    p.alpha = t.alpha;
    const std::vector<Index> budgets = HeadAdaptiveAllocation(p).allocate(m, layer_budget(c, t.n_kept));
    CHECK(std::accumulate(budgets.begin(), budgets.end(), Index(0)) == 3 * t.n_kept);
    const ScoreMap<double> fresh = map_of(c);
    for (Index h = 0; h < 3; ++h) {
      Index safe = 0;
      for (Index j = 0; j < c.L; ++j) safe += m.tier_of(h, j) == Tier::safeguard ? 1 : 0;
      CHECK(safe == t.n_safe);
      KeepFlags top(m.score.size(), 0);
      kvevict::extend::top_k_of_head(fresh, h, t.n_safe, top);
      for (Index j = 0; j < c.L; ++j)
        if (top[fresh.flat(h, j)]) CHECK(m.tier_of(h, j) == Tier::safeguard);
      CHECK(budgets[sz(h)] >= t.n_safe);
    }
  }
}

TEST_CASE("kvpress safeguard decides when one head dominates the layer", "[allocation]") {
  // Head 0's prefix scores all beat head 1's. w = 1, n_kept = 10, alpha = 0.5 -> n_safe = 5: head 1 keeps its window
  // and its 4 best prefix tokens, head 0 gets the remaining 20 - 5 = 15.
  Case c{2, 1, 30, {}};
  for (int j = 0; j < 29; ++j) c.scores.push_back(10.0 + j % 7);
  for (int j = 0; j < 29; ++j) c.scores.push_back(1.0 + 0.01 * j);  // increasing: best are the most recent
  HeadAdaptiveAllocation::Params p;
  p.alpha = 0.5;
  std::vector<Index> budgets;
  const Kept got = run(HeadAdaptiveAllocation(p), c, 10, &budgets);
  CHECK(budgets == std::vector<Index>{15, 5});
  CHECK(got[1] == std::vector<std::int64_t>{25, 26, 27, 28, 29});
  CHECK(got == kvevict_ref::adakv(c.scores, 2, 1, 30, 10, 0.5));
  // Without the safeguard head 1 keeps only its window token.
  p.alpha = 0.0;
  CHECK(run(HeadAdaptiveAllocation(p), c, 10, &budgets)[1] == std::vector<std::int64_t>{29});
  CHECK(budgets == std::vector<Index>{19, 1});
}

TEST_CASE("original variant: b_h = round_half_even(count_h (1 - alpha) + floor(alpha B)) + w", "[allocation]") {
  // Identical heads: a flat top-k of Hkv * B splits B / B. alpha = 0.5, w = 1, n_kept = 6, B = 5:
  // b = round(2.5 + 2) + 1 = 4 + 1 (half to even, not 5 + 1), so the layer keeps 10 tokens, not 12.
  Case c{2, 1, 11, {}};
  const std::vector<double> head = {3, 9, 1, 7, 5, 8, 2, 6, 4, 0.5};
  c.scores = head;
  c.scores.insert(c.scores.end(), head.begin(), head.end());
  HeadAdaptiveAllocation::Params p;
  p.alpha = 0.5;
  p.variant = HeadAdaptiveAllocation::Variant::original;
  std::vector<Index> budgets;
  const Kept got = run(HeadAdaptiveAllocation(p), c, 6, &budgets);
  CHECK(budgets == std::vector<Index>{5, 5});
  CHECK(got[0] == std::vector<std::int64_t>{1, 3, 5, 7, 10});  // scores 9, 7, 8, 6 and the window
  CHECK(got == kvevict_ref::adakv_original(c.scores, 2, 1, 11, 6, 0.5));
  // n_kept = 8, B = 7, floor(3.5) = 3: count 7 each -> round(3.5 + 3) = 6 (even) -> b = 7.
  CHECK(run(HeadAdaptiveAllocation(p), c, 8, &budgets) == kvevict_ref::adakv_original(c.scores, 2, 1, 11, 8, 0.5));
  CHECK(budgets == std::vector<Index>{7, 7});
  // n_kept <= w: every head keeps its n_kept most recent tokens.
  Rng rng(5);
  const Case c2{2, 4, 12, kvevict_test::normal_vector(16, rng)};
  CHECK(run(HeadAdaptiveAllocation(p), c2, 3, &budgets) == Kept{{9, 10, 11}, {9, 10, 11}});
  CHECK(budgets == std::vector<Index>{3, 3});
}

TEST_CASE("n_kept < w: only the most recent n_kept window tokens survive, in every allocation", "[allocation]") {
  Rng rng(75);
  Case c{4, 8, 40, kvevict_test::normal_vector(4 * 32, rng)};
  for (double& v : c.scores) v = std::exp(v);
  HeadAdaptiveAllocation::Params orig;
  orig.variant = HeadAdaptiveAllocation::Variant::original;
  for (std::int64_t n = 1; n <= 8; ++n) {
    Kept want(4);
    for (std::int64_t j = 40 - n; j < 40; ++j)
      for (auto& v : want) v.push_back(j);
    INFO("n_kept=" << n);
    CHECK(run(kvevict::UniformAllocation(), c, n) == want);
    CHECK(run(HeadAdaptiveAllocation(), c, n) == want);  // the window outranks the safeguard's prefix tokens
    CHECK(run(HeadAdaptiveAllocation(orig), c, n) == want);
  }
}

TEST_CASE("HeadAdaptiveAllocation::Params validates alpha", "[allocation][errors]") {
  HeadAdaptiveAllocation::Params p;
  CHECK(p.alpha == 0.2);
  CHECK(p.variant == HeadAdaptiveAllocation::Variant::kvpress);
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    p.alpha = bad;
    REQUIRE_THROWS_MATCHES(p.validate("AdaKV"), kvevict::invalid_argument,
                           MessageContains("kvevict::AdaKV: alpha must be in [0, 1], got"));
  }
  p.alpha = 1.0;
  CHECK_NOTHROW(p.validate("AdaKV"));
}

}  // namespace test_allocation
