// allocation/layer_global.hpp (LayerGlobalAllocation; LayerGlobalPolicy is Policy over it): one top-k over every
// layer of the model (docs/algorithms.md#allocation layer-global, docs/algorithms.md#forcing layer-global forcing):
// Layer-DefensiveKV and LayerGlobalPolicy<CriticalSelector> against hand-worked selections and the float64 reference in
// both quirk modes; Plan (score, then apply); properties.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/same_selection.hpp"
#include "support/selector_inputs.hpp"

namespace test_layer_global {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Pooling;
using kvevict::Selection;
using kvevict::ValueNorm;
using kvevict::extend::ScoreMap;
using kvevict::extend::Tier;
using kvevict_test::Forced;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

using Budgets = std::vector<std::vector<Index>>;

ScoreMap<double> map_of(const std::vector<double>& scores, Index heads, Index tokens) {
  ScoreMap<double> m(heads, tokens);
  for (std::size_t f = 0; f < scores.size(); ++f) m.score[f] = scores[f];
  return m;
}

using kvevict_test::same;

Budgets allocate(const std::vector<ScoreMap<double>>& maps, Index total) {
  std::vector<const ScoreMap<double>*> ptrs;
  for (const auto& m : maps) ptrs.push_back(&m);
  return kvevict::extend::allocate_layer_global(ptrs, total);
}

}  // namespace

TEST_CASE("allocate_layer_global: one top-k over all layers, tiers first, ties by position, layer, head",
          "[layer_global]") {
  // Layer 0: 2 heads x 3 tokens; layer 1: 1 head x 4 tokens.
  std::vector<ScoreMap<double>> maps = {map_of({0.5, 0.1, 0.3, 0.2, 0.9, 0.4}, 2, 3),
                                        map_of({0.6, 0.7, 0.05, 0.8}, 1, 4)};
  // Order: .9 (L0 h1 j1), .8 (L1 j3), .7 (L1 j1), .6 (L1 j0), .5 (L0 h0 j0), .4 (L0 h1 j2), .3, .2, .1, .05.
  CHECK(allocate(maps, 0) == Budgets{{0, 0}, {0}});
  CHECK(allocate(maps, 1) == Budgets{{0, 1}, {0}});
  CHECK(allocate(maps, 4) == Budgets{{0, 1}, {3}});
  CHECK(allocate(maps, 6) == Budgets{{1, 2}, {3}});
  CHECK(allocate(maps, 10) == Budgets{{3, 3}, {4}});
  // Promoted entries come first whatever their score, in the tiers of every top-k: the window (even older), then
  // the forced entries, then the scored ones (docs/algorithms.md#ties).
  maps[0].promote(0, 1, Tier::forced);               // L0 h0 j1 (.1), position 1
  maps[1].promote(0, 0, Tier::window);               // L1 j0 (.6), position 0
  CHECK(allocate(maps, 1) == Budgets{{0, 0}, {1}});  // the window beats the more recent forced entry
  CHECK(allocate(maps, 2) == Budgets{{1, 0}, {1}});
  CHECK(allocate(maps, 3) == Budgets{{1, 1}, {1}});  // then .9
  // Exact ties between layers and heads: position first, then the lower layer, then the lower head.
  std::vector<ScoreMap<double>> tied = {map_of({1, 1, 1, 1}, 2, 2), map_of({1, 1, 1, 1}, 2, 2)};
  CHECK(allocate(tied, 1) == Budgets{{1, 0}, {0, 0}});
  CHECK(allocate(tied, 2) == Budgets{{1, 1}, {0, 0}});
  CHECK(allocate(tied, 3) == Budgets{{1, 1}, {1, 0}});
  CHECK(allocate(tied, 5) == Budgets{{2, 1}, {1, 1}});
  // Layers of different shapes: positions compare as positions (the more recent token index first).
  std::vector<ScoreMap<double>> ragged = {map_of({2, 2}, 1, 2), map_of({2, 2, 2, 2, 2, 2}, 2, 3)};
  CHECK(allocate(ragged, 2) == Budgets{{0}, {1, 1}});  // position 2 exists only in layer 1
  CHECK(allocate(ragged, 4) == Budgets{{1}, {2, 1}});  // then position 1: L0, L1 h0, L1 h1
}

namespace {

// The two hand-worked layers of Layer-DefensiveKV (H = 4, Hkv = 2, w = 4, L = 12, P = 8, kernel 1, units of 1/32).
// Layer 0 is test_defensive_selector.cpp's layer: s'[0] = [.90625 1.25 1.8125 1.8125 1.8125 4 .90625 1.8125],
// s'[1] = [7.5 3.9375 2.25 2.25 2.25 2.25 4.5 8] (/32), layer max 8/32 = .25; mass forcing (corrected, tau .61875)
// {1} and {7}; quirks (tau .55625, cap int(8 x .65 - 4) = 1 at cr .35) also {1} and {7}.
// Layer 1: every window row of every query head puts 24/32 on one prefix token and 8/32 on key 8: q0 and q2 on tokens
// 0..3 (row i on token i), q1 and q3 on tokens 4..7. M = .75 everywhere (the floor changes nothing), values 1 ->
// Nn = 1/2, s' = .375 for all 16 prefix entries. Mass: p uniform 1/8 per head; corrected bias .25 -> tau .65, crossed
// at c = 6/8 (index 5): k = 5, capped at n_kept - w; the order of equal p is the most recent first: 7, 6, 5, ...
// Quirks: bias = the mass on [4, 8) = .375 -> tau .525, crossed at index 4, capped at 1 -> {7}.
const std::vector<std::vector<double>> kRows0 = {
    {1, 10, 2, 3, 0, 4, 1, 2, 9, 0, 0, 0},
    {1, 10, 0, 1, 0, 8, 3, 0, 9, 0, 0, 0},
    {6, 0, 0, 0, 0, 0, 0, 16, 10, 0, 0, 0},
    {10, 0, 4, 0, 0, 0, 6, 4, 8, 0, 0, 0},
};
const Shape kShape{4, 2, 4, 12, 1};

std::vector<double> layer1_attention() {
  std::vector<double> a;
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 4; ++i) {
      std::vector<double> row(12, 0.0);
      row[sz((q % 2) * 4 + i)] = 24.0 / 32;
      row[8] = 8.0 / 32;
      a.insert(a.end(), row.begin(), row.end());
    }
  return a;
}

struct HandModel {
  kvevict_test::HandLayer l0{kShape,
                             kvevict_test::repeated_rows(kRows0, 4, 32.0),
                             {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 7, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1},
                             {1, 1, 1, 1}};
  kvevict_test::HandLayer l1{kShape, layer1_attention(), std::vector<double>(24, 1.0), {1, 1, 1, 1}};
  std::vector<kvevict::LayerInputs<double>> inputs() const { return {l0.in, l1.in}; }
};

kvevict::LayerDefensiveKV hand_policy(bool quirks) {
  kvevict::LayerDefensiveKV::Params p;
  p.window = 4;
  p.kernel = 1;
  p.reference_quirks = quirks;
  return kvevict::LayerDefensiveKV(p);
}

}  // namespace

TEST_CASE("Layer-DefensiveKV on two hand-worked layers: a forced token kept in corrected mode, lost under quirks",
          "[layer_global]") {
  const HandModel model;
  const Budget cr35 = Budget::compression_ratio(0.35);  // n_kept = int(12 x .65) = 7 per head
  // Corrected: total 2 layers x 2 heads x 7 = 28, cap 3. Always kept: layer 0 forced {1}, {7} + window (10), layer 1
  // forced {5, 6, 7} x 2 + window (14) = 24; the 4 left go to layer 1's .375 entries (above anything in layer 0),
  // the most recent first: (4, h0), (4, h1), (3, h0), (3, h1). Layer 0 keeps only what is forced.
  const auto corrected = kvevict_test::kept_of(hand_policy(false).select<double>(model.inputs(), cr35));
  const std::vector<Kept> want_corrected = {Kept{{1, 8, 9, 10, 11}, {7, 8, 9, 10, 11}},
                                            Kept{{3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4, 5, 6, 7, 8, 9, 10, 11}}};
  CHECK(corrected == want_corrected);
  // Quirks: total int(12 x .65 x 2 x 2) = int(31.2) = 31. Layer 1's 24 entries (16 prefix + 8 window) all carry its
  // max .375; layer 0's forced tokens and window carry only its own max .25, so after layer 1 they compete for 7
  // slots by position: (11, h0) (11, h1) (10, h0) (10, h1) (9, h0) (9, h1) (8, h0). The forced token 1 of KV 0
  // (and 7 of KV 1, and even window token 8 of KV 1) lose the global top-k.
  const auto quirks = kvevict_test::kept_of(hand_policy(true).select<double>(model.inputs(), cr35));
  const std::vector<Kept> want_quirks = {
      Kept{{8, 9, 10, 11}, {9, 10, 11}},
      Kept{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}}};
  CHECK(quirks == want_quirks);
  // The reference, fed with the s' and forced sets written above, agrees in both modes.
  const std::vector<double> sp0 = {.90625 / 32, 1.25 / 32,   1.8125 / 32, 1.8125 / 32, 1.8125 / 32, 4. / 32,
                                   .90625 / 32, 1.8125 / 32, 7.5 / 32,    3.9375 / 32, 2.25 / 32,   2.25 / 32,
                                   2.25 / 32,   2.25 / 32,   4.5 / 32,    8. / 32};
  const std::vector<double> sp1(16, 0.375);
  CHECK(kvevict_ref::layer_defensivekv({sp0, sp1}, {Forced{{1}, {7}}, Forced{{5, 6, 7}, {5, 6, 7}}}, 2, 4, 12, 7, false,
                                       0.35) == want_corrected);
  CHECK(kvevict_ref::layer_defensivekv({sp0, sp1}, {Forced{{1}, {7}}, Forced{{7}, {7}}}, 2, 4, 12, 7, true, 0.35) ==
        want_quirks);
  // Totals.
  const auto sels = hand_policy(true).select<double>(model.inputs(), cr35);
  CHECK(sels[0].total() + sels[1].total() == 31);
  // Plan: score layer by layer, then apply, is the same as select. (A Plan refers to its policy, which must outlive
  // it.)
  const kvevict::LayerDefensiveKV corrected_policy = hand_policy(false);
  auto plan = corrected_policy.plan<double>(cr35);
  plan.add(model.l0.in);
  plan.add(model.l1.in);
  CHECK(kvevict_test::kept_of(plan.apply()) == want_corrected);
  // One layer alone: Layer-DefensiveKV is DefensiveKV (see test_defensive_selector.cpp: {1, 5, 8..11}, {0, 1, 6,
  // 7, 8..11}).
  CHECK(kvevict_test::kept_of(
            hand_policy(false).select<double>(std::vector<kvevict::LayerInputs<double>>{model.l0.in}, cr35)) ==
        std::vector<Kept>{Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 6, 7, 8, 9, 10, 11}}});
  CHECK(kvevict_test::kept_of(
            hand_policy(true).select<double>(std::vector<kvevict::LayerInputs<double>>{model.l0.in}, cr35)) ==
        std::vector<Kept>{Kept{{1, 5, 8, 9, 10, 11}, {0, 1, 5, 6, 7, 8, 9, 10, 11}}});
  // Quirks need a compression ratio.
  for (const Budget& b : {Budget::tokens(7), Budget::keep_ratio(0.6)})
    REQUIRE_THROWS_MATCHES(hand_policy(true).select<double>(model.inputs(), b), kvevict::invalid_argument,
                           MessageContains("reference_quirks needs the budget as a compression ratio"));
  // Corrected with tokens: the same as cr .35 (n_kept 7).
  CHECK(kvevict_test::kept_of(hand_policy(false).select<double>(model.inputs(), Budget::tokens(7))) == want_corrected);
}

namespace {

struct LayerCase {
  kvevict_test::VLayer layer;
  std::vector<double> attn;
};

std::vector<LayerCase> random_model(const Shape& s, int NL, Rng& rng) {
  std::vector<LayerCase> m;
  for (int l = 0; l < NL; ++l) {
    LayerCase c{kvevict_test::random_vlayer(s, 12, rng, l % 2 ? 2.5 : 1.5), {}};
    c.attn = kvevict_test::ref_attention(c.layer);
    m.push_back(std::move(c));
  }
  return m;
}

template <class Selector>
kvevict::LayerGlobalPolicy<Selector> make_global(const Shape& s, const SelKnobs& k) {
  typename kvevict::LayerGlobalPolicy<Selector>::Params p;
  kvevict_test::apply_knobs(s, k, p);
  return kvevict::LayerGlobalPolicy<Selector>(p);
}

}  // namespace

TEST_CASE(
    "Layer-DefensiveKV and LayerGlobalPolicy<CriticalSelector> select<double> like the reference (both modes, "
    "toggles, budget forms)",
    "[layer_global]") {
  Rng rng(901);
  int cases = 0, skipped = 0, forms_seen[3] = {0, 0, 0};
  const Shape shapes[] = {{1, 1, 1, 3, 16},  {2, 1, 4, 20, 16},   {8, 2, 32, 40, 16}, {4, 4, 4, 64, 64},
                          {8, 8, 4, 30, 16}, {4, 2, 32, 120, 16}, {2, 2, 4, 700, 16}};
  int i = 0;
  for (const Shape& s : shapes) {
    const int NL = 2 + i % 2;
    const std::vector<LayerCase> model = random_model(s, NL, rng);
    std::vector<kvevict_test::VStored<double>> stored;
    std::vector<kvevict::LayerInputs<double>> inputs;
    for (const auto& c : model)
      stored.push_back(kvevict_test::store_v<double>(c.layer, i % 2 ? Layout::heads_major : Layout::tokens_major));
    for (const auto& st : stored) inputs.push_back(st.in);
    SelKnobs k;
    k.kernel = i % 3 == 0 ? 5 : (i % 3 == 1 ? 7 : 1);
    k.pooling = i % 2 ? Pooling::max : Pooling::avg;
    k.floor = i != 2;
    k.value_term = i != 3;
    k.mass_forcing = i != 4;
    k.norm = i == 5 ? ValueNorm::l2 : ValueNorm::l1;
    k.threshold = i == 6 ? 0.6 : 0.9;
    const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, s.L > 500 ? 2 : 3);
    for (bool quirks : {false, true}) {
      k.quirks = quirks;
      std::vector<kvevict_test::RefLayer> refs;
      bool near_tie = false;
      for (const auto& c : model) {
        refs.push_back(kvevict_test::ref_layer(c.layer, c.attn, k));
        if (k.mass_forcing && kvevict_test::mass_margin(c.attn, s, k.threshold, quirks) < 1e-9) near_tie = true;
      }
      const auto defensive = make_global<kvevict::DefensiveSelector>(s, k);
      const auto critical = make_global<kvevict::CriticalSelector>(s, k);
      for (std::int64_t n : budgets) {
        // Corrected: each budget in one of the three forms, in turn; quirks: the compression ratio, the others refused.
        const std::vector<kvevict_test::FormedBudget> forms = kvevict_test::budget_forms(n, s.L);
        const std::size_t pick = quirks ? forms.size() - 1 : sz(cases) % forms.size();
        for (std::size_t fi = 0; fi < forms.size(); ++fi) {
          const kvevict_test::FormedBudget& b = forms[fi];
          INFO(kvevict_test::describe(s) << " NL=" << NL << " " << kvevict_test::describe(k) << " budget " << b.form
                                         << " n_kept=" << b.n_kept);
          if (quirks && b.form != "compression_ratio") {
            REQUIRE_THROWS_MATCHES(defensive.select<double>(inputs, b.budget), kvevict::invalid_argument,
                                   MessageContains("reference_quirks needs the budget as a compression ratio"));
            REQUIRE_THROWS_MATCHES(critical.select<double>(inputs, b.budget), kvevict::invalid_argument,
                                   MessageContains("reference_quirks needs the budget as a compression ratio"));
            continue;
          }
          if (fi != pick || (quirks && b.form != "compression_ratio")) continue;
          ++cases;
          ++forms_seen[b.form == "tokens" ? 0 : b.form == "keep_ratio" ? 1 : 2];
          // LayerGlobalPolicy<CriticalSelector>: the budgets of one top-k over s (window +inf, or each layer's max of s
          // under quirks), then CriticalKV's two stages per head.
          std::vector<std::vector<double>> s_layers;
          for (const auto& r : refs) s_layers.push_back(r.s);
          const std::vector<Kept> alloc =
              kvevict_ref::layer_defensivekv(s_layers, {}, s.Hkv, s.w, s.L, b.n_kept, quirks, quirks ? b.cr : 0.0);
          const auto lengths = kvevict_test::lengths_of(alloc);
          std::vector<Kept> want_critical;
          for (int l = 0; l < NL; ++l)
            want_critical.push_back(kvevict_test::critical_stages(refs[sz(l)].s, refs[sz(l)].n, s, lengths[sz(l)], k));
          const std::vector<Kept> got_critical = kvevict_test::kept_of(critical.select<double>(inputs, b.budget));
          REQUIRE(got_critical.size() == sz(NL));
          for (int l = 0; l < NL; ++l) {
            INFO("critical, layer " << l);
            REQUIRE(kvevict_test::first_difference(got_critical[sz(l)], want_critical[sz(l)]) == "");
          }
          if (near_tie) {
            ++skipped;
            continue;
          }
          std::vector<std::vector<double>> sp;
          std::vector<Forced> forced;
          for (int l = 0; l < NL; ++l) {
            sp.push_back(refs[sz(l)].sprime);
            forced.push_back(kvevict_test::ref_forced(refs[sz(l)], s, k, b.n_kept, b.cr));
          }
          const std::vector<Kept> want =
              kvevict_ref::layer_defensivekv(sp, forced, s.Hkv, s.w, s.L, b.n_kept, quirks, quirks ? b.cr : 0.0);
          const std::vector<Kept> got = kvevict_test::kept_of(defensive.select<double>(inputs, b.budget));
          REQUIRE(got.size() == sz(NL));
          for (int l = 0; l < NL; ++l) {
            INFO("defensive, layer " << l);
            REQUIRE(kvevict_test::first_difference(got[sz(l)], want[sz(l)]) == "");
          }
        }
      }
    }
    ++i;
  }
  INFO("cases " << cases << ", skipped as mass near-ties " << skipped);
  CHECK(cases > 30);
  CHECK(forms_seen[0] >= 3);
  CHECK(forms_seen[1] >= 3);
  CHECK(forms_seen[2] >= 15);
  CHECK(skipped * 20 <= cases);
}

TEST_CASE(
    "Layer-DefensiveKV: model total, forced and window tokens kept, plan == select, determinism, layouts, one "
    "layer == DefensiveKV (float)",
    "[layer_global]") {
  Rng rng(902);
  for (int t = 0; t < 6; ++t) {
    Shape s = kvevict_test::random_shape(rng, 100);
    if (s.d == 128) s.d = 16;
    const int NL = 1 + t % 3;
    std::vector<kvevict_test::VStored<float>> hm, tm;
    std::vector<kvevict::LayerInputs<float>> in_hm, in_tm;
    std::vector<std::vector<double>> rows;
    for (int l = 0; l < NL; ++l) {
      const kvevict_test::VLayer layer = kvevict_test::random_vlayer(s, 8, rng);
      hm.push_back(kvevict_test::store_v<float>(layer, Layout::heads_major));
      tm.push_back(kvevict_test::store_v<float>(layer, Layout::tokens_major));
      rows.push_back(kvevict_test::to_double(
          kvevict_test::library_attention<float, float>(hm.back().in.queries, hm.back().in.keys)));
    }
    for (const auto& x : hm) in_hm.push_back(x.in);
    for (const auto& x : tm) in_tm.push_back(x.in);
    SelKnobs k;
    const auto policy = make_global<kvevict::DefensiveSelector>(s, k);
    SelKnobs kq = k;
    kq.quirks = true;
    const auto quirky = make_global<kvevict::DefensiveSelector>(s, kq);
    const std::vector<std::int64_t> budgets = kvevict_test::some_budgets(s, rng, 4);
    for (std::int64_t n : budgets) {
      INFO(kvevict_test::describe(s) << " NL=" << NL << " n_kept=" << n);
      const std::vector<Selection> sels = policy.select(in_hm, Budget::tokens(n));
      REQUIRE(sels.size() == sz(NL));
      Index total = 0;
      for (int l = 0; l < NL; ++l) {
        const Selection& x = sels[sz(l)];
        REQUIRE(kvevict_test::structure_errors(x, s.Hkv, s.L) == "");
        CHECK(kvevict_test::mask_errors(x) == "");
        total += x.total();
        kvevict::extend::MassStatistics<float> mass(kvevict_test::layer_shape(s), false);
        kvevict_test::for_each_head_rows<float>(rows[sz(l)], s,
                                                [&](int q, const kvevict::RowMatrix<float>& r) { mass.add(q, r); });
        for (Index h = 0; h < s.Hkv; ++h) {
          const Index from = n >= s.w ? s.P() : s.L - n;
          for (Index j = from; j < s.L; ++j) CHECK(x.kept(h, j));
          for (Index j :
               mass.forced_tokens(h, 0.9 - mass.window_bias(), std::max<Index>(0, static_cast<Index>(n) - s.w)))
            CHECK(x.kept(h, j));
        }
      }
      CHECK(total == NL * s.Hkv * n);
      const std::vector<Kept> want = kvevict_test::kept_of(sels);
      CHECK(kvevict_test::kept_of(policy.select(in_hm, Budget::tokens(n))) == want);
      CHECK(kvevict_test::kept_of(policy.select(in_tm, Budget::tokens(n))) == want);
      auto plan = policy.plan<float>(Budget::tokens(n));
      for (const auto& in : in_tm) plan.add(in);
      CHECK(kvevict_test::kept_of(plan.apply()) == want);
      CHECK(kvevict_test::kept_of(plan.apply()) == want);  // apply() is const and repeatable
      // (With one layer this is not DefensiveKV: here forced and window tokens are +infinity, there they carry the
      // layer maximum of s' and a more recent token tying it can displace a forced one.)
      // Quirks: the model total int(L (1 - cr) Hkv NL).
      const double cr = 1.0 - static_cast<double>(n) / s.L;
      if (cr >= 0.0 && cr < 1.0 && kvevict_ref::n_kept_from_compression_ratio(s.L, cr) >= 1) {
        Index qt = 0;
        for (const Selection& x : quirky.select(in_hm, Budget::compression_ratio(cr))) qt += x.total();
        CHECK(qt == static_cast<Index>(static_cast<double>(s.L) * (1.0 - cr) * static_cast<double>(s.Hkv) *
                                       static_cast<double>(NL)));
        if (NL == 1) {
          SelKnobs f = kq;
          f.alpha = 0.0;
          CHECK(kvevict_test::kept_of(quirky.select(in_hm, Budget::compression_ratio(cr))) ==
                std::vector<Kept>{kvevict_test::kept_of(kvevict_test::make_policy<kvevict::DefensiveKV>(s, f).select(
                    in_hm[0], Budget::compression_ratio(cr)))});
        }
      }
    }
  }
}

TEST_CASE("Layer-DefensiveKV over layers of different shapes (corrected): the total is the sum of the layers' budgets",
          "[layer_global]") {
  Rng rng(903);
  const Shape shapes[] = {{8, 2, 4, 60, 16}, {4, 4, 4, 100, 16}, {2, 1, 4, 30, 16}};
  std::vector<kvevict_test::VStored<double>> stored;
  for (const Shape& s : shapes)
    stored.push_back(kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major));
  kvevict::LayerDefensiveKV::Params p;
  p.window = 4;
  const kvevict::LayerDefensiveKV policy(p);
  auto plan = policy.plan<double>(Budget::keep_ratio(0.25));  // n_kept 15, 25, 7
  for (const auto& st : stored) plan.add(st.in);
  stored.clear();  // the plan holds no view of the inputs: they may go after add()
  const std::vector<Selection> sels = plan.apply();
  REQUIRE(sels.size() == 3);
  CHECK(sels[0].heads() == 2);
  CHECK(sels[1].heads() == 4);
  CHECK(sels[2].heads() == 1);
  CHECK(sels[0].total() + sels[1].total() + sels[2].total() == 2 * 15 + 4 * 25 + 1 * 7);
  for (const Selection& x : sels)
    for (Index h = 0; h < x.heads(); ++h)
      for (Index j = x.context_length() - 4; j < x.context_length(); ++j) CHECK(x.kept(h, j));
  // Under quirks the layers must agree in tokens and KV heads.
  p.reference_quirks = true;
  const kvevict::LayerDefensiveKV quirky(p);
  std::vector<kvevict_test::VStored<double>> again;
  for (const Shape& s : {shapes[0], shapes[1]})
    again.push_back(kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major));
  auto qplan = quirky.plan<double>(Budget::compression_ratio(0.5));
  qplan.add(again[0].in);
  REQUIRE_THROWS_MATCHES(qplan.add(again[1].in), kvevict::invalid_argument,
                         MessageContains("reference_quirks needs every layer to have the same tokens and KV heads, "
                                         "layer 1 has 100 and 4"));
}

TEST_CASE("LayerGlobalPolicy errors: no layer, bad layer shapes, bad params", "[layer_global][errors]") {
  const kvevict::LayerDefensiveKV policy;
  const auto plan = policy.plan<float>(Budget::tokens(8));
  REQUIRE_THROWS_MATCHES(plan.apply(), kvevict::invalid_argument,
                         MessageContains("kvevict::LayerDefensiveKV::apply: no layer was added"));
  REQUIRE_THROWS_MATCHES(policy.select(std::vector<kvevict::LayerInputs<float>>{}, Budget::tokens(8)),
                         kvevict::invalid_argument, MessageContains("no layer was added"));
  // The default window (32) does not fit a 20-token layer.
  Rng rng(904);
  const Shape s{4, 2, 4, 20, 8};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major);
  auto p2 = policy.plan<float>(Budget::tokens(8));
  REQUIRE_THROWS_MATCHES(
      p2.add(st.in), kvevict::invalid_argument,
      MessageContains("kvevict::LayerDefensiveKV::add (layer 0): window (32) must be smaller than the context "
                      "length (20)"));
  kvevict::LayerDefensiveKV::Params p;
  p.window = 4;
  const kvevict::LayerDefensiveKV ok(p);
  // A token budget is a model total (a layer may hold less than its share, docs/algorithms.md#streaming): refused
  // when the model total exceeds every layer's entries together.
  auto p3 = ok.plan<float>(Budget::tokens(21));
  p3.add(st.in);
  REQUIRE_THROWS_MATCHES(p3.apply(), kvevict::invalid_argument,
                         MessageContains("kvevict::LayerDefensiveKV::apply: the model budget (42 entries: the sum over "
                                         "layers of kv_heads * n_kept) exceeds what the layers hold (40)"));
  auto p4 = ok.plan<float>(Budget::keep_ratio(0.01));
  REQUIRE_THROWS_MATCHES(p4.add(st.in), kvevict::invalid_argument, MessageContains("n_kept must be in [1, 20]"));
  kvevict::LayerGlobalPolicy<kvevict::CriticalSelector>::Params cp;
  cp.first_stage_ratio = 1.5;
  REQUIRE_THROWS_MATCHES(
      kvevict::LayerGlobalPolicy<kvevict::CriticalSelector>(cp), kvevict::invalid_argument,
      MessageContains("kvevict::LayerGlobalPolicy<CriticalSelector>::Params: first_stage_ratio must be in [0, 1]"));
  cp.first_stage_ratio = 0.5;
  cp.kernel = 4;
  REQUIRE_THROWS_MATCHES(kvevict::LayerGlobalPolicy<kvevict::CriticalSelector>(cp), kvevict::invalid_argument,
                         MessageContains("kernel must be an odd number"));
}

TEST_CASE("LayerGlobalPolicy has Policy's entry points: plan(budget, layers), select of one layer", "[layer_global]") {
  Rng rng(905);
  const Shape s{8, 2, 4, 40, 8};
  const auto a = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major);
  const auto b = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<float>> model = {a.in, b.in};
  const Budget budget = Budget::tokens(10);
  // Generic code over both kinds of policy: the same calls compile and select as the kinds' own entry points.
  const auto run = [&](const auto& policy) {
    auto plan = policy.template plan<float>(budget, 2);
    for (const auto& in : model) plan.add(in);
    const std::vector<Selection> planned = plan.apply();
    CHECK(same(planned, policy.select(model, budget)));
    return std::make_pair(planned, policy.select(a.in, budget));
  };
  kvevict::LayerDefensiveKV::Params lp;
  lp.window = s.w;
  const kvevict::LayerDefensiveKV layer_global(lp);
  kvevict::DefensiveKV::Params dp;
  dp.window = s.w;
  const auto global = run(layer_global);
  run(kvevict::DefensiveKV(dp));
  // One layer is a model of one layer, under every signature.
  const Selection alone = layer_global.select(std::vector<kvevict::LayerInputs<float>>{a.in}, budget).front();
  CHECK(same(global.second, alone));
  CHECK(same(layer_global.select(a.in, budget, 0), alone));
  CHECK(same(layer_global.select(a.in, budget, 0, 1), alone));
  // A layer of a larger model is not selected alone; the plan checks the layer count it was made for.
  REQUIRE_THROWS_MATCHES(layer_global.select(b.in, budget, 1), kvevict::invalid_argument,
                         MessageContains("kvevict::LayerDefensiveKV::select (layer 1): one budget across layers "
                                         "selects every layer at once"));
  REQUIRE_THROWS_MATCHES(layer_global.select(a.in, budget, 0, 2), kvevict::invalid_argument,
                         MessageContains("got layer 0 of 2"));
  auto short_plan = layer_global.plan<float>(budget, 2);
  short_plan.add(a.in);
  REQUIRE_THROWS_MATCHES(
      short_plan.apply(), kvevict::invalid_argument,
      MessageContains("kvevict::LayerDefensiveKV::apply: the plan was made for 2 evicted layers, 1 were added"));
  short_plan.add(b.in);
  REQUIRE_THROWS_MATCHES(
      short_plan.add(a.in), kvevict::invalid_argument,
      MessageContains("kvevict::LayerDefensiveKV::add (layer 2): the plan was made for 2 evicted layers"));
  REQUIRE_THROWS_MATCHES(layer_global.plan<float>(budget, -1), kvevict::invalid_argument,
                         MessageContains("kvevict::LayerDefensiveKV::plan: layers must be >= 0, got -1"));
  // Errors of a one-layer select name the call.
  REQUIRE_THROWS_MATCHES(
      kvevict::LayerDefensiveKV().select(a.in, budget), kvevict::invalid_argument,
      MessageContains("kvevict::LayerDefensiveKV::select (layer 0): queries rows (4) must equal the window (32)"));
}

}  // namespace test_layer_global
