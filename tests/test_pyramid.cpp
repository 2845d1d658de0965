// PyramidKV (docs/algorithms.md#allocation, "Pyramid allocation"): the per-layer shares against the worked numbers
// and an independent implementation of the documented rule over a sweep, the model total, and the policy against
// SnapKV (and compositions against their uniform twin) with each layer's budget given as a token count; the place
// of a layer in the model, and the errors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <kvevict/kvevict.hpp>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/reference_layout.hpp"
#include "support/same_selection.hpp"
#include "support/selector_inputs.hpp"

namespace test_pyramid {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::PyramidAllocation;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

std::vector<std::int64_t> shares(double beta, std::int64_t n, Index w, Index N) {
  PyramidAllocation::Params p;
  p.beta = beta;
  const PyramidAllocation a(p);
  std::vector<std::int64_t> out;
  for (Index l = 0; l < N; ++l) out.push_back(a.layer_share(n, w, l, N));
  return out;
}

/// The rule of docs/algorithms.md#allocation written again (tests/support/reference_layout.hpp).
std::vector<std::int64_t> reference_shares(double beta, std::int64_t n, Index w, Index N) {
  return kvevict_ref::layout::pyramid_shares(beta, n, w, N);
}

using kvevict_test::same;

kvevict::Knobs knobs(Index w) {
  kvevict::Knobs k;
  k.window = w;
  return k;
}

}  // namespace

TEST_CASE("PyramidKV: the worked example of docs/algorithms.md#allocation", "[pyramid][allocation]") {
  // n_kept 20, w 4, N 4, beta 2: p 16, lo 8, hi 24, line 24, 18.67, 13.33, 8; floors 24 18 13 8 (63 of 64),
  // one more token to the largest fraction (layer 1).
  CHECK(shares(2.0, 20, 4, 4) == std::vector<std::int64_t>{28, 23, 17, 12});
  CHECK(reference_shares(2.0, 20, 4, 4) == std::vector<std::int64_t>{28, 23, 17, 12});
  // beta 20 (the default): lo 0.8, hi 31.2; line 31.2, 21.07, 10.93, 0.8; floors 62, two more to layers 2 and 3.
  CHECK(shares(20.0, 20, 4, 4) == std::vector<std::int64_t>{35, 25, 15, 5});
  // Nothing to distribute: one layer, or a budget within the window.
  CHECK(shares(20.0, 20, 4, 1) == std::vector<std::int64_t>{20});
  CHECK(shares(20.0, 4, 4, 3) == std::vector<std::int64_t>{4, 4, 4});
  CHECK(shares(20.0, 3, 4, 3) == std::vector<std::int64_t>{3, 3, 3});
  // Equal fractions: the shallower layer first (p 2, line 3.5, 2.5, 1.5, 0.5: floors 6 of 8, one more to 0 and 1).
  CHECK(shares(4.0, 3, 1, 4) == std::vector<std::int64_t>{5, 4, 2, 1});

  // A layer holding fewer than its share keeps all it holds (L 25 < 28): the model keeps 77 of 80 per KV head.
  Rng rng(2405);
  const Shape s{2, 1, 4, 25, 16};
  const auto st = kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  kvevict::PyramidKV::Params p;
  p.window = 4;
  p.beta = 2.0;
  const std::vector<Selection> kept = kvevict::select_layers<double>(
      kvevict::PyramidKV(p), std::vector<kvevict::LayerInputs<double>>(4, st.in), Budget::tokens(20));
  CHECK(kept[0].length(0) == 25);
  CHECK(kept[1].length(0) == 23);
  CHECK(kept[3].length(0) == 12);
}

TEST_CASE("PyramidKV: shares over a sweep, against the rule written again, summing to the model budget",
          "[pyramid][allocation]") {
  Rng rng(2406);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const Index N = std::uniform_int_distribution<Index>(1, 40)(rng);
    const Index w = std::uniform_int_distribution<Index>(1, 64)(rng);
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, 3000)(rng);
    const double beta = trial % 3 == 0 ? 20.0 : std::uniform_real_distribution<double>(1.0, 50.0)(rng);
    INFO("N=" << N << " w=" << w << " n=" << n << " beta=" << beta);
    const std::vector<std::int64_t> got = shares(beta, n, w, N);
    REQUIRE(got == reference_shares(beta, n, w, N));
    REQUIRE(std::accumulate(got.begin(), got.end(), std::int64_t{0}) == N * n);
    for (std::size_t l = 0; l < got.size(); ++l) {
      REQUIRE(got[l] >= std::min<std::int64_t>(n, w));
      REQUIRE(got[l] <= std::max<std::int64_t>(n, 2 * n - w));
      if (l > 0) REQUIRE(got[l] <= got[l - 1]);
    }
    if (n > w && N > 1) {
      ++checked;
      REQUIRE(got.front() >= n);
      REQUIRE(got.back() <= n);
    }
  }
  CHECK(checked > 1000);
}

TEST_CASE("PyramidKV: each layer selects as SnapKV with its share as a token budget, and compositions alike",
          "[pyramid][policy]") {
  Rng rng(2407);
  for (int trial = 0; trial < kvevict_test::cases(60); ++trial) {
    Shape s = kvevict_test::random_shape(rng, 90);
    const auto N = static_cast<Index>(std::uniform_int_distribution<int>(1, 6)(rng));
    std::vector<kvevict_test::VStored<double>> stored;
    std::vector<kvevict::LayerInputs<double>> layers;
    for (Index l = 0; l < N; ++l)
      stored.push_back(kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major));
    for (const auto& st : stored) layers.push_back(st.in);
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    INFO(kvevict_test::describe(s) << " N=" << N << " n=" << n);
    std::vector<std::int64_t> n_l = reference_shares(20.0, n, s.w, N);
    for (std::int64_t& x : n_l) x = std::min<std::int64_t>(x, s.L);  // a layer keeps at most what it holds
    const Budget budget = Budget::tokens(n);
    const auto k = knobs(s.w);
    const auto pyramid = kvevict::catalogue::Entry<kvevict::PyramidKV>{"", ""}.make(k);
    const auto snap = kvevict::catalogue::Entry<kvevict::SnapKV>{"", ""}.make(k);
    kvevict::Policy<kvevict::PyramidKV, kvevict::DefensiveSelector>::Params dp;
    dp.window = s.w;
    const kvevict::Policy<kvevict::PyramidKV, kvevict::DefensiveSelector> defensive(dp);
    kvevict::Policy<kvevict::SnapKV, kvevict::DefensiveSelector>::Params up;
    up.window = s.w;
    const kvevict::Policy<kvevict::SnapKV, kvevict::DefensiveSelector> uniform_defensive(up);

    const std::vector<Selection> all = kvevict::select_layers<double>(pyramid, layers, budget);
    const std::vector<Selection> planned = pyramid.select<double>(layers, budget);
    auto plan = pyramid.plan<double>(budget, N);
    for (const auto& in : layers) plan.add(in);
    const std::vector<Selection> applied = plan.apply();
    const std::vector<Selection> all_defensive = kvevict::select_layers<double>(defensive, layers, budget);
    Index total = 0;
    for (Index l = 0; l < N; ++l) {
      const auto i = static_cast<std::size_t>(l);
      const Budget mine = Budget::tokens(n_l[i]);
      CHECK(same(all[i], snap.select<double>(layers[i], mine)));
      CHECK(same(all[i], pyramid.select<double>(layers[i], budget, l, N)));
      CHECK(same(all[i], planned[i]));
      CHECK(same(all[i], applied[i]));
      CHECK(same(all_defensive[i], uniform_defensive.select<double>(layers[i], mine)));
      for (Index h = 0; h < s.Hkv; ++h) CHECK(all[i].length(h) == n_l[i]);
      total += all[i].total();
    }
    CHECK(total <= N * s.Hkv * n);
    if (2 * n - s.w <= s.L) CHECK(total == N * s.Hkv * n);  // no layer's share exceeds the context
  }
}

TEST_CASE("PyramidKV: a layer needs its place in the model, and bad parameters are named", "[pyramid][errors]") {
  Rng rng(2408);
  const Shape s{4, 2, 4, 40, 16};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<float>> two = {st.in, st.in};
  const kvevict::PyramidKV policy = kvevict::catalogue::Entry<kvevict::PyramidKV>{"", ""}.make(knobs(4));
  const Budget b = Budget::tokens(12);
  REQUIRE_THROWS_MATCHES(policy.select(st.in, b), kvevict::invalid_argument,
                         MessageContains("kvevict::PyramidKV::select: PyramidAllocation needs the layer's place in "
                                         "the model (layer -1 of 0)"));
  REQUIRE_THROWS_MATCHES(policy.select(st.in, b, 1), kvevict::invalid_argument,
                         MessageContains("(layer 1): PyramidAllocation needs the layer's place"));
  REQUIRE_THROWS_MATCHES(policy.select(st.in, b, 2, 2), kvevict::invalid_argument,
                         MessageContains("layer must be in [0, 2) (the model's layers), got 2"));
  auto unknown = policy.plan(b);
  REQUIRE_THROWS_MATCHES(unknown.add(st.in), kvevict::invalid_argument,
                         MessageContains("kvevict::PyramidKV::add (layer 0): PyramidAllocation needs"));
  auto short_plan = policy.plan(b, 2);
  short_plan.add(st.in);
  REQUIRE_THROWS_MATCHES(
      short_plan.apply(), kvevict::invalid_argument,
      MessageContains("kvevict::PyramidKV::apply: the plan was made for 2 evicted layers, 1 were added"));
  short_plan.add(st.in);
  REQUIRE_THROWS_MATCHES(short_plan.add(st.in), kvevict::invalid_argument,
                         MessageContains("add (layer 2): the plan was made for 2 evicted layers"));
  CHECK(short_plan.apply().size() == 2);
  REQUIRE_THROWS_MATCHES(policy.plan(b, -1), kvevict::invalid_argument, MessageContains("layers must be >= 0"));

  kvevict::PyramidKV::Params p;
  p.beta = 0.5;
  REQUIRE_THROWS_MATCHES(kvevict::PyramidKV(p), kvevict::invalid_argument,
                         MessageContains("kvevict::PyramidKV::Params: beta must be a finite number >= 1, got 0.5"));
  // The reference quirks change the scoring as SnapKV's; the layer's budget is its share (n_kept 12: 20 and 4).
  p = {};
  p.window = 4;
  p.reference_quirks = true;
  kvevict::SnapKV::Params qp;
  qp.window = 4;
  qp.reference_quirks = true;
  const std::vector<Selection> quirky =
      kvevict::select_layers(kvevict::PyramidKV(p), two, Budget::compression_ratio(0.7));
  CHECK(same(quirky[0], kvevict::SnapKV(qp).select(st.in, Budget::tokens(20))));
  CHECK(same(quirky[1], kvevict::SnapKV(qp).select(st.in, Budget::tokens(4))));
  // One set for every layer: nothing to schedule, SnapKV's choice; blocks over the window: every layer keeps one.
  p = {};
  p.window = 4;
  p.share = kvevict::Sharing::per_model;
  kvevict::SnapKV::Params sp;
  sp.window = 4;
  sp.share = kvevict::Sharing::per_model;
  const std::vector<Selection> pyramid_model = kvevict::select_layers(kvevict::PyramidKV(p), two, b);
  const std::vector<Selection> snap_model = kvevict::select_layers(kvevict::SnapKV(sp), two, b);
  for (std::size_t l = 0; l < 2; ++l) CHECK(same(pyramid_model[l], snap_model[l]));
  p = {};
  p.window = 4;
  p.block = 8;
  const std::vector<Selection> paged = kvevict::select_layers(kvevict::PyramidKV(p), two, Budget::tokens(16));
  CHECK(paged[0].total() == 2 * 24);  // floor 8: p 8, line 15.6, 0.4 -> 16 + 8 and 0 + 8
  CHECK(paged[1].total() == 2 * 8);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::PyramidKV>() == kvevict::BudgetScope::model);
}

}  // namespace test_pyramid
