// DefensiveSelector's open window and the OpenDefensiveKV preset (docs/algorithms.md#open-window): the window is
// observed whole, its tokens are scored like the prefix, only each head's newest entry is kept first. Hand-worked
// numbers, then DefensiveKV and the layer-global policy against the float64 reference on random layers.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/reference_open_window.hpp"
#include "support/selector_inputs.hpp"

namespace test_open_window {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Pooling;
using kvevict::ValueNorm;
using kvevict_test::Forced;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

// kvevict_test::defensive_hand_layer(), worked out in test_defensive_selector.cpp: H = 4, Hkv = 2, w = 4, L = 12, P =
// 8, head_dim 1, W_o = 1, attention in units of 1/32, every window row of a query head the same. Its window columns:
// all 9 (q0, q1) and 10 (q2, q3) on key 8, 0 on keys 9..11. With the open window (kernel 1):
//   M[0] = [1 10 2 3 0 8 3 2 | 9 0 0 0] floored at the prefix mean 3.625, M[1] = [10 0 4 0 0 0 6 16 | 10 0 0 0]
//   floored at 4.5; N = |v| = 1 on every window column, so Nn = 1/2 there:
//   s'[0] = [.90625 1.25 1.8125 1.8125 1.8125 4 .90625 1.8125 | 4.5 1.8125 1.8125 (newest)]
//   s'[1] = [7.5 3.9375 2.25 2.25 2.25 2.25 4.5 8 | 5 2.25 2.25 (newest)]
// Mass forcing is unchanged: {1} and {7}, cap n_kept - w.
kvevict_test::HandLayer& hand_layer() { return kvevict_test::defensive_hand_layer(); }

template <class P>
P hand_policy(bool open, bool value_term = true, bool floor = true) {
  typename P::Params p;
  p.window = 4;
  p.kernel = 1;
  p.open_window = open;
  p.value_term = value_term;
  p.floor = floor;
  return P(p);
}

template <class P>
Kept run(const P& p, std::int64_t n_kept) {
  return kvevict_test::kept_of(p.template select<double>(hand_layer().in, Budget::tokens(n_kept)));
}
Kept run_global(const kvevict::OpenDefensiveKV& p, std::int64_t n_kept) {
  const std::vector<kvevict::LayerInputs<double>> layers = {hand_layer().in};
  return kvevict_test::kept_of(p.select<double>(layers, Budget::tokens(n_kept)).front());
}

}  // namespace

TEST_CASE("open window on the hand-worked layer: the window's tokens compete, the newest is kept", "[open_window]") {
  using kvevict::DefensiveKV;
  // n_kept 6 (total 12): forced {1} / {7} and the newest entries (4), then 7.5 (1, 0), 5 (1, 8), 4.5 (0, 8) before
  // 4.5 (1, 6) (the more recent position wins the tie), 4 (0, 5), 3.9375 (1, 1), and two of the 2.25 of KV 1, the
  // most recent: 10 and 9. Closed (the paper), the whole window is kept and only two scores enter.
  CHECK(run(hand_policy<DefensiveKV>(true), 6) == Kept{{1, 5, 8, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), 6) == Kept{{1, 8, 9, 10, 11}, {0, 6, 7, 8, 9, 10, 11}});
  // No value term (s' = the floored M): 10 (1, 8) before 10 (1, 0), 9 (0, 8), 8 (0, 5), 6 (1, 6), then the 4.5 of
  // KV 1 from the most recent: 10, 9, 5.
  CHECK(run(hand_policy<DefensiveKV>(true, false), 6) == Kept{{1, 5, 8, 11}, {0, 5, 6, 7, 8, 9, 10, 11}});
  // No floor: s' = M * Nn unfloored, [.25 1.25 1 1.5 0 4 .75 1 | 4.5 0 0] and [7.5 0 2 0 0 0 4.5 8 | 5 0 0]: after
  // 7.5, 5, 4.5 (0, 8), 4.5 (1, 6), 4 (0, 5) come 2 (1, 2), 1.5 (0, 3), and 1 (0, 7) before 1 (0, 2).
  CHECK(run(hand_policy<DefensiveKV>(true, true, false), 6) == Kept{{1, 3, 5, 7, 8, 11}, {0, 2, 6, 7, 8, 11}});
  // n_kept 2 (total 4, cap 0: nothing forced): the two newest, then 8 (1, 7) and 7.5 (1, 0).
  CHECK(run(hand_policy<DefensiveKV>(true), 2) == Kept{{11}, {0, 7, 11}});
  CHECK(run(hand_policy<DefensiveKV>(false), 2) == Kept{{10, 11}, {10, 11}});
  // n_kept 1: only the newest of each head.
  CHECK(run(hand_policy<DefensiveKV>(true), 1) == Kept{{11}, {11}});
  // OpenDefensiveKV (layer-global, unpooled, open) on this one layer is the flat top-k above.
  kvevict::OpenDefensiveKV::Params p;
  p.window = 4;
  const kvevict::OpenDefensiveKV open(p);
  CHECK(run_global(open, 6) == Kept{{1, 5, 8, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  CHECK(run_global(open, 2) == Kept{{11}, {0, 7, 11}});
  // The reference agrees on these numbers.
  const auto& h = hand_layer();
  const std::vector<double> m =
      kvevict_ref::open_defensive_scores(h.attn, 4, 2, 4, 12, 1, kvevict_ref::Pool::avg, true);
  const std::vector<double> n = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 7, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1};
  const std::vector<double> sp = kvevict_ref::open_value_scores(m, n, 2, 12, true);
  CHECK(sp[8] == 4.5 / 32);
  CHECK(sp[11 + 8] == 5.0 / 32);
  CHECK(sp[9] == 1.8125 / 32);
  CHECK(kvevict_ref::defensivekv(sp, Forced{{1}, {7}}, 2, 1, 12, 6, 0.0, false, 0.0) ==
        Kept{{1, 5, 8, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
}

TEST_CASE("open window: DefensiveKV and the layer-global policy select like the float64 reference", "[open_window]") {
  Rng rng(2026);
  int cases = 0, skipped = 0;
  const Shape shapes[] = {{1, 1, 1, 3, 16},  {2, 1, 4, 20, 16},   {8, 2, 32, 40, 16}, {4, 4, 4, 64, 64},
                          {8, 8, 4, 30, 16}, {4, 2, 32, 120, 16}, {2, 2, 8, 300, 16}};
  int i = 0;
  for (const Shape& s : shapes) {
    const int NL = 1 + i % 3;
    std::vector<kvevict_test::VLayer> model;
    std::vector<std::vector<double>> attn;
    std::vector<kvevict_test::VStored<double>> stored;
    std::vector<kvevict::LayerInputs<double>> inputs;
    for (int l = 0; l < NL; ++l) {
      model.push_back(kvevict_test::random_vlayer(s, 12, rng, l % 2 ? 2.5 : 1.5));
      attn.push_back(kvevict_test::ref_attention(model.back()));
      stored.push_back(kvevict_test::store_v<double>(model.back(), i % 2 ? Layout::heads_major : Layout::tokens_major));
    }
    for (const auto& st : stored) inputs.push_back(st.in);
    SelKnobs k;
    k.kernel = i % 3 == 0 ? 5 : (i % 3 == 1 ? 1 : 7);
    k.pooling = i % 2 ? Pooling::max : Pooling::avg;
    k.floor = i != 2;
    k.value_term = i != 3;
    k.mass_forcing = i != 4;
    k.norm = i == 5 ? ValueNorm::l2 : ValueNorm::l1;
    k.threshold = i == 6 ? 0.6 : 0.9;
    k.alpha = 0.0;
    kvevict::Knobs knobs = kvevict_test::to_knobs(s, k);
    knobs.open_window = true;
    kvevict::DefensiveKV::Params dp;
    kvevict::OpenDefensiveKV::Params gp;
    kvevict::apply_knobs(knobs, dp);
    kvevict::apply_knobs(knobs, gp);
    const kvevict::DefensiveKV flat(dp);
    const kvevict::OpenDefensiveKV global(gp);
    bool near_tie = false;
    std::vector<std::vector<double>> sp;
    for (int l = 0; l < NL; ++l) {
      const auto& v = model[sz(l)];
      const std::vector<double> m = kvevict_ref::open_defensive_scores(attn[sz(l)], s.H, s.Hkv, s.w, s.L, k.kernel,
                                                                       kvevict_test::ref_pool(k.pooling), k.floor);
      const std::vector<double> n = kvevict_ref::value_norms(v.v, v.w_o, s.H, s.Hkv, s.L, s.d, v.D, k.p());
      sp.push_back(kvevict_ref::open_value_scores(m, n, s.Hkv, s.L, k.value_term));
      if (k.mass_forcing && kvevict_test::mass_margin(attn[sz(l)], s, k.threshold, false) < 1e-9) near_tie = true;
    }
    for (std::int64_t n_kept : kvevict_test::some_budgets(s, rng, 5)) {
      INFO(kvevict_test::describe(s) << " NL=" << NL << " " << kvevict_test::describe(k) << " n_kept=" << n_kept);
      if (near_tie) {
        ++skipped;
        continue;
      }
      ++cases;
      std::vector<Forced> forced;
      for (int l = 0; l < NL; ++l)
        forced.push_back(k.mass_forcing ? kvevict_ref::mass_forced(attn[sz(l)], s.H, s.Hkv, s.w, s.L, k.threshold,
                                                                   n_kept, false, 0.0)
                                        : Forced(sz(s.Hkv)));
      // Per layer: the flat top-k of DefensiveKV with a window of one (the newest entry).
      for (int l = 0; l < NL; ++l) {
        INFO("DefensiveKV, layer " << l);
        const Kept want = kvevict_ref::defensivekv(sp[sz(l)], forced[sz(l)], s.Hkv, 1, s.L, n_kept, 0.0, false, 0.0);
        const Kept got = kvevict_test::kept_of(flat.select<double>(inputs[sz(l)], Budget::tokens(n_kept)));
        REQUIRE(kvevict_test::first_difference(got, want) == "");
      }
      // One budget across the layers.
      const std::vector<Kept> want = kvevict_ref::layer_defensivekv(sp, forced, s.Hkv, 1, s.L, n_kept, false, 0.0);
      const std::vector<Kept> got = kvevict_test::kept_of(global.select<double>(inputs, Budget::tokens(n_kept)));
      REQUIRE(got.size() == sz(NL));
      for (int l = 0; l < NL; ++l) {
        INFO("OpenDefensiveKV, layer " << l);
        REQUIRE(kvevict_test::first_difference(got[sz(l)], want[sz(l)]) == "");
      }
    }
    ++i;
  }
  INFO("cases " << cases << ", skipped as mass near-ties " << skipped);
  CHECK(cases >= 25);
  CHECK(skipped * 10 <= cases);
}

TEST_CASE("open window: the preset's defaults, float == double, reference_quirks", "[open_window]") {
  const kvevict::OpenDefensiveKV preset;
  CHECK(preset.params().open_window);
  CHECK(preset.params().kernel == 1);
  CHECK(preset.params().window == 32);
  CHECK(preset.params().mass_forcing);
  CHECK(preset.params().value_term);
  CHECK(preset.params().floor);
  CHECK_FALSE(kvevict::LayerDefensiveKV().params().open_window);  // the paper's presets keep their window
  CHECK_FALSE(kvevict::DefensiveKV().params().open_window);
  // float selects what double selects on the hand layer (every score exact in binary).
  const auto& h = hand_layer();
  std::vector<float> attn(h.attn.begin(), h.attn.end()), k(h.k.begin(), h.k.end()), v(h.v.begin(), h.v.end()),
      w_o(h.w_o.begin(), h.w_o.end());
  kvevict::LayerInputs<float> in;
  in.attention = kvevict::HeadsView<const float>::heads_major(attn.data(), 4, 4, 12);
  in.keys = kvevict::kv_heads_major<const float>(k.data(), 2, 12, 1);
  in.values = kvevict::kv_heads_major<const float>(v.data(), 2, 12, 1);
  in.w_o = kvevict::output_projection<const float>(w_o.data(), 1, 4, 1);
  CHECK(kvevict_test::kept_of(hand_policy<kvevict::DefensiveKV>(true).select<float>(in, Budget::tokens(6))) ==
        Kept{{1, 5, 8, 11}, {0, 1, 6, 7, 8, 9, 10, 11}});
  // Under reference_quirks the newest entries carry the layer maximum of the scored s' (8, KV 1 token 7), as the
  // reference's window does. cr .5: n_kept 6, total int(12 x .5 x 2) = 12, cap int(8 x .5 - 4) = 0 (nothing forced):
  // 8 x 3 (the newest two, then (1, 7)), 7.5, 5, 4.5 (0, 8), 4.5 (1, 6), 4, 3.9375, then 2.25 at 10, 9 and 5 of KV 1.
  kvevict::DefensiveKV::Params p;
  p.window = 4;
  p.kernel = 1;
  p.open_window = true;
  p.reference_quirks = true;
  CHECK(kvevict_test::kept_of(kvevict::DefensiveKV(p).select<double>(h.in, Budget::compression_ratio(0.5))) ==
        Kept{{5, 8, 11}, {0, 1, 5, 6, 7, 8, 9, 10, 11}});
}

}  // namespace test_open_window
