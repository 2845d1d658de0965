// selectors/defensive_selector.hpp and the DefensiveKV presets (docs/algorithms.md#aggregation defensive,
// docs/algorithms.md#value-term normalised value term, docs/algorithms.md#forcing cumulative-mass forcing,
// docs/algorithms.md#presets): DefensiveKV (flat top-k), AdaKVDefensive (the paper's
// ablation) and the DefensiveSelector on every per-layer base with its toggles, against hand-worked selections and the
// float64 reference in both quirk modes; properties; the errors of the value-aware selectors.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_defensive_selector {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Pooling;
using kvevict::RowMatrix;
using kvevict::Selection;
using kvevict::ValueNorm;
using kvevict_test::DefBase;
using kvevict_test::Forced;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

using DefensiveAdaKV = kvevict::Policy<kvevict::AdaKV, kvevict::DefensiveSelector>;    // safeguard + forcing
using DefensiveSnapKV = kvevict::Policy<kvevict::SnapKV, kvevict::DefensiveSelector>;  // uniform base

// The hand-worked layer: H = 4, Hkv = 2 (G = 2), w = 4, L = 12, P = 8, kernel 1, attention in units of 1/32 (every
// window row of a query head the same, window mass on key 8); head_dim 1, W_o = [1 1 1 1] so N = |v|.
//   q0 [1 10 2 3 0 4 1 2 | 9], q1 [1 10 0 1 0 8 3 0 | 9]  -> M[0] = max = [1 10 2 3 0 8 3 2], mean 29/8 = 3.625
//   q2 [6 0 0 0 0 0 0 16 | 10], q3 [10 0 4 0 0 0 6 4 | 8] -> M[1] = [10 0 4 0 0 0 6 16], mean 36/8 = 4.5
//   floor: M[0] = [3.625 10 3.625 3.625 3.625 8 3.625 3.625], M[1] = [10 4.5 4.5 4.5 4.5 4.5 6 16]   (all / 32)
//   N[0] = [1 1 1 1 1 1 1 1], N[1] = [3 7 1 1 1 1 3 1] -> Nn[0] = [1/4 1/8 1/2 1/2 1/2 1/2 1/4 1/2], Nn[1] = 1 - Nn[0]
//   s'[0] = [.90625 1.25 1.8125 1.8125 1.8125 4 .90625 1.8125], s'[1] = [7.5 3.9375 2.25 2.25 2.25 2.25 4.5 8]
//   layer max 8 (KV 1, token 7). All of it exact in binary.
// Mass forcing (the numbers of test_mass_forcing.cpp): corrected window bias 9/32, threshold .9 -> tau .61875:
// KV 0 forces {1} (its s' is only 1.25: the value term says evict, the attention mass says keep), KV 1 forces {7};
// threshold 1.0 -> KV 0 {1, 5}. Quirk window bias 11/32 -> tau .55625: {1} and {7} as well.
kvevict_test::HandLayer& hand_layer() { return kvevict_test::defensive_hand_layer(); }

template <class P>
P hand_policy(bool quirks, bool floor = true, bool value_term = true, bool mass_forcing = true,
              double threshold = 0.9) {
  typename P::Params p;
  p.window = 4;
  p.kernel = 1;
  p.reference_quirks = quirks;
  p.floor = floor;
  p.value_term = value_term;
  p.mass_forcing = mass_forcing;
  p.mass_threshold = threshold;
  return P(p);
}

template <class P>
Kept run(const P& p, const Budget& b, const kvevict::LayerInputs<double>& in = hand_layer().in) {
  return kvevict_test::kept_of(p.template select<double>(in, b));
}

}  // namespace

TEST_CASE("DefensiveKV on a hand-worked 2-KV-head, 12-token layer, corrected mode", "[defensive_selector]") {
  using kvevict::DefensiveKV;
  // n_kept 6: total 12, cap 2. Forced {1} / {7} and the window rank above every score (10 entries), then the best two
  // s': 7.5 (KV 1, 0) and 4.5 (KV 1, 6). KV 0 keeps its forced token 1 although its s' (1.25) is low.
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(6)) == Kept{{1, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
  // Without mass forcing: the window, then 8 (1, 7), 7.5 (1, 0), 4.5 (1, 6), 4 (0, 5): token 1 of KV 0 goes.
  CHECK(run(hand_policy<DefensiveKV>(false, true, true, false), Budget::tokens(6)) ==
        Kept{{5, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
  // Threshold 1.0 forces KV 0 {1, 5}: 11 always-kept entries, then 7.5 (1, 0).
  CHECK(run(hand_policy<DefensiveKV>(false, true, true, true, 1.0), Budget::tokens(6)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // n_kept 7 (total 14): forced + window, then 7.5, 4.5, 4 (0, 5) and 3.9375 (1, 1); without the floor M[1][1] = 0 and
  // token 2 of KV 1 (M 4 x 1/2 = 2) takes its place.
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(7)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false, false), Budget::tokens(7)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 2, 6, 7, 8, 9, 10, 11}});
  // No value term (s' = M with the floor): after the 10 always-kept entries, M 10 (1, 0) and 8 (0, 5).
  CHECK(run(hand_policy<DefensiveKV>(false, true, false), Budget::tokens(6)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // n_kept 5: cap 1, forced + window = 10 = the total exactly. n_kept 4 = w: cap 0, the window alone.
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(5)) == Kept{{1, 8, 9, 10, 11}, {7, 8, 9, 10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(4)) == Kept{{8, 9, 10, 11}, {8, 9, 10, 11}});
  // n_kept < w: the most recent window tokens, ties between heads to the lower head: 3 -> {9, 10, 11}, 2 -> {10, 11}.
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(3)) == Kept{{9, 10, 11}, {9, 10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(2)) == Kept{{10, 11}, {10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::tokens(1)) == Kept{{11}, {11}});
  // Budgets are per head on average: the flat top-k gives KV 1 more than KV 0.
  const Selection s6 = hand_policy<DefensiveKV>(false).select<double>(hand_layer().in, Budget::tokens(6));
  CHECK(s6.lengths() == std::vector<std::int64_t>{5, 7});
  // The reference, fed with s' and the forced tokens written above, agrees (no tie with the layer max here).
  const std::vector<double> sp = {.90625 / 32, 1.25 / 32,   1.8125 / 32, 1.8125 / 32, 1.8125 / 32, 4. / 32,
                                  .90625 / 32, 1.8125 / 32, 7.5 / 32,    3.9375 / 32, 2.25 / 32,   2.25 / 32,
                                  2.25 / 32,   2.25 / 32,   4.5 / 32,    8. / 32};
  CHECK(kvevict_ref::defensivekv(sp, Forced{{1}, {7}}, 2, 4, 12, 6, 0.0, false, 0.0) ==
        Kept{{1, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
  CHECK(kvevict_ref::defensivekv(sp, Forced{{1}, {7}}, 2, 4, 12, 7, 0.0, false, 0.0) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
}

TEST_CASE("DefensiveKV on the hand-worked layer under reference_quirks: the flat total int(L (1 - cr) Hkv)",
          "[defensive_selector]") {
  using kvevict::DefensiveKV;
  const auto q = hand_policy<DefensiveKV>(true);
  // cr .35: n_kept = int(12 x .65) = 7, but the total is int(12 x .65 x 2) = int(15.6) = 15, not 14; cap =
  // int(8 x .65 - 4) = 1: forced {1}, {7}. Forced tokens and the window carry the layer max 8: 10 entries, then
  // 7.5 (1, 0), 4.5 (1, 6), 4 (0, 5), 3.9375 (1, 1), and one of the four 2.25 of KV 1 (the most recent, token 5).
  const Selection s35 = q.select<double>(hand_layer().in, Budget::compression_ratio(0.35));
  CHECK(s35.total() == 15);
  CHECK(kvevict_test::kept_of(s35) == Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 5, 6, 7, 8, 9, 10, 11}});
  // Corrected, same cr: total 14, cap 3 (forced {1}, {7} again) -> the same without (1, 5).
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::compression_ratio(0.35)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  // cr .45: n_kept 6, total int(13.2) = 13, cap int(.4) = 0 (nothing forced): the 8 window entries at the layer max
  // tie with (1, 7) itself (9 entries), then 7.5, 4.5, 4, 3.9375. Token 1 of KV 0 is not forced and is evicted.
  const Selection s45 = q.select<double>(hand_layer().in, Budget::compression_ratio(0.45));
  CHECK(s45.total() == 13);
  CHECK(kvevict_test::kept_of(s45) == Kept{{5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  // cr .7 (short budget): n_kept = int(3.6) = 3, total int(7.2) = 7, cap int(2.4 - 4) = -1: every token but the last
  // of each head's mass order is forced to the layer max, but the window ties them and is more recent:
  // (11, 0) (11, 1) (10, 0) (10, 1) (9, 0) (9, 1) (8, 0). Corrected: 6 entries, the window's most recent.
  CHECK(run(q, Budget::compression_ratio(0.7)) == Kept{{8, 9, 10, 11}, {9, 10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), Budget::compression_ratio(0.7)) == Kept{{9, 10, 11}, {9, 10, 11}});
  // The reference agrees on the quirk totals.
  const std::vector<double> sp = {.90625 / 32, 1.25 / 32,   1.8125 / 32, 1.8125 / 32, 1.8125 / 32, 4. / 32,
                                  .90625 / 32, 1.8125 / 32, 7.5 / 32,    3.9375 / 32, 2.25 / 32,   2.25 / 32,
                                  2.25 / 32,   2.25 / 32,   4.5 / 32,    8. / 32};
  CHECK(kvevict_ref::defensivekv(sp, Forced{{1}, {7}}, 2, 4, 12, 7, 0.0, true, 0.35) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 5, 6, 7, 8, 9, 10, 11}});
  CHECK(kvevict_ref::defensivekv(sp, Forced{{}, {}}, 2, 4, 12, 6, 0.0, true, 0.45) ==
        Kept{{5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  // Quirks need the budget as a compression ratio.
  for (const Budget& b : {Budget::tokens(6), Budget::keep_ratio(0.5)})
    REQUIRE_THROWS_MATCHES(q.select<double>(hand_layer().in, b), kvevict::invalid_argument,
                           MessageContains("::select: reference_quirks needs the budget as a compression ratio"));
}

TEST_CASE("DefensiveKV quirks on a short context: the negative cap forces a low-scored token over the best one",
          "[defensive_selector]") {
  // H = Hkv = 2 (G = 1), w = 4, L = 10, P = 6, kernel 1, values all 1 (Nn = 1/2 everywhere), rows in 1/32:
  //   q0 [12 0 1 0 2 1 | 16], q1 [2 1 0 9 3 1 | 16] -> M (floor at 16/6) [12 8/3 8/3 8/3 8/3 8/3], [8/3 8/3 8/3 9 3
  //   8/3] s' = M / 2, layer max 6/32 (KV 0, token 0).
  // Mass order (ties: the more recent first): KV 0: 0, 4, 5, 2, 3, 1; KV 1: 3, 4, 0, 5, 1, 2.
  const Shape s{2, 2, 4, 10, 1};
  const kvevict_test::HandLayer layer(
      s, kvevict_test::repeated_rows({{12, 0, 1, 0, 2, 1, 16, 0, 0, 0}, {2, 1, 0, 9, 3, 1, 16, 0, 0, 0}}, 4, 32.0),
      std::vector<double>(20, 1.0), {1, 1});
  // Quirks, cr .5: n_kept 5, total int(10 x .5 x 2) = 10, cap int(6 x .5 - 4) = -1: all but the last of each order is
  // forced to the layer max: KV 0 {0, 2, 3, 4, 5}, KV 1 {0, 1, 3, 4, 5}. With the 8 window entries, 18 entries tie at
  // 6/32 and the most recent win: the window and token 5 of both heads. KV 0's best token 0 (s' 6/32) is evicted
  // for its token 5 (s' 4/3 / 32).
  CHECK(run(hand_policy<kvevict::DefensiveKV>(true), Budget::compression_ratio(0.5), layer.in) ==
        Kept{{5, 6, 7, 8, 9}, {5, 6, 7, 8, 9}});
  // Corrected: cap 1, tau = .9 - .5 = .4 is crossed at index 0 in both heads (12/16 and 9/16): nothing forced; the
  // window, then the best s': (0, 0) 6 and (1, 3) 4.5.
  CHECK(run(hand_policy<kvevict::DefensiveKV>(false), Budget::compression_ratio(0.5), layer.in) ==
        Kept{{0, 6, 7, 8, 9}, {3, 6, 7, 8, 9}});
  const Forced f = kvevict_ref::mass_forced(layer.attn, 2, 2, 4, 10, 0.9, 5, true, 0.5);
  CHECK(f == Forced{{0, 2, 3, 4, 5}, {0, 1, 3, 4, 5}});
}

TEST_CASE("AdaKVDefensive and the DefensiveSelector on the AdaKV and SnapKV bases, hand-worked",
          "[defensive_selector]") {
  // AdaKVDefensive = AdaKV with s' = M (floor, no value term, no forcing). n_kept 6: safeguard int(1.2) = 1 -> token 11
  // of each head; flat top-12: 2 + 6 window, then M 16 (1, 7), 10 (0, 1) and 10 (1, 0) (tie: token 1 first), 8 (0, 5).
  kvevict::AdaKVDefensive::Params p;
  p.window = 4;
  p.kernel = 1;
  CHECK(p.alpha == 0.2);
  CHECK_FALSE(p.value_term);
  CHECK_FALSE(p.mass_forcing);
  CHECK(p.floor);
  const kvevict::AdaKVDefensive ablation(p);
  CHECK(run(ablation, Budget::tokens(6)) == Kept{{1, 5, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // AdaKVDefensive doesn't read values or W_o.
  kvevict::LayerInputs<double> attention_only = hand_layer().in;
  attention_only.values = {};
  attention_only.w_o = {};
  CHECK(run(ablation, Budget::tokens(6), attention_only) == Kept{{1, 5, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // Quirks, cr .45: total 13 (the flat-total quirk applies to the DefensiveSelector whatever its toggles); the window
  // at the layer max 16: 2 safeguard + 6 window + (1, 7), then 10, 10, 8 and 6 (1, 6).
  p.reference_quirks = true;
  CHECK(run(kvevict::AdaKVDefensive(p), Budget::compression_ratio(0.45)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
  CHECK(kvevict_ref::defensivekv({3.625, 10, 3.625, 3.625, 3.625, 8, 3.625, 3.625, 10, 4.5, 4.5, 4.5, 4.5, 4.5, 6, 16},
                                 Forced{}, 2, 4, 12, 6, 0.2, true,
                                 0.45) == Kept{{1, 5, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});

  // Uniform base, corrected, n_kept 6: each head keeps its forced token, the window and its best other s':
  // KV 0 {1} + 4 (token 5); KV 1 {7} + 7.5 (token 0).
  CHECK(run(hand_policy<DefensiveSnapKV>(false), Budget::tokens(6)) ==
        Kept{{1, 5, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // Uniform, quirks, cr .45 (n_kept 6, nothing forced): per head the window (at the layer max) and the best two:
  // KV 0: 4 (token 5), then the four 1.8125 tie -> token 7; KV 1: 8 (token 7, ties the max), 7.5 (token 0).
  CHECK(run(hand_policy<DefensiveSnapKV>(true), Budget::compression_ratio(0.45)) ==
        Kept{{5, 7, 8, 9, 10, 11}, {0, 7, 8, 9, 10, 11}});
  // AdaKV base with the full selector, corrected, n_kept 6: safeguard 11; forced {1}, {7}; then 7.5, 4.5.
  CHECK(run(hand_policy<DefensiveAdaKV>(false), Budget::tokens(6)) == Kept{{1, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
}

namespace {

struct Counters {
  int cases = 0, skipped = 0;
  int forms[3] = {0, 0, 0};  // compared cases per budget form: tokens, keep_ratio, compression_ratio
};

// The variants of the sweep: a DefensiveSelector on a base, with its knobs.
struct Variant {
  DefBase base;
  SelKnobs knobs;
};

template <class P>
Kept select_variant(const Shape& s, const SelKnobs& k, const kvevict::LayerInputs<double>& in, const Budget& b) {
  return kvevict_test::kept_of(kvevict_test::make_policy<P>(s, k).template select<double>(in, b));
}

Kept select_variant(const Variant& v, const Shape& s, const kvevict::LayerInputs<double>& in, const Budget& b) {
  if (v.base == DefBase::flat) return select_variant<kvevict::DefensiveKV>(s, v.knobs, in, b);
  if (v.base == DefBase::adaptive) return select_variant<DefensiveAdaKV>(s, v.knobs, in, b);
  return select_variant<DefensiveSnapKV>(s, v.knobs, in, b);
}

void sweep_shape(const Shape& s, const std::vector<Variant>& variants, Rng& rng, int max_budgets, Counters& c) {
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 12, rng);
  const std::vector<double> attn = kvevict_test::ref_attention(l);
  const auto from_q = kvevict_test::store_v<double>(l, c.cases % 2 ? Layout::heads_major : Layout::tokens_major);
  const auto from_a = kvevict_test::store_v<double>(l, Layout::tokens_major, &attn);
  const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, sz(max_budgets));
  for (const Variant& v0 : variants)
    for (bool quirks : {false, true}) {
      Variant v = v0;
      v.knobs.quirks = quirks;
      const SelKnobs& k = v.knobs;
      const kvevict_test::RefLayer r = kvevict_test::ref_layer(l, attn, k);
      const bool near_tie = k.mass_forcing && kvevict_test::mass_margin(attn, s, k.threshold, quirks) < 1e-9;
      for (std::int64_t n : budgets) {
        // Corrected: each budget in one of the three forms, in turn. Quirks: the compression ratio (the other forms
        // must be refused).
        const std::vector<kvevict_test::FormedBudget> forms = kvevict_test::budget_forms(n, s.L);
        const std::size_t pick = quirks ? forms.size() - 1 : sz(c.cases) % forms.size();
        for (std::size_t fi = 0; fi < forms.size(); ++fi) {
          const kvevict_test::FormedBudget& b = forms[fi];
          INFO(kvevict_test::describe(s) << " base " << kvevict_test::to_string(v.base) << " "
                                         << kvevict_test::describe(k) << " budget " << b.form
                                         << " n_kept=" << b.n_kept);
          const kvevict::LayerInputs<double>& in = b.form == "keep_ratio" ? from_a.in : from_q.in;
          if (quirks && b.form != "compression_ratio") {
            REQUIRE_THROWS_MATCHES(select_variant(v, s, in, b.budget), kvevict::invalid_argument,
                                   MessageContains("reference_quirks needs the budget as a compression ratio"));
            continue;
          }
          if (fi != pick || (quirks && b.form != "compression_ratio")) continue;
          ++c.cases;
          ++c.forms[b.form == "tokens" ? 0 : b.form == "keep_ratio" ? 1 : 2];
          if (near_tie) {
            ++c.skipped;
            continue;
          }
          const Forced f = kvevict_test::ref_forced(r, s, k, b.n_kept, b.cr);
          const Kept want = kvevict_test::expect_defensive(r, f, s, b.n_kept, v.base, k, b.cr);
          REQUIRE(kvevict_test::first_difference(select_variant(v, s, in, b.budget), want) == "");
        }
      }
    }
}

}  // namespace

TEST_CASE(
    "DefensiveKV, AdaKVDefensive and the DefensiveSelector on every base select<double> like the reference "
    "(both modes, toggles, budget forms)",
    "[defensive_selector]") {
  Rng rng(801);
  Counters c;
  SelKnobs def;  // DefensiveKV's defaults: flat (alpha 0), value term, forcing, floor
  def.alpha = 0.0;
  SelKnobs ablation;  // AdaKVDefensive
  ablation.value_term = false;
  ablation.mass_forcing = false;
  auto with = [](SelKnobs k, auto f) {
    f(k);
    return k;
  };
  const std::vector<std::vector<Variant>> rounds = {
      {{DefBase::flat, def}, {DefBase::adaptive, ablation}, {DefBase::uniform, def}},
      {{DefBase::flat, with(def, [](SelKnobs& k) { k.floor = false; })},
       {DefBase::adaptive, with(def, [](SelKnobs& k) { k.alpha = 0.2; })}},
      {{DefBase::flat, with(def, [](SelKnobs& k) { k.value_term = false; })},
       {DefBase::uniform, with(def, [](SelKnobs& k) { k.mass_forcing = false; })}},
      {{DefBase::flat, with(def,
                            [](SelKnobs& k) {
                              k.norm = ValueNorm::l2;
                              k.threshold = 0.5;
                            })},
       {DefBase::adaptive, with(ablation,
                                [](SelKnobs& k) {
                                  k.floor = false;
                                  k.alpha = 0.5;
                                })}},
      {{DefBase::flat, with(def,
                            [](SelKnobs& k) {
                              k.mass_forcing = false;
                              k.kernel = 7;
                              k.pooling = Pooling::max;
                            })},
       {DefBase::uniform, with(def,
                               [](SelKnobs& k) {
                                 k.threshold = 1.0;
                                 k.kernel = 1;
                               })}},
  };
  const Shape shapes[] = {{1, 1, 1, 2, 16},  {2, 1, 4, 5, 16},  {8, 2, 32, 33, 16},  {8, 8, 4, 40, 16},
                          {4, 4, 4, 64, 64}, {8, 1, 4, 90, 16}, {4, 2, 32, 120, 16}, {2, 2, 4, 1500, 16}};
  const std::pair<int, Pooling> pools[] = {{5, Pooling::avg}, {7, Pooling::max}, {1, Pooling::avg}, {5, Pooling::max}};
  int i = 0;
  for (const Shape& s : shapes) {
    std::vector<Variant> vs = rounds[sz(i) % rounds.size()];
    for (Variant& v : vs)
      if (v.knobs.kernel == 5 && v.knobs.pooling == Pooling::avg) {
        v.knobs.kernel = pools[sz(i) % 4].first;
        v.knobs.pooling = pools[sz(i) % 4].second;
      }
    sweep_shape(s, vs, rng, s.L > 1000 ? 2 : 4, c);
    ++i;
  }
  for (int t = 0; t < 6; ++t) {
    Shape s = kvevict_test::random_shape(rng, 100);
    if (s.d == 128) s.d = 16;
    sweep_shape(s, rounds[sz(t) % rounds.size()], rng, 3, c);
  }
  INFO("cases " << c.cases << ", skipped as mass near-ties " << c.skipped);
  CHECK(c.cases > 150);
  CHECK(c.forms[0] >= 15);
  CHECK(c.forms[1] >= 15);
  CHECK(c.forms[2] >= 50);
  CHECK(c.skipped * 20 <= c.cases);
}

TEST_CASE("DefensiveKV family on quantised attention (exact ties everywhere) matches the reference",
          "[defensive_selector]") {
  // Every window row puts 1/8 on m random prefix tokens (m a power of two, repeats allowed) and multiples of 1/8 on the
  // window; kernel 1, G * w a power of two, values 1 or 2: the aggregation (R = A exactly, also in the reference's
  // (x / sum) * mass), the floor, the value term and the mass forcing compute the same doubles in both
  // implementations, so ties (also with the layer max) are exact ties.
  Rng rng(802);
  for (int t = 0; t < 16; ++t) {
    Shape s = kvevict_test::random_shape(rng, 80);
    s.d = 1;
    std::vector<double> attn(sz(s.H * s.w * s.L), 0.0);
    std::uniform_int_distribution<int> token(0, s.P() - 1), window_units(0, 3), spikes(0, 3);
    for (int row = 0; row < s.H * s.w; ++row) {
      const int m = 1 << spikes(rng);
      for (int e = 0; e < m; ++e) attn[sz(row * s.L + token(rng))] += 0.125;
      for (int j = s.P(); j < s.L; ++j) attn[sz(row * s.L + j)] = 0.125 * window_units(rng);
    }
    kvevict_test::VLayer l;
    l.s = s;
    l.D = 1;
    l.k.assign(sz(s.Hkv * s.L), 0.0);
    l.v.assign(sz(s.Hkv * s.L), 1.0);
    for (int h = 0; h < s.Hkv; ++h) l.v[sz(h * s.L + t % s.L)] = 2.0;  // a few different norms (still exact: 1/3, 2/3)
    l.w_o.assign(sz(s.H), 1.0);
    const auto st = kvevict_test::store_v<double>(l, Layout::heads_major, &attn);
    for (bool quirks : {false, true}) {
      SelKnobs k;
      k.kernel = 1;
      k.alpha = 0.0;
      k.quirks = quirks;
      k.floor = t % 2 == 0;
      const kvevict_test::RefLayer r = kvevict_test::ref_layer(l, attn, k);
      for (std::int64_t n : kvevict_test::budget_sweep(s, rng)) {
        const double cr = 1.0 - static_cast<double>(n) / s.L;
        if (!(cr >= 0.0 && cr < 1.0)) continue;
        const kvevict::Budget b = Budget::compression_ratio(cr);
        const std::int64_t nk = kvevict_ref::n_kept_from_compression_ratio(s.L, cr);
        if (nk < 1) continue;
        INFO(kvevict_test::describe(s) << " quirks=" << quirks << " floor=" << k.floor << " n_kept=" << nk);
        const Forced f = kvevict_test::ref_forced(r, s, k, nk, cr);
        const Kept want = kvevict_test::expect_defensive(r, f, s, nk, DefBase::flat, k, cr);
        CHECK(kvevict_test::first_difference(select_variant(Variant{DefBase::flat, k}, s, st.in, b), want) == "");
      }
    }
  }
}

TEST_CASE(
    "DefensiveKV family: budget accounting, window and forced tokens kept, order, determinism, layouts, routes, "
    "composition (float)",
    "[defensive_selector]") {
  Rng rng(803);
  std::vector<Shape> shapes = {{8, 2, 32, 33, 16}, {4, 4, 1, 2, 16}, {8, 1, 4, 500, 16}};
  for (int i = 0; i < 5; ++i) {
    Shape s = kvevict_test::random_shape(rng, 120);
    if (s.d == 128) s.d = 16;
    shapes.push_back(s);
  }
  for (const Shape& s : shapes) {
    const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 16, rng);
    const auto hm = kvevict_test::store_v<float>(l, Layout::heads_major);
    const auto tm = kvevict_test::store_v<float>(l, Layout::tokens_major);
    const std::vector<float> rows = kvevict_test::library_attention<float, float>(hm.in.queries, hm.in.keys);
    const std::vector<double> rows_d = kvevict_test::to_double(rows);
    const auto ha = kvevict_test::store_v<float>(l, Layout::heads_major, &rows_d);
    SelKnobs k;
    k.alpha = 0.0;
    const auto flat = kvevict_test::make_policy<kvevict::DefensiveKV>(s, k);
    const auto composed_flat =
        kvevict_test::make_policy<kvevict::Policy<kvevict::HeadAdaptiveAllocation, kvevict::DefensiveSelector>>(s, k);
    const auto uniform = kvevict_test::make_policy<DefensiveSnapKV>(s, k);
    SelKnobs ka;
    ka.value_term = ka.mass_forcing = false;
    const auto ablation = kvevict_test::make_policy<kvevict::AdaKVDefensive>(s, ka);
    const auto composed_ablation = kvevict_test::make_policy<DefensiveAdaKV>(s, ka);
    const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, 4);
    for (std::int64_t n : budgets) {
      INFO(kvevict_test::describe(s) << " n_kept=" << n);
      const Budget b = Budget::tokens(n);
      const Selection f = flat.select(hm.in, b), u = uniform.select(hm.in, b), a = ablation.select(hm.in, b);
      for (const Selection* x : {&f, &u, &a}) {
        REQUIRE(kvevict_test::structure_errors(*x, s.Hkv, s.L) == "");
        CHECK(kvevict_test::mask_errors(*x) == "");
      }
      CHECK(f.total() == s.Hkv * n);
      CHECK(a.total() == s.Hkv * n);
      for (Index h = 0; h < s.Hkv; ++h) CHECK(u.length(h) == n);
      for (Index h = 0; h < s.Hkv; ++h) {
        const Index from = n >= s.w ? s.P() : s.L - n;
        for (Index j = from; j < s.L; ++j) {
          CHECK(f.kept(h, j));
          CHECK(u.kept(h, j));
          CHECK(a.kept(h, j));
        }
      }
      // Corrected mode: the mass-forced tokens are kept strictly first, on every base (they fit: at most n - w per
      // head). Forced sets are the reference's on the library's own float rows; a near-tie at tau is skipped.
      if (n >= s.w && kvevict_test::mass_margin(rows_d, s, k.threshold, false) > 1e-5) {
        const Forced forced = kvevict_ref::mass_forced(rows_d, s.H, s.Hkv, s.w, s.L, k.threshold, n, false, 0.0);
        for (Index h = 0; h < s.Hkv; ++h)
          for (std::int64_t j : forced[sz(h)]) {
            CHECK(f.kept(h, j));
            CHECK(u.kept(h, j));
          }
      }
      const Kept kf = kvevict_test::kept_of(f), ku = kvevict_test::kept_of(u), ka_ = kvevict_test::kept_of(a);
      CHECK(kvevict_test::kept_of(flat.select(hm.in, b)) == kf);
      CHECK(kvevict_test::kept_of(flat.select(tm.in, b)) == kf);
      CHECK(kvevict_test::kept_of(flat.select(ha.in, b)) == kf);
      CHECK(kvevict_test::kept_of(uniform.select(tm.in, b)) == ku);
      CHECK(kvevict_test::kept_of(uniform.select(ha.in, b)) == ku);
      CHECK(kvevict_test::kept_of(ablation.select(tm.in, b)) == ka_);
      CHECK(kvevict_test::kept_of(ablation.select(ha.in, b)) == ka_);
      CHECK(kvevict_test::kept_of(composed_flat.select(hm.in, b)) == kf);
      CHECK(kvevict_test::kept_of(composed_ablation.select(hm.in, b)) == ka_);
      // Quirk totals: int(L (1 - cr) Hkv) for every DefensiveSelector on a flat or adaptive base.
      const double cr = 1.0 - static_cast<double>(n) / s.L;
      if (cr >= 0.0 && cr < 1.0 && kvevict_ref::n_kept_from_compression_ratio(s.L, cr) >= 1) {
        SelKnobs kq = k;
        kq.quirks = true;
        const auto total = static_cast<Index>(static_cast<double>(s.L) * (1.0 - cr) * static_cast<double>(s.Hkv));
        CHECK(kvevict_test::make_policy<kvevict::DefensiveKV>(s, kq)
                  .select(hm.in, Budget::compression_ratio(cr))
                  .total() == total);
        ka.quirks = true;
        CHECK(kvevict_test::make_policy<kvevict::AdaKVDefensive>(s, ka)
                  .select(hm.in, Budget::compression_ratio(cr))
                  .total() == total);
        ka.quirks = false;
        const Selection uq =
            kvevict_test::make_policy<DefensiveSnapKV>(s, kq).select(hm.in, Budget::compression_ratio(cr));
        for (Index h = 0; h < s.Hkv; ++h) CHECK(uq.length(h) == kvevict_ref::n_kept_from_compression_ratio(s.L, cr));
      }
    }
  }
  // L = 1000, cr = .8, Hkv = 2: n_kept 199; corrected total 398, quirks int(1000 x .2 x 2) = int(399.99999999999994) =
  // 399 (docs/algorithms.md#budgets).
  Rng r2(804);
  const Shape big{2, 2, 32, 1000, 16};
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(big, 8, r2);
  const std::vector<double> attn = kvevict_test::ref_attention(l);
  const auto st = kvevict_test::store_v<double>(l, Layout::heads_major, &attn);
  SelKnobs k;
  k.alpha = 0.0;
  CHECK(kvevict_test::make_policy<kvevict::DefensiveKV>(big, k)
            .select<double>(st.in, Budget::compression_ratio(0.8))
            .total() == 398);
  k.quirks = true;
  CHECK(kvevict_test::make_policy<kvevict::DefensiveKV>(big, k)
            .select<double>(st.in, Budget::compression_ratio(0.8))
            .total() == 399);
}

TEST_CASE("DefensiveKV parameters: defaults and validation", "[defensive_selector]") {
  const kvevict::DefensiveKV d;
  CHECK(d.params().alpha == 0.0);
  CHECK(d.params().mass_threshold == 0.9);
  CHECK(d.params().value_norm == ValueNorm::l1);
  CHECK(d.params().value_term);
  CHECK(d.params().mass_forcing);
  CHECK(d.params().floor);
  CHECK(d.params().window == 32);
  CHECK(d.params().kernel == 5);
  CHECK(d.params().pooling == Pooling::avg);
  const kvevict::AdaKVDefensive a;
  CHECK(a.params().alpha == 0.2);
  CHECK_FALSE(a.params().value_term);
  CHECK_FALSE(a.params().mass_forcing);
  for (double t :
       {-0.01, 1.01, 5.0, std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()}) {
    kvevict::DefensiveKV::Params p;
    p.mass_threshold = t;
    REQUIRE_THROWS_MATCHES(kvevict::DefensiveKV(p), kvevict::invalid_argument,
                           MessageContains("kvevict::DefensiveKV::Params: mass_threshold must be in [0, 1], got "));
    kvevict::LayerDefensiveKV::Params q;
    q.mass_threshold = t;
    REQUIRE_THROWS_MATCHES(kvevict::LayerDefensiveKV(q), kvevict::invalid_argument,
                           MessageContains("kvevict::LayerDefensiveKV::Params: mass_threshold must be in [0, 1]"));
  }
  for (double t : {0.0, 1.0}) {
    kvevict::DefensiveKV::Params p;
    p.mass_threshold = t;
    CHECK_NOTHROW(kvevict::DefensiveKV(p));
  }
}

TEST_CASE("value-aware selectors: missing or mismatched values / W_o and NaN values give a clear error",
          "[defensive_selector][errors]") {
  Rng rng(805);
  const Shape s{4, 2, 4, 40, 8};
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 6, rng);
  SelKnobs k;
  const auto critical = kvevict_test::make_policy<kvevict::CriticalKV>(s, k);
  const auto critical_snap = kvevict_test::make_policy<kvevict::CriticalSnapKV>(s, k);
  const auto defensive = kvevict_test::make_policy<kvevict::DefensiveKV>(s, k);
  const auto layer = kvevict_test::make_policy<kvevict::LayerDefensiveKV>(s, k);
  SelKnobs no_value = k;
  no_value.value_term = false;
  const auto defensive_no_value = kvevict_test::make_policy<kvevict::DefensiveKV>(s, no_value);
  const Budget b = Budget::tokens(10);
  auto all_throw = [&](const kvevict::LayerInputs<float>& in, const std::string& message) {
    REQUIRE_THROWS_MATCHES(critical.select(in, b), kvevict::invalid_argument, MessageContains(message));
    REQUIRE_THROWS_MATCHES(critical_snap.select(in, b), kvevict::invalid_argument, MessageContains(message));
    REQUIRE_THROWS_MATCHES(defensive.select(in, b), kvevict::invalid_argument, MessageContains(message));
    REQUIRE_THROWS_MATCHES(layer.select(std::vector<kvevict::LayerInputs<float>>{in}, b), kvevict::invalid_argument,
                           MessageContains(message));
  };
  SECTION("missing values") {
    auto st = kvevict_test::store_v<float>(l, Layout::heads_major);
    st.in.values = {};
    all_throw(st.in, "this policy needs values [kv_heads, tokens, head_dim] (LayerInputs::values)");
    CHECK(defensive_no_value.select(st.in, b).total() == 2 * 10);  // the ablation reads neither
  }
  SECTION("missing W_o") {
    auto st = kvevict_test::store_v<float>(l, Layout::tokens_major);
    st.in.w_o = {};
    all_throw(st.in, "this policy needs w_o [hidden, H * head_dim] (LayerInputs::w_o, built with output_projection())");
    CHECK(defensive_no_value.select(st.in, b).total() == 2 * 10);
  }
  SECTION("W_o with the wrong number of columns (heads or head_dim)") {
    auto st = kvevict_test::store_v<float>(l, Layout::heads_major);
    st.in.w_o = kvevict::output_projection<const float>(st.w_o.data(), 6, 2, 8);  // 16 columns seen, H * d = 32
    all_throw(st.in, "w_o must have H * head_dim = 4 * 8 columns, got 2 * 8");
    st.in.w_o = kvevict::output_projection<const float>(st.w_o.data(), 3, 4, 16);  // head_dim 16 != 8
    all_throw(st.in, "w_o must have H * head_dim = 4 * 8 columns, got 4 * 16");
  }
  SECTION("values that disagree with the keys") {
    auto st = kvevict_test::store_v<float>(l, Layout::heads_major);
    st.in.values = kvevict::kv_heads_major<const float>(st.v.data(), 2, 39, 8);
    all_throw(st.in, "values [2, 39, 8] must have the keys' KV heads (2) and tokens (40)");
  }
  SECTION("NaN or Inf in values or W_o, anywhere (prefix or window token)") {
    for (int where : {3, 37}) {  // token 3 is in the prefix, token 37 in the window
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        INFO("token " << where << " value " << bad);
        kvevict_test::VLayer poisoned = l;
        poisoned.v[sz((1 * s.L + where) * s.d + 2)] = static_cast<double>(bad);  // KV head 1
        const auto st = kvevict_test::store_v<float>(poisoned, Layout::heads_major);
        all_throw(st.in, "is not finite");
        REQUIRE_THROWS_MATCHES(critical.select<double>(st.in, b), kvevict::invalid_argument,
                               MessageContains("the inputs contain NaN or Inf values"));
        SelKnobs l2 = k;
        l2.norm = ValueNorm::l2;
        REQUIRE_THROWS_MATCHES(kvevict_test::make_policy<kvevict::DefensiveKV>(s, l2).select(st.in, b),
                               kvevict::invalid_argument, MessageContains("is not finite"));
        REQUIRE_THROWS_MATCHES(kvevict_test::make_policy<kvevict::CriticalKV>(s, l2).select(st.in, b),
                               kvevict::invalid_argument, MessageContains("is not finite"));
      }
    }
    kvevict_test::VLayer poisoned = l;
    poisoned.w_o[5] = std::numeric_limits<double>::quiet_NaN();
    all_throw(kvevict_test::store_v<float>(poisoned, Layout::heads_major).in, "is not finite");
  }
}

TEST_CASE(
    "Single-layer DefensiveKV keeps forced and window tokens first in the corrected mode, and under quirks a more "
    "recent token tied at the layer maximum displaces a forced one",
    "[defensive_selector][ruling]") {
  // One KV head, two query heads (G = 2), L = 10, w = 1 (P = 9, window = token 9), kernel 1 (no smoothing).
  //   query head 0: token 5 = .5, token 7 = .5        query head 1: token 5 = .5, token 7 = .3, token 9 = .2
  // Mass forcing: p (mean over heads, normalised over the prefix) is 5/9 for token 5, 4/9 for token 7. Corrected
  // tau = .9 - (0 + .2) / 2 = .8; quirks tau = .9 - (mass on token 8 = 0) = .9. Either way c = 5/9, 1 reaches tau
  // at index 1: token 5 alone is forced (cap 1 in both modes below).
  // Defensive aggregation: M = max over heads = .5 for tokens 5 and 7, the floor 1/9 elsewhere; with one KV head the
  // normalised value term is exactly 1, so s' = M and tokens 5 and 7 tie at the layer maximum .5.
  // Budget: n_kept = 2 (cr .75 under quirks: n_kept int(2.5) = 2, total 2, cap int(9 * .25 - 1) = 1).
  //   corrected: forced token 5 and the window are kept in tiers above every score     -> {5, 9}
  //   quirks:    5, 7 and 9 all carry .5; exact ties go to the more recent: 9, 7        -> {7, 9}
  constexpr Index H = 2, L = 10, w = 1, d = 4, D = 6;
  std::vector<double> attention(H * L, 0.0);
  attention[5] = 0.5;
  attention[7] = 0.5;
  attention[L + 5] = 0.5;
  attention[L + 7] = 0.3;
  attention[L + 9] = 0.2;
  std::vector<double> keys(L * d, 0.25), values(L * d), w_o(D * H * d);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.1 + 0.01 * static_cast<double>(i);
  for (std::size_t i = 0; i < w_o.size(); ++i) w_o[i] = 0.3 - 0.02 * static_cast<double>(i);
  kvevict::LayerInputs<double> in;
  in.attention = kvevict::HeadsView<const double>::heads_major(attention.data(), H, w, L);
  in.keys = kvevict::kv_heads_major<const double>(keys.data(), 1, L, d);
  in.values = kvevict::kv_heads_major<const double>(values.data(), 1, L, d);
  in.w_o = kvevict::output_projection<const double>(w_o.data(), D, H, d);
  kvevict::DefensiveKV::Params p;
  p.window = w;
  p.kernel = 1;
  CHECK(kvevict_test::kept_of(kvevict::DefensiveKV(p).select<double>(in, Budget::tokens(2))) == Kept{{5, 9}});
  CHECK(kvevict_test::kept_of(kvevict::DefensiveKV(p).select<float>(in, Budget::tokens(2))) == Kept{{5, 9}});
  p.reference_quirks = true;
  CHECK(kvevict_test::kept_of(kvevict::DefensiveKV(p).select<double>(in, Budget::compression_ratio(0.75))) ==
        Kept{{7, 9}});
  // The reference agrees in both modes.
  const std::vector<double> sprime = {1. / 9, 1. / 9, 1. / 9, 1. / 9, 1. / 9, 0.5, 1. / 9, 0.5, 1. / 9};
  CHECK(kvevict_ref::defensivekv(sprime, Forced{{5}}, 1, w, L, 2, 0.0, false, 0.0) == Kept{{5, 9}});
  CHECK(kvevict_ref::defensivekv(sprime, Forced{{5}}, 1, w, L, 2, 0.0, true, 0.75) == Kept{{7, 9}});
  // Layer-global (one layer) keeps forced tokens first as well.
  kvevict::LayerDefensiveKV::Params lp;
  lp.window = w;
  lp.kernel = 1;
  CHECK(kvevict_test::kept_of(kvevict::LayerDefensiveKV(lp).select<double>(
            std::vector<kvevict::LayerInputs<double>>{in}, Budget::tokens(2))[0]) == Kept{{5, 9}});
}

}  // namespace test_defensive_selector
