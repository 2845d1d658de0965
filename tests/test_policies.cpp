// policy/policy.hpp and policy/presets.hpp: SnapKV and AdaKV end to end against the float64 reference, and the
// properties every policy keeps (budget accounting, window, order, determinism, layout and input-route invariance).
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/random_inputs.hpp"

namespace test_policies {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadAdaptiveAllocation;
using kvevict::Index;
using kvevict::Pooling;
using kvevict::Selection;
using kvevict_test::Kept;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

struct Knobs {
  int kernel = 5;
  Pooling pooling = Pooling::avg;
};

template <class P>
P make(const Shape& s, const Knobs& k,
       HeadAdaptiveAllocation::Variant variant = HeadAdaptiveAllocation::Variant::kvpress, double alpha = 0.2) {
  typename P::Params p;
  p.window = s.w;
  p.kernel = k.kernel;
  p.pooling = k.pooling;
  if constexpr (std::is_same_v<typename P::Allocation, HeadAdaptiveAllocation>) {
    p.variant = variant;
    p.alpha = alpha;
  }
  (void)variant;
  (void)alpha;
  return P(p);
}

kvevict_ref::Pool ref_pool(Pooling p) { return p == Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max; }

// A budget n given in each of the three forms, with the n_kept each resolves to.
struct FormedBudget {
  Budget budget;
  std::int64_t n_kept;
  std::string form;
};

std::vector<FormedBudget> forms(std::int64_t n, std::int64_t L) {
  std::vector<FormedBudget> out = {{Budget::tokens(n), n, "tokens"}};
  const double keep = static_cast<double>(n) / static_cast<double>(L);
  const std::int64_t nk = kvevict_ref::n_kept_from_keep_ratio(L, keep);
  if (nk >= 1) out.push_back({Budget::keep_ratio(keep), nk, "keep_ratio"});
  const double cr = 1.0 - keep;
  const std::int64_t nc = kvevict_ref::n_kept_from_compression_ratio(L, cr);
  if (cr >= 0.0 && cr < 1.0 && nc >= 1) out.push_back({Budget::compression_ratio(cr), nc, "compression_ratio"});
  return out;
}

std::vector<Shape> policy_shapes(Rng& rng, int n_random) {
  std::vector<Shape> out = {{1, 1, 1, 2, 16},    {2, 1, 4, 5, 16},    {8, 2, 32, 33, 64},
                            {8, 8, 32, 40, 16},  {4, 4, 1, 64, 128},  {8, 1, 4, 100, 16},
                            {2, 2, 4, 5000, 16}, {4, 2, 32, 900, 16}, {1, 1, 1, 2500, 64}};
  for (int i = 0; i < n_random; ++i) out.push_back(kvevict_test::random_shape(rng, 200));
  return out;
}

}  // namespace

TEST_CASE("SnapKV and AdaKV (both variants) select<double> like the reference, over shapes, budgets and forms",
          "[policies]") {
  // Each (budget, form) goes through one of three routes in turn, so that all meet the reference: the window
  // queries, the library's own attention rows, and the reference's attention rows (precomputed-attention input).
  Rng rng(81);
  const Knobs knobs[] = {{5, Pooling::avg}, {7, Pooling::max}, {1, Pooling::avg},
                         {5, Pooling::max}, {7, Pooling::avg}, {1, Pooling::max}};
  int i = 0;
  for (const Shape& s : policy_shapes(rng, kvevict_test::cases(18))) {
    const Knobs k = knobs[i++ % 6];
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const auto st = kvevict_test::store<double>(l, i % 2 ? Layout::heads_major : Layout::tokens_major);
    const std::vector<double> attn = kvevict_ref::window_attention(l.q, l.k, s.H, s.Hkv, s.w, s.L, s.d);
    const std::vector<double> lib_attn = kvevict_test::library_attention<double, double>(st.in.queries, st.in.keys);
    const kvevict::LayerInputs<double> routes[3] = {st.in, kvevict_test::attention_inputs(lib_attn, l.k, s),
                                                    kvevict_test::attention_inputs(attn, l.k, s)};
    const char* route_names[3] = {"queries", "library attention rows", "reference attention rows"};
    const std::vector<double> scores =
        kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, k.kernel, ref_pool(k.pooling));
    const auto snap = make<kvevict::SnapKV>(s, k);
    const auto ada = make<kvevict::AdaKV>(s, k);
    const auto orig = make<kvevict::AdaKV>(s, k, HeadAdaptiveAllocation::Variant::original);
    int turn = i;
    for (std::int64_t n : kvevict_test::budget_sweep(s, rng))
      for (const FormedBudget& b : forms(n, s.L)) {
        const int r = turn++ % 3;
        INFO(kvevict_test::describe(s) << " kernel=" << k.kernel << " " << kvevict::to_string(k.pooling) << " budget "
                                       << b.form << " n_kept=" << b.n_kept << " route " << route_names[r]);
        const kvevict::LayerInputs<double>& in = routes[r];
        const Selection a = snap.select<double>(in, b.budget);
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(a),
                                               kvevict_ref::snapkv(scores, s.Hkv, s.w, s.L, b.n_kept)) == "");
        const Selection c = ada.select<double>(in, b.budget);
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(c),
                                               kvevict_ref::adakv(scores, s.Hkv, s.w, s.L, b.n_kept, 0.2)) == "");
        const Selection o = orig.select<double>(in, b.budget);
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(o),
                                               kvevict_ref::adakv_original(scores, s.Hkv, s.w, s.L, b.n_kept, 0.2)) ==
                "");
      }
  }
}

TEST_CASE("policies on quantised attention (many exact ties) match the reference index for index", "[policies]") {
  Rng rng(82);
  for (int t = 0; t < 30; ++t) {
    const Shape s = kvevict_test::random_shape(rng, t < 28 ? 150 : 2000);
    const Knobs k{t % 3 == 0 ? 1 : (t % 3 == 1 ? 5 : 7), t % 2 ? Pooling::max : Pooling::avg};
    const std::vector<double> attn = kvevict_test::quantised_scores(sz(s.H * s.w * s.L), 1 + t % 4, rng);
    const std::vector<double> keys(sz(s.Hkv * s.L * s.d), 0.0);
    const auto in = kvevict_test::attention_inputs(attn, keys, s);
    const std::vector<double> scores =
        kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, k.kernel, ref_pool(k.pooling));
    for (double alpha : {0.2, 0.5}) {
      const auto snap = make<kvevict::SnapKV>(s, k);
      const auto ada = make<kvevict::AdaKV>(s, k, HeadAdaptiveAllocation::Variant::kvpress, alpha);
      const auto orig = make<kvevict::AdaKV>(s, k, HeadAdaptiveAllocation::Variant::original, alpha);
      for (std::int64_t n : kvevict_test::budget_sweep(s, rng)) {
        INFO(kvevict_test::describe(s) << " kernel=" << k.kernel << " " << kvevict::to_string(k.pooling)
                                       << " alpha=" << alpha << " n_kept=" << n);
        const Budget b = Budget::tokens(n);
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(snap.select<double>(in, b)),
                                               kvevict_ref::snapkv(scores, s.Hkv, s.w, s.L, n)) == "");
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(ada.select<double>(in, b)),
                                               kvevict_ref::adakv(scores, s.Hkv, s.w, s.L, n, alpha)) == "");
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(orig.select<double>(in, b)),
                                               kvevict_ref::adakv_original(scores, s.Hkv, s.w, s.L, n, alpha)) == "");
      }
    }
  }
}

TEST_CASE("properties every scored policy keeps (float storage, float arithmetic)", "[policies]") {
  Rng rng(83);
  std::vector<Shape> shapes = {{8, 2, 32, 33, 16}, {4, 4, 1, 2, 16}, {8, 1, 4, 3000, 16}};
  for (int i = 0; i < kvevict_test::cases(9); ++i) shapes.push_back(kvevict_test::random_shape(rng, 150));
  for (const Shape& s : shapes) {
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const auto hm = kvevict_test::store<float>(l, Layout::heads_major);
    const auto tm = kvevict_test::store<float>(l, Layout::tokens_major);
    const std::vector<float> attn = kvevict_test::library_attention<float, float>(hm.in.queries, hm.in.keys);
    const auto from_attn = kvevict_test::attention_inputs(attn, hm.k, s);
    const Knobs k;
    const auto snap = make<kvevict::SnapKV>(s, k);
    const auto ada = make<kvevict::AdaKV>(s, k);
    const auto orig = make<kvevict::AdaKV>(s, k, HeadAdaptiveAllocation::Variant::original);
    for (std::int64_t n : kvevict_test::budget_sweep(s, rng)) {
      INFO(kvevict_test::describe(s) << " n_kept=" << n);
      const Budget b = Budget::tokens(n);
      const Selection sel[3] = {snap.select(hm.in, b), ada.select(hm.in, b), orig.select(hm.in, b)};
      for (int p = 0; p < 3; ++p) {
        INFO("policy " << (p == 0 ? "SnapKV" : p == 1 ? "AdaKV" : "AdaKV original"));
        const Selection& x = sel[p];
        REQUIRE(kvevict_test::structure_errors(x, s.Hkv, s.L) == "");
        if (p < 2) CHECK(x.total() == s.Hkv * n);  // exact budget accounting
        if (p == 0)
          for (Index h = 0; h < s.Hkv; ++h) CHECK(x.length(h) == n);  // uniform lengths
        for (Index h = 0; h < s.Hkv; ++h) {
          // The window is kept when it fits; otherwise only its most recent n_kept tokens.
          const Index first = n >= s.w ? s.P() : s.L - n;
          for (Index j = first; j < s.L; ++j) REQUIRE(x.kept(h, j));
          if (n <= s.w) CHECK(x.length(h) == n);
        }
      }
      // Determinism, layout invariance, query vs precomputed-attention route (three budgets per shape).
      if (n != 1 && n != s.w + 1 && n != s.L - 1) continue;
      CHECK(kvevict_test::kept_of(snap.select(hm.in, b)) == kvevict_test::kept_of(sel[0]));
      CHECK(kvevict_test::kept_of(ada.select(hm.in, b)) == kvevict_test::kept_of(sel[1]));
      CHECK(kvevict_test::kept_of(snap.select(tm.in, b)) == kvevict_test::kept_of(sel[0]));
      CHECK(kvevict_test::kept_of(ada.select(tm.in, b)) == kvevict_test::kept_of(sel[1]));
      CHECK(kvevict_test::kept_of(orig.select(tm.in, b)) == kvevict_test::kept_of(sel[2]));
      CHECK(kvevict_test::kept_of(snap.select(from_attn, b)) == kvevict_test::kept_of(sel[0]));
      CHECK(kvevict_test::kept_of(ada.select(from_attn, b)) == kvevict_test::kept_of(sel[1]));
      CHECK(kvevict_test::kept_of(orig.select(from_attn, b)) == kvevict_test::kept_of(sel[2]));
    }
  }
}

TEST_CASE("double arithmetic: layouts, routes and float-vs-double storage agree", "[policies]") {
  Rng rng(84);
  for (int t = 0; t < 10; ++t) {
    const Shape s = kvevict_test::random_shape(rng, 200);
    const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
    const auto hm = kvevict_test::store<double>(l, Layout::heads_major);
    const auto tm = kvevict_test::store<double>(l, Layout::tokens_major);
    const std::vector<double> attn = kvevict_test::library_attention<double, double>(hm.in.queries, hm.in.keys);
    const auto from_attn = kvevict_test::attention_inputs(attn, hm.k, s);
    const auto ada = make<kvevict::AdaKV>(s, Knobs{7, Pooling::max});
    for (std::int64_t n : kvevict_test::budget_sweep(s, rng)) {
      INFO(kvevict_test::describe(s) << " n_kept=" << n);
      const Kept want = kvevict_test::kept_of(ada.select<double>(hm.in, Budget::tokens(n)));
      CHECK(kvevict_test::kept_of(ada.select<double>(tm.in, Budget::tokens(n))) == want);
      CHECK(kvevict_test::kept_of(ada.select<double>(from_attn, Budget::tokens(n))) == want);
    }
  }
}

TEST_CASE("GQA: a group of G identical query heads selects like a single query head", "[policies]") {
  Rng rng(85);
  for (const Shape& grouped :
       {Shape{8, 2, 4, 60, 16}, Shape{4, 1, 32, 80, 64}, Shape{8, 8, 1, 30, 16}, Shape{8, 1, 4, 200, 16}}) {
    INFO(kvevict_test::describe(grouped));
    Shape single = grouped;
    single.H = grouped.Hkv;
    const kvevict_test::Layer ls = kvevict_test::random_layer(single, rng);
    kvevict_test::Layer lg = ls;
    lg.s = grouped;
    lg.q.clear();
    for (int h = 0; h < grouped.Hkv; ++h)
      for (int g = 0; g < grouped.G(); ++g)
        lg.q.insert(lg.q.end(), ls.q.begin() + h * grouped.w * grouped.d,
                    ls.q.begin() + (h + 1) * grouped.w * grouped.d);
    const auto ss = kvevict_test::store<double>(ls, Layout::heads_major);
    const auto sg = kvevict_test::store<double>(lg, Layout::tokens_major);
    for (Knobs k : {Knobs{5, Pooling::avg}, Knobs{7, Pooling::max}}) {
      const auto snap = make<kvevict::SnapKV>(grouped, k);
      const auto ada = make<kvevict::AdaKV>(grouped, k);
      for (std::int64_t n : {std::int64_t(1), std::int64_t(grouped.w + 3), std::int64_t(grouped.L / 3)}) {
        CHECK(kvevict_test::kept_of(snap.select<double>(sg.in, Budget::tokens(n))) ==
              kvevict_test::kept_of(snap.select<double>(ss.in, Budget::tokens(n))));
        CHECK(kvevict_test::kept_of(ada.select<double>(sg.in, Budget::tokens(n))) ==
              kvevict_test::kept_of(ada.select<double>(ss.in, Budget::tokens(n))));
      }
    }
  }
}

TEST_CASE("GQA: KV head h's SnapKV selection depends only on the query heads of its group", "[policies]") {
  Rng rng(86);
  const Shape s{8, 4, 4, 120, 16};
  kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const auto before = kvevict_test::store<double>(l, Layout::heads_major);
  const auto snap = make<kvevict::SnapKV>(s, Knobs{});
  const Kept a = kvevict_test::kept_of(snap.select<double>(before.in, Budget::tokens(30)));
  // Replace the queries of group 2 (query heads 4 and 5).
  const std::vector<double> fresh = kvevict_test::normal_vector(sz(2 * s.w * s.d), rng, 1.5);
  std::copy(fresh.begin(), fresh.end(), l.q.begin() + 4 * s.w * s.d);
  const auto after = kvevict_test::store<double>(l, Layout::heads_major);
  const Kept b = kvevict_test::kept_of(snap.select<double>(after.in, Budget::tokens(30)));
  for (std::size_t h : {0u, 1u, 3u}) CHECK(a[h] == b[h]);
  CHECK(a[2] != b[2]);
}

TEST_CASE("SnapKV on a hand-made layer keeps the attended tokens", "[policies]") {
  // H = Hkv = 1, w = 2, L = 10: window rows put their prefix mass on tokens 1 and 6 (kernel 1: no smoothing).
  const Shape s{1, 1, 2, 10, 16};
  std::vector<double> attn(20, 0.0);
  attn[1] = 0.5;
  attn[6] = 0.3;
  attn[8] = 0.2;  // row 0: window column
  attn[10 + 6] = 0.6;
  attn[10 + 3] = 0.1;
  attn[10 + 9] = 0.3;  // row 1
  const std::vector<double> keys(sz(s.L * s.d), 0.0);
  const auto in = kvevict_test::attention_inputs(attn, keys, s);
  const auto snap = make<kvevict::SnapKV>(s, Knobs{1, Pooling::avg});
  // Prefix scores: token 6: 0.45, token 1: 0.25, token 3: 0.05, others 0.
  CHECK(kvevict_test::kept_of(snap.select<double>(in, Budget::tokens(3))) == Kept{{6, 8, 9}});
  CHECK(kvevict_test::kept_of(snap.select<double>(in, Budget::tokens(4))) == Kept{{1, 6, 8, 9}});
  CHECK(kvevict_test::kept_of(snap.select<double>(in, Budget::tokens(5))) == Kept{{1, 3, 6, 8, 9}});
  // Ties among the zero scores: the most recent prefix tokens first (7, then 5).
  CHECK(kvevict_test::kept_of(snap.select<double>(in, Budget::tokens(7))) == Kept{{1, 3, 5, 6, 7, 8, 9}});
  CHECK(kvevict_test::kept_of(snap.select<double>(in, Budget::tokens(1))) == Kept{{9}});
  CHECK(kvevict_test::kept_of(snap.select(in, Budget::tokens(10))) == Kept{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}});
}

TEST_CASE("policy parameters: the papers' defaults, and a policy used as a base reuses its allocation", "[policies]") {
  const kvevict::SnapKV snap;
  CHECK(snap.params().window == 32);
  CHECK(snap.params().kernel == 5);
  CHECK(snap.params().pooling == Pooling::avg);
  CHECK_FALSE(snap.params().reference_quirks);
  const kvevict::AdaKV ada;
  CHECK(ada.params().alpha == 0.2);
  CHECK(ada.params().variant == HeadAdaptiveAllocation::Variant::kvpress);
  static_assert(
      std::is_same_v<kvevict::Policy<kvevict::AdaKV, kvevict::AttentionSelector>::Allocation, HeadAdaptiveAllocation>);
  static_assert(std::is_same_v<kvevict::SnapKV::Allocation, kvevict::UniformAllocation>);

  Rng rng(87);
  const Shape s{4, 2, 32, 300, 16};
  const auto st = kvevict_test::store<float>(kvevict_test::random_layer(s, rng), Layout::heads_major);
  const kvevict::Policy<kvevict::AdaKV, kvevict::AttentionSelector> composed;
  for (double keep : {0.1, 0.2, 0.5}) {
    // Default window 32 < 300: the defaults select without any configuration.
    CHECK(kvevict_test::kept_of(composed.select(st.in, Budget::keep_ratio(keep))) ==
          kvevict_test::kept_of(ada.select(st.in, Budget::keep_ratio(keep))));
    CHECK(snap.select(st.in, Budget::keep_ratio(keep)).total() == 2 * static_cast<Index>(300 * keep));
  }
}

TEST_CASE("selecting does not modify the inputs", "[policies]") {
  Rng rng(88);
  const Shape s{4, 2, 4, 50, 16};
  const auto st = kvevict_test::store<float>(kvevict_test::random_layer(s, rng), Layout::tokens_major);
  const std::vector<float> q0 = st.q, k0 = st.k;
  const auto ada = make<kvevict::AdaKV>(s, Knobs{});
  (void)ada.select(st.in, Budget::tokens(10));
  CHECK(st.q == q0);
  CHECK(st.k == k0);
  CHECK(st.in.keys.data() == st.k.data());
}

}  // namespace test_policies
