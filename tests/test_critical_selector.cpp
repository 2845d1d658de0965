// selectors/critical_selector.hpp and the CriticalKV presets (docs/algorithms.md#value-term, docs/algorithms.md#forcing
// fraction forcing, docs/algorithms.md#presets): CriticalKV (head-adaptive base) and CriticalSnapKV (uniform base)
// against hand-worked selections and kvevict_ref::criticalkv, in both quirk modes and every budget form, plus the
// properties every policy keeps.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_critical_selector {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Pooling;
using kvevict::Selection;
using kvevict::ValueNorm;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

// The hand-worked layer: H = 4, Hkv = 2 (G = 2), w = 4, L = 12, P = 8, kernel 1 (no smoothing), attention in units of
// 1/64. Every window row of a query head is the same and puts its window mass on key 8. Query heads 0 and 1 differ but
// their mean is a0 = [4 20 2 12 1 8 0 3]; heads 2 and 3 both read a1 = [16 1 3 4 7 2 5 6]. So the base scores are
//   s[0] = [4 20 2 12 1 8 0 3] / 64, s[1] = [16 1 3 4 7 2 5 6] / 64, layer max 20/64 = .3125 (KV 0, token 1).
// head_dim 1, D = 1, W_o = [1 3 .5 1.5]: N[h][j] = |v[h][j]| x mean of the group's |W_o| = 2 |v| (KV 0), |v| (KV 1):
//   N[0] = 2 x [1 1 1 1 1 1 1 1 | 1/8 1 1 1],  N[1] = [1/8 2 1 1 1 1 4 1 | 1 1/4 1 1].
// Stage-2 scores (s + eps) N with eps = 1e-4 (KV 0 halved, which does not change its order):
//   KV 0: j1 .3126, j3 .1876, j5 .1251, j0 .0626, j7 .0470, j2 .0313, j4 .0157, j6 .0001
//   KV 1: j6 .3129, j4 .1095, j7 .0940, j3 .0626, j2 .0470, j5 .0314, j1 .0314 (.015625+eps)*2 = .03145, j0 .0313
//   quirks, window: (.3125 + eps) N -> KV 0: w8 .0391, w9-w11 .3126 (ties with j1 exactly); KV 1: w8 .3126,
//   w9 .0782, w10 .3126, w11 .3126.
const std::vector<std::vector<double>> kRows = {
    {6, 18, 2, 12, 1, 8, 0, 3, 14, 0, 0, 0},  // q0
    {2, 22, 2, 12, 1, 8, 0, 3, 14, 0, 0, 0},  // q1: mean with q0 = a0
    {16, 1, 3, 4, 7, 2, 5, 6, 20, 0, 0, 0},   // q2
    {16, 1, 3, 4, 7, 2, 5, 6, 20, 0, 0, 0},   // q3
};
const Shape kShape{4, 2, 4, 12, 1};

kvevict_test::HandLayer& hand_layer() {
  static kvevict_test::HandLayer layer(kShape, kvevict_test::repeated_rows(kRows, 4, 64.0),
                                       {1,     1, 1, 1, 1, 1, 1, 1, 0.125, 1,    1, 1,   // KV 0 values
                                        0.125, 2, 1, 1, 1, 1, 4, 1, 1,     0.25, 1, 1},  // KV 1 values
                                       {1, 3, 0.5, 1.5});
  return layer;
}

template <class P>
P hand_policy(bool quirks, double ratio = 0.5, double eps = 1e-4) {
  typename P::Params p;
  p.window = 4;
  p.kernel = 1;
  p.reference_quirks = quirks;
  p.first_stage_ratio = ratio;
  p.eps = eps;
  return P(p);
}

template <class P>
Kept run(const P& p, std::int64_t n) {
  return kvevict_test::kept_of(p.template select<double>(hand_layer().in, Budget::tokens(n)));
}

}  // namespace

TEST_CASE("CriticalKV (adaptive base) on a hand-worked 2-KV-head, 12-token layer, both quirk modes",
          "[critical_selector]") {
  // n_kept = 6, alpha .2: n_safe = int(1.2) = 1 -> token 11 of each head (the window ranks first, most recent first).
  // Flat top-12 of s (corrected: the window above every prefix token; quirks: the window at .3125, ties by position):
  // 2 safeguard + 6 window (8..10 of both heads) + .3125 (0,1), .25 (1,0), .1875 (0,3), .125 (0,5) -> b = (7, 5),
  // the same in both modes (.109 (1,4) is the first left out).
  // Stage 1: int(7 * .5) = 3 -> KV 0 {11, 10, 9}; int(5 * .5) = 2 -> KV 1 {11, 10}.
  // Stage 2, corrected: KV 0 needs 4: w8 (the window ranks first), j1, j3, j5; KV 1 needs 3: w9, w8, j6 -- KV 1's best
  // base score, token 0 (.25, N = 1/8), is evicted for token 6 (.078, N = 4).
  CHECK(run(hand_policy<kvevict::CriticalKV>(false), 6) == Kept{{1, 3, 5, 8, 9, 10, 11}, {6, 8, 9, 10, 11}});
  // Stage 2, quirks: the window competes with (.3125 + eps) N. KV 0: j1, j3, j5, j0 all beat w8 (.0391);
  // KV 1: j6 .3129, w8 .3126, j4 .1095 beat w9 (.0782): a window token is evicted.
  CHECK(run(hand_policy<kvevict::CriticalKV>(true), 6) == Kept{{0, 1, 3, 5, 9, 10, 11}, {4, 6, 8, 10, 11}});
  // first_stage_ratio 1: stage 1 only = AdaKV on s.
  const Kept ada = {{1, 3, 5, 8, 9, 10, 11}, {0, 8, 9, 10, 11}};
  CHECK(run(hand_policy<kvevict::CriticalKV>(false, 1.0), 6) == ada);
  kvevict::AdaKV::Params ap;
  ap.window = 4;
  ap.kernel = 1;
  CHECK(kvevict_test::kept_of(kvevict::AdaKV(ap).select<double>(hand_layer().in, Budget::tokens(6))) == ada);
  // The reference agrees on all three (fed with the s and N written above).
  const std::vector<double> s = {4. / 64,  20. / 64, 2. / 64, 12. / 64, 1. / 64, 8. / 64, 0,       3. / 64,
                                 16. / 64, 1. / 64,  3. / 64, 4. / 64,  7. / 64, 2. / 64, 5. / 64, 6. / 64};
  const std::vector<double> n = {2, 2, 2, 2, 2, 2, 2, 2, 0.25, 2, 2, 2, 0.125, 2, 1, 1, 1, 1, 4, 1, 1, 0.25, 1, 1};
  CHECK(kvevict_ref::criticalkv(s, n, 2, 4, 12, 6, true, 0.2, 1e-4, 0.5, false) ==
        Kept{{1, 3, 5, 8, 9, 10, 11}, {6, 8, 9, 10, 11}});
  CHECK(kvevict_ref::criticalkv(s, n, 2, 4, 12, 6, true, 0.2, 1e-4, 0.5, true) ==
        Kept{{0, 1, 3, 5, 9, 10, 11}, {4, 6, 8, 10, 11}});
  CHECK(kvevict_ref::criticalkv(s, n, 2, 4, 12, 6, true, 0.2, 1e-4, 1.0, false) == ada);
  // alpha 1: n_safe = 6 -> every head's top 6 of s is safeguarded (= forced), b = (6, 6), and the safeguard stays first
  // in stage 2 too: the result is SnapKV's, in both modes.
  for (bool quirks : {false, true}) {
    kvevict::CriticalKV::Params p = hand_policy<kvevict::CriticalKV>(quirks).params();
    p.alpha = 1.0;
    CHECK(kvevict_test::kept_of(kvevict::CriticalKV(p).select<double>(hand_layer().in, Budget::tokens(6))) ==
          Kept{{1, 3, 8, 9, 10, 11}, {0, 4, 8, 9, 10, 11}});
  }
}

TEST_CASE("CriticalSnapKV (uniform base) on the hand-worked layer: stages, ratio, eps, tiny budgets",
          "[critical_selector]") {
  // b = 6 per head; stage 1 int(3) = 3 -> {9, 10, 11} (corrected: window first; quirks: the window's .3125 ties and the
  // most recent win). Stage 2 needs 3.
  //   corrected: KV 0 w8, j1, j3; KV 1 w8, j6, j4.   quirks: KV 0 j1, j3, j5 (w8 at .0391 loses); KV 1 j6, w8, j4.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false), 6) == Kept{{1, 3, 8, 9, 10, 11}, {4, 6, 8, 9, 10, 11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(true), 6) == Kept{{1, 3, 5, 9, 10, 11}, {4, 6, 8, 9, 10, 11}});
  // ratio 1 = SnapKV (window + top 2 of s): KV 0 j1, j3; KV 1 j0, j4.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false, 1.0), 6) == Kept{{1, 3, 8, 9, 10, 11}, {0, 4, 8, 9, 10, 11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(true, 1.0), 6) == Kept{{1, 3, 8, 9, 10, 11}, {0, 4, 8, 9, 10, 11}});
  // ratio 0: stage 2 only. Corrected: the window, then the best two by s' (same as above). Quirks: KV 0 ranks
  // j1 = w9 = w10 = w11 = .3126 (ties: 11, 10, 9, 1), then j3, j5 -> {1, 3, 9, 10, 11} + j5; KV 1: j6 .3129, then
  // w8 = w10 = w11 = .3126 (11, 10, 8), then j4 .1095, j7 .0940 -> w9 (.0782) is evicted.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false, 0.0), 6) == Kept{{1, 3, 8, 9, 10, 11}, {4, 6, 8, 9, 10, 11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(true, 0.0), 6) == Kept{{1, 3, 5, 9, 10, 11}, {4, 6, 7, 8, 10, 11}});
  // eps 1: s' ~ (1 + s) N, the value norm dominates. KV 1 stage 2: w8, then j6 (1.078 x 4), j1 (1.016 x 2) -- j4 out.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false, 0.5, 1.0), 6) ==
        Kept{{1, 3, 8, 9, 10, 11}, {1, 6, 8, 9, 10, 11}});
  // eps 0: s' = s N exactly; KV 0 token 6 has s = 0 and scores 0.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false, 0.0, 0.0), 12) ==
        Kept{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false, 0.0, 0.0), 11) ==
        Kept{{0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}});
  // n_kept 3 < w: stage 1 int(1.5) = 1 -> {11}; stage 2 needs 2. Corrected: the window's most recent, 10 and 9.
  // Quirks: KV 0 w10 = w9 = j1 = .3126 -> 10, 9; KV 1 j6 .3129, then w10 = w8 = .3126 -> 10: token 9 is evicted.
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false), 3) == Kept{{9, 10, 11}, {9, 10, 11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(true), 3) == Kept{{9, 10, 11}, {6, 10, 11}});
  // n_kept 1: stage 1 int(.5) = 0, stage 2 takes the best single entry: corrected the most recent window token;
  // quirks the best s' (KV 0: w11 ties j1, w10, w9 -> 11; KV 1: j6).
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(false), 1) == Kept{{11}, {11}});
  CHECK(run(hand_policy<kvevict::CriticalSnapKV>(true), 1) == Kept{{11}, {6}});
}

namespace {

struct Sweep {
  int cases = 0;
  int forms[3] = {0, 0, 0};  // cases per budget form: tokens, keep_ratio, compression_ratio
};

// One shape: CriticalKV and CriticalSnapKV in both modes against the reference. Each budget is given in one of the
// three forms, in turn (so every form meets every kind of shape over the sweep); the tokens form goes through the
// window queries, the ratio forms through the reference's own attention rows.
void sweep_shape(const Shape& s, int D, const SelKnobs& base, Rng& rng, int max_budgets, Sweep& sw) {
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, D, rng);
  const std::vector<double> attn = kvevict_test::ref_attention(l);
  const auto from_q = kvevict_test::store_v<double>(l, sw.cases % 2 ? Layout::heads_major : Layout::tokens_major);
  const auto from_a = kvevict_test::store_v<double>(l, Layout::heads_major, &attn);
  const kvevict_test::RefLayer r = kvevict_test::ref_layer(l, attn, base);
  const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, sz(max_budgets));
  for (bool quirks : {false, true}) {
    SelKnobs k = base;
    k.quirks = quirks;
    const auto ada = kvevict_test::make_policy<kvevict::CriticalKV>(s, k);
    const auto snap = kvevict_test::make_policy<kvevict::CriticalSnapKV>(s, k);
    for (std::int64_t n : budgets) {
      const std::vector<kvevict_test::FormedBudget> forms = kvevict_test::budget_forms(n, s.L);
      const kvevict_test::FormedBudget& b = forms[sz(sw.cases) % forms.size()];
      {
        INFO(kvevict_test::describe(s) << " D=" << D << " " << kvevict_test::describe(k) << " budget " << b.form
                                       << " n_kept=" << b.n_kept);
        const kvevict::LayerInputs<double>& in = b.form == "tokens" ? from_q.in : from_a.in;
        ++sw.cases;
        ++sw.forms[b.form == "tokens" ? 0 : b.form == "keep_ratio" ? 1 : 2];
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(ada.select<double>(in, b.budget)),
                                               kvevict_test::expect_critical(r, s, b.n_kept, true, k)) == "");
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(snap.select<double>(in, b.budget)),
                                               kvevict_test::expect_critical(r, s, b.n_kept, false, k)) == "");
      }
    }
  }
}

}  // namespace

TEST_CASE(
    "CriticalKV and CriticalSnapKV select<double> like the reference (shapes, kernels, poolings, norms, eps, "
    "ratios, quirks, budget forms)",
    "[critical_selector]") {
  Rng rng(701);
  Sweep sw;
  const Shape shapes[] = {{1, 1, 1, 2, 16},  {2, 1, 4, 5, 16},   {8, 2, 32, 33, 16},  {8, 8, 4, 40, 16},
                          {4, 4, 4, 64, 64}, {8, 1, 4, 100, 16}, {4, 2, 32, 150, 16}, {2, 2, 4, 2000, 16}};
  SelKnobs knobs[8];
  knobs[1].kernel = 7;
  knobs[1].pooling = Pooling::max;
  knobs[2].kernel = 1;
  knobs[2].norm = ValueNorm::l2;
  knobs[3].pooling = Pooling::max;
  knobs[3].eps = 0.0;
  knobs[4].kernel = 7;
  knobs[4].ratio = 0.25;
  knobs[5].kernel = 1;
  knobs[5].pooling = Pooling::max;
  knobs[5].ratio = 1.0;
  knobs[5].alpha = 0.5;
  knobs[6].ratio = 0.0;
  knobs[6].eps = 0.01;
  knobs[7].norm = ValueNorm::l2;
  int i = 0;
  for (const Shape& s : shapes) {
    const SelKnobs& k = knobs[i++];
    sweep_shape(s, s.L > 1000 ? 8 : 12, k, rng, s.L > 1000 ? 2 : 6, sw);
  }
  for (int t = 0; t < 6; ++t) {
    Shape s = kvevict_test::random_shape(rng, 120);
    if (s.d == 128) s.d = 16;
    sweep_shape(s, 8, knobs[sz(t) % 8], rng, 4, sw);
  }
  CHECK(sw.cases > 100);
  CHECK(sw.forms[0] >= 20);
  CHECK(sw.forms[1] >= 20);
  CHECK(sw.forms[2] >= 20);
}

TEST_CASE(
    "CriticalKV and CriticalSnapKV: budget accounting, window, order, determinism, layout and input-route "
    "invariance (float)",
    "[critical_selector]") {
  Rng rng(702);
  std::vector<Shape> shapes = {{8, 2, 32, 33, 16}, {4, 4, 1, 2, 16}, {8, 1, 4, 400, 16}};
  for (int i = 0; i < 3; ++i) {
    Shape s = kvevict_test::random_shape(rng, 100);
    if (s.d == 128) s.d = 16;
    shapes.push_back(s);
  }
  for (const Shape& s : shapes) {
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 8, rng);
    const auto hm = kvevict_test::store_v<float>(l, Layout::heads_major);
    const auto tm = kvevict_test::store_v<float>(l, Layout::tokens_major);
    const std::vector<float> rows = kvevict_test::library_attention<float, float>(hm.in.queries, hm.in.keys);
    const std::vector<double> rows_d = kvevict_test::to_double(rows);
    const auto ha = kvevict_test::store_v<float>(l, Layout::heads_major, &rows_d);  // float rows: exactly `rows`
    for (bool quirks : {false, true}) {
      SelKnobs k;
      k.quirks = quirks;
      const auto ada = kvevict_test::make_policy<kvevict::CriticalKV>(s, k);
      const auto snap = kvevict_test::make_policy<kvevict::CriticalSnapKV>(s, k);
      const auto ada_composed =
          kvevict_test::make_policy<kvevict::Policy<kvevict::HeadAdaptiveAllocation, kvevict::CriticalSelector>>(s, k);
      const auto snap_composed =
          kvevict_test::make_policy<kvevict::Policy<kvevict::UniformAllocation, kvevict::CriticalSelector>>(s, k);
      const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, 3);
      for (std::int64_t n : budgets) {
        INFO(kvevict_test::describe(s) << " quirks=" << quirks << " n_kept=" << n);
        const Budget b = Budget::tokens(n);
        const Selection a = ada.select(hm.in, b), u = snap.select(hm.in, b);
        REQUIRE(kvevict_test::structure_errors(a, s.Hkv, s.L) == "");
        REQUIRE(kvevict_test::structure_errors(u, s.Hkv, s.L) == "");
        CHECK(kvevict_test::mask_errors(a) == "");
        CHECK(a.total() == s.Hkv * n);  // the head-adaptive base distributes exactly Hkv * n_kept
        for (Index h = 0; h < s.Hkv; ++h) CHECK(u.length(h) == n);  // uniform: n_kept per head
        if (!quirks)                                                // corrected: the window is always kept
          for (Index h = 0; h < s.Hkv; ++h) {
            const Index from = n >= s.w ? s.P() : s.L - n;
            for (Index j = from; j < s.L; ++j) {
              CHECK(a.kept(h, j));
              CHECK(u.kept(h, j));
            }
          }
        const Kept ka = kvevict_test::kept_of(a), ku = kvevict_test::kept_of(u);
        CHECK(kvevict_test::kept_of(ada.select(hm.in, b)) == ka);  // determinism
        CHECK(kvevict_test::kept_of(ada.select(tm.in, b)) == ka);  // KV layout
        CHECK(kvevict_test::kept_of(snap.select(tm.in, b)) == ku);
        CHECK(kvevict_test::kept_of(ada.select(ha.in, b)) == ka);  // precomputed attention rows
        CHECK(kvevict_test::kept_of(snap.select(ha.in, b)) == ku);
        CHECK(kvevict_test::kept_of(ada_composed.select(hm.in, b)) == ka);  // Policy<AdaKV, ...> == Policy<alloc, ...>
        CHECK(kvevict_test::kept_of(snap_composed.select(hm.in, b)) == ku);
      }
    }
  }
}

TEST_CASE("CriticalKV with first_stage_ratio 1 is AdaKV, CriticalSnapKV with ratio 1 is SnapKV",
          "[critical_selector]") {
  Rng rng(703);
  for (int t = 0; t < 4; ++t) {
    Shape s = kvevict_test::random_shape(rng, 100);
    if (s.d == 128) s.d = 16;
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 8, rng);
    const auto st = kvevict_test::store_v<double>(l, Layout::heads_major);
    for (bool quirks : {false, true}) {
      SelKnobs k;
      k.ratio = 1.0;
      k.quirks = quirks;
      kvevict::AdaKV::Params ap;
      kvevict::SnapKV::Params sp;
      kvevict_test::apply_knobs(s, k, ap);
      kvevict_test::apply_knobs(s, k, sp);
      const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, 4);
      for (std::int64_t n : budgets) {
        INFO(kvevict_test::describe(s) << " quirks=" << quirks << " n_kept=" << n);
        CHECK(kvevict_test::kept_of(
                  kvevict_test::make_policy<kvevict::CriticalKV>(s, k).select<double>(st.in, Budget::tokens(n))) ==
              kvevict_test::kept_of(kvevict::AdaKV(ap).select<double>(st.in, Budget::tokens(n))));
        CHECK(kvevict_test::kept_of(
                  kvevict_test::make_policy<kvevict::CriticalSnapKV>(s, k).select<double>(st.in, Budget::tokens(n))) ==
              kvevict_test::kept_of(kvevict::SnapKV(sp).select<double>(st.in, Budget::tokens(n))));
      }
    }
  }
}

TEST_CASE("CriticalKV parameters: defaults, validation, and quirks with any budget form", "[critical_selector]") {
  const kvevict::CriticalKV c;
  CHECK(c.params().eps == 1e-4);
  CHECK(c.params().first_stage_ratio == 0.5);
  CHECK(c.params().value_norm == ValueNorm::l1);
  CHECK(c.params().alpha == 0.2);
  CHECK(c.params().window == 32);
  CHECK(c.params().kernel == 5);
  CHECK_FALSE(c.params().reference_quirks);
  static_assert(std::is_same_v<kvevict::CriticalKV::Allocation, kvevict::HeadAdaptiveAllocation>);
  static_assert(std::is_same_v<kvevict::CriticalSnapKV::Allocation, kvevict::UniformAllocation>);
  static_assert(
      std::is_base_of_v<kvevict::Policy<kvevict::SnapKV, kvevict::CriticalSelector>, kvevict::CriticalSnapKV>);
  static_assert(std::is_base_of_v<kvevict::Policy<kvevict::AdaKV, kvevict::CriticalSelector>, kvevict::CriticalKV>);
  static_assert(std::is_base_of_v<kvevict::LayerGlobalPolicy<kvevict::DefensiveSelector>, kvevict::LayerDefensiveKV>);
  static_assert(std::is_same_v<kvevict::LayerGlobalPolicy<kvevict::CriticalSelector>,
                               kvevict::Policy<kvevict::LayerGlobalAllocation, kvevict::CriticalSelector>>);
  using kvevict_test::MessageContains;
  for (double eps : {-1e-9, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    kvevict::CriticalKV::Params p;
    p.eps = eps;
    REQUIRE_THROWS_MATCHES(kvevict::CriticalKV(p), kvevict::invalid_argument,
                           MessageContains("eps must be finite and >= 0"));
    kvevict::CriticalSnapKV::Params q;
    q.eps = eps;
    REQUIRE_THROWS_MATCHES(kvevict::CriticalSnapKV(q), kvevict::invalid_argument,
                           MessageContains("kvevict::CriticalSnapKV::Params: eps"));
  }
  for (double r : {-0.1, 1.01, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
    kvevict::CriticalKV::Params p;
    p.first_stage_ratio = r;
    REQUIRE_THROWS_MATCHES(kvevict::CriticalKV(p), kvevict::invalid_argument,
                           MessageContains("first_stage_ratio must be in [0, 1]"));
  }
  // Boundaries are valid.
  kvevict::CriticalKV::Params ok;
  ok.eps = 0.0;
  ok.first_stage_ratio = 0.0;
  CHECK_NOTHROW(kvevict::CriticalKV(ok));
  ok.first_stage_ratio = 1.0;
  CHECK_NOTHROW(kvevict::CriticalKV(ok));
  // CriticalKV's quirk (the window competing in stage 2) does not use the compression ratio: every budget form works
  // and selects the same as the equivalent compression ratio.
  const auto q = hand_policy<kvevict::CriticalKV>(true);
  const Kept by_tokens = kvevict_test::kept_of(q.select<double>(hand_layer().in, Budget::tokens(6)));
  CHECK(kvevict_test::kept_of(q.select<double>(hand_layer().in, Budget::keep_ratio(0.5))) == by_tokens);
  CHECK(kvevict_test::kept_of(q.select<double>(hand_layer().in, Budget::compression_ratio(0.5))) == by_tokens);
}

}  // namespace test_critical_selector
