// docs/algorithms.md#threshold-budgets: Budget::threshold(tau) keeps every entry whose score reaches tau (the window
// and every tier above the scored one always), its count clamped by count_bounds(lo, hi, scope) per KV head, per layer
// or per model. Worked numbers, a float64 brute force on random ragged engine scores in every scope, equivalences with
// the count budgets, every catalogue policy under every layout, and bad input refused by name.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_threshold_budget {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;
using Scope = kvevict::Budget::Scope;
using Rows = std::vector<std::int64_t>;

namespace {

/// One layer of engine scores [Hkv, L] (ragged: head h holds lengths[h] entries), keys never read for the ranking.
struct Layer {
  Index Hkv = 1, L = 1;
  std::vector<Index> lengths;
  std::vector<double> keys, scores;
  kvevict::LayerInputs<double> in;
  Layer(Index hkv, Index l, std::vector<double> s, std::vector<Index> lens = {})
      : Hkv(hkv),
        L(l),
        lengths(std::move(lens)),
        keys(static_cast<std::size_t>(hkv * l * 2), 1.0),
        scores(std::move(s)) {
    in.keys = kvevict::kv_heads_major<const double>(keys.data(), Hkv, L, 2);
    in.values = in.keys;
    in.scores = HeadsView<const double>::heads_major(scores.data(), Hkv, L, 1);
    if (!lengths.empty()) in.lengths = lengths.data();
  }
  Index length(Index h) const { return lengths.empty() ? L : lengths[static_cast<std::size_t>(h)]; }
  double score(Index h, Index j) const { return scores[static_cast<std::size_t>(h * L + j)]; }
};

kvevict::EngineScores engine(Index window, kvevict::LayoutParams layout = {}) {
  kvevict::EngineScores::Params p;
  p.window = window;
  static_cast<kvevict::LayoutParams&>(p) = layout;
  return kvevict::EngineScores(p);
}

Rows head_rows(const Selection& s, Index h) { return {s.head(h).begin(), s.head(h).end()}; }

/// The float64 brute force: entries of every layer, the window (the last w of each head) above every score; the
/// count of each scope clamped to [lo, hi] and to what it holds; the best that many in the order score (window
/// first), position descending, layer, head.
std::vector<std::vector<Rows>> brute_force(const std::vector<const Layer*>& layers, Index w, double tau, Index lo,
                                           Index hi, Scope scope) {
  struct E {
    double score;
    std::int64_t pos;
    std::size_t layer;
    Index head;
  };
  const auto before = [](const E& a, const E& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.pos != b.pos) return a.pos > b.pos;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.head < b.head;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const auto entries = [&](std::size_t l, Index h) {
    std::vector<E> out;
    const Layer& x = *layers[l];
    for (Index j = 0; j < x.length(h); ++j) out.push_back({j >= x.length(h) - w ? inf : x.score(h, j), j, l, h});
    return out;
  };
  const auto passing = [&](const std::vector<E>& es) {
    Index c = 0;
    for (const E& e : es) c += e.score >= tau ? 1 : 0;
    return c;
  };
  const auto clamp = [&](Index c, Index all) { return std::min(all, std::max(lo, std::min(hi, c))); };
  std::vector<std::vector<Rows>> kept(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) kept[l].assign(static_cast<std::size_t>(layers[l]->Hkv), Rows{});
  const auto keep_best = [&](std::vector<E> es, Index k) {
    std::sort(es.begin(), es.end(), before);
    for (Index i = 0; i < k; ++i)
      kept[es[static_cast<std::size_t>(i)].layer][static_cast<std::size_t>(es[static_cast<std::size_t>(i)].head)]
          .push_back(es[static_cast<std::size_t>(i)].pos);
  };
  std::vector<E> model;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::vector<E> layer;
    for (Index h = 0; h < layers[l]->Hkv; ++h) {
      const std::vector<E> head = entries(l, h);
      if (scope == Scope::head) keep_best(head, clamp(passing(head), static_cast<Index>(head.size())));
      layer.insert(layer.end(), head.begin(), head.end());
    }
    if (scope == Scope::layer) keep_best(layer, clamp(passing(layer), static_cast<Index>(layer.size())));
    model.insert(model.end(), layer.begin(), layer.end());
  }
  if (scope == Scope::model) keep_best(model, clamp(passing(model), static_cast<Index>(model.size())));
  for (auto& layer : kept)
    for (Rows& r : layer) std::sort(r.begin(), r.end());
  return kept;
}

}  // namespace

TEST_CASE("threshold budget: worked numbers on one and two KV heads", "[budget][threshold]") {
  // One KV head, L = 12, scores j / 12, no window: tau 0.5 keeps {6 .. 11} (6 / 12 reaches 0.5).
  std::vector<double> s(12);
  for (int j = 0; j < 12; ++j) s[static_cast<std::size_t>(j)] = j / 12.0;
  const Layer one(1, 12, s);
  const auto keep = [&](const kvevict::EngineScores& p, const Budget& b) {
    return head_rows(p.select<double>(one.in, b), 0);
  };
  CHECK(keep(engine(0), Budget::threshold(0.5)) == Rows{6, 7, 8, 9, 10, 11});
  CHECK(keep(engine(0), Budget::threshold(0.5).count_bounds(8, -1, Scope::head)) == Rows{4, 5, 6, 7, 8, 9, 10, 11});
  CHECK(keep(engine(0), Budget::threshold(0.5).count_bounds(0, 3, Scope::head)) == Rows{9, 10, 11});
  CHECK(keep(engine(0), Budget::threshold(2.0)).empty());  // nothing passes and no lower bound: the head keeps nothing
  // A window of 2 always passes: tau 0.95 keeps only the window; the window counts towards the bounds.
  CHECK(keep(engine(2), Budget::threshold(0.95)) == Rows{10, 11});
  CHECK(keep(engine(2), Budget::threshold(0.95).count_bounds(3, 5, Scope::head)) == Rows{9, 10, 11});
  // A protected prefix passes too.
  CHECK(keep(engine(2), Budget::threshold(0.95).protect_prefix(2)) == Rows{0, 1, 10, 11});

  // Two KV heads: head 0 scores j / 12, head 1 scores (11 - j) / 12; tau 0.75 passes 3 entries of each.
  std::vector<double> t = s;
  for (int j = 0; j < 12; ++j) t.push_back((11 - j) / 12.0);
  const Layer two(2, 12, t);
  const auto both = [&](const Budget& b) {
    const Selection x = engine(0).select<double>(two.in, b);
    return std::vector<Rows>{head_rows(x, 0), head_rows(x, 1)};
  };
  CHECK(both(Budget::threshold(0.75)) == std::vector<Rows>{{9, 10, 11}, {0, 1, 2}});
  // Per layer, at least 8: the next best are 8 / 12 of both heads; at least 9: then 7 / 12, head 0's (position 7 is
  // more recent than head 1's 4).
  CHECK(both(Budget::threshold(0.75).count_bounds(8, -1, Scope::layer)) ==
        std::vector<Rows>{{8, 9, 10, 11}, {0, 1, 2, 3}});
  CHECK(both(Budget::threshold(0.75).count_bounds(9, -1, Scope::layer)) ==
        std::vector<Rows>{{7, 8, 9, 10, 11}, {0, 1, 2, 3}});
  // Per layer, at most 4: 11 / 12 twice, then 10 / 12 twice (the ties go to the more recent position: head 0's 10).
  CHECK(both(Budget::threshold(0.75).count_bounds(0, 4, Scope::layer)) == std::vector<Rows>{{10, 11}, {0, 1}});
  CHECK(both(Budget::threshold(0.75).count_bounds(0, 3, Scope::layer)) == std::vector<Rows>{{10, 11}, {0}});
}

TEST_CASE("threshold budget: the float64 brute force on random ragged engine scores, every scope and bounds",
          "[budget][threshold]") {
  Rng rng(3501);
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(120); ++c) {
    const auto pick = [&](int a, int b) { return static_cast<Index>(std::uniform_int_distribution<int>(a, b)(rng)); };
    const Index NL = pick(1, 3), Hkv = pick(1, 3), L = pick(4, 40), w = pick(0, 3);
    std::vector<Layer> layers;
    layers.reserve(static_cast<std::size_t>(NL));
    for (Index l = 0; l < NL; ++l) {
      std::vector<double> s(static_cast<std::size_t>(Hkv * L));
      for (double& x : s)
        x = c % 4 == 0 ? std::floor(std::uniform_real_distribution<double>(0, 4)(rng)) / 4
                       : std::uniform_real_distribution<double>(0, 1)(rng);  // ties, or none
      std::vector<Index> lens;
      if (c % 3 == 1)
        for (Index h = 0; h < Hkv; ++h) lens.push_back(pick(static_cast<int>(w) + 1, static_cast<int>(L)));
      layers.emplace_back(Hkv, L, s, lens);
    }
    std::vector<const Layer*> ptrs;
    std::vector<kvevict::LayerInputs<double>> inputs;
    for (const Layer& l : layers) ptrs.push_back(&l), inputs.push_back(l.in);
    const double tau = c % 4 == 0 ? 0.5 : std::uniform_real_distribution<double>(0, 1)(rng);
    for (const Scope scope : {Scope::head, Scope::layer, Scope::model}) {
      const Index unit = scope == Scope::head ? 1 : scope == Scope::layer ? Hkv : NL * Hkv;
      const Index lo = pick(0, static_cast<int>(unit * L / 2)),
                  hi = c % 2 ? -1 : lo + pick(0, static_cast<int>(unit * L / 2));
      const Budget b = Budget::threshold(tau).count_bounds(lo, hi, scope);
      INFO("case " << c << " NL " << NL << " Hkv " << Hkv << " L " << L << " w " << w << " tau " << tau << " lo " << lo
                   << " hi " << hi << " scope " << static_cast<int>(scope));
      const auto want = brute_force(ptrs, w, tau, lo, hi < 0 ? std::numeric_limits<Index>::max() : hi, scope);
      const std::vector<Selection> got = kvevict::select_layers<double>(engine(w), inputs, b);
      for (std::size_t l = 0; l < layers.size(); ++l)
        for (Index h = 0; h < Hkv; ++h) {
          REQUIRE(head_rows(got[l], h) == want[l][static_cast<std::size_t>(h)]);
          ++compared;
        }
    }
  }
  CHECK(compared > kvevict_test::cases(500));
}

TEST_CASE("threshold budget: bounds that pin the count select as the count budgets do", "[budget][threshold]") {
  // lo = hi = n per head is Budget::tokens(n) under a uniform allocation; lo = hi = Hkv n per layer is the flat top-k
  // of a head-adaptive allocation without safeguard; lo = hi over the model is the layer-global allocation.
  Rng rng(3502);
  for (int c = 0; c < kvevict_test::cases(24); ++c) {
    const Shape s = kvevict_test::random_shape(rng, 120);
    std::vector<kvevict_test::VStored<double>> stored;
    std::vector<kvevict::LayerInputs<double>> layers;
    for (int l = 0; l < 2; ++l)
      stored.push_back(kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major));
    for (const auto& st : stored) layers.push_back(st.in);
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    INFO(kvevict_test::describe(s) << " n " << n);
    const double tau = std::uniform_real_distribution<double>(0, 1)(rng);
    const auto pinned = [&](Index count, Scope scope) {
      return Budget::threshold(tau).count_bounds(count, count, scope);
    };
    const auto same = [](const std::vector<Selection>& a, const std::vector<Selection>& b) {
      for (std::size_t l = 0; l < a.size(); ++l)
        if (a[l].indices() != b[l].indices() || a[l].offsets() != b[l].offsets()) return false;
      return true;
    };
    kvevict::SnapKV::Params snap;
    snap.window = s.w;
    CHECK(same(kvevict::select_layers<double>(kvevict::SnapKV(snap), layers, pinned(n, Scope::head)),
               kvevict::select_layers<double>(kvevict::SnapKV(snap), layers, Budget::tokens(n))));
    kvevict::CriticalSnapKV::Params critical;
    critical.window = s.w;
    CHECK(same(kvevict::select_layers<double>(kvevict::CriticalSnapKV(critical), layers, pinned(n, Scope::head)),
               kvevict::select_layers<double>(kvevict::CriticalSnapKV(critical), layers, Budget::tokens(n))));
    kvevict::AdaKV::Params ada;
    ada.window = s.w;
    ada.alpha = 0.0;
    CHECK(same(kvevict::select_layers<double>(kvevict::AdaKV(ada), layers, pinned(s.Hkv * n, Scope::layer)),
               kvevict::select_layers<double>(kvevict::AdaKV(ada), layers, Budget::tokens(n))));
    kvevict::LayerGlobalPolicy<kvevict::AttentionSelector>::Params global;
    global.window = s.w;
    const kvevict::LayerGlobalPolicy<kvevict::AttentionSelector> layer_global(global);
    CHECK(same(layer_global.select<double>(layers, pinned(2 * s.Hkv * n, Scope::model)),
               layer_global.select<double>(layers, Budget::tokens(n))));
  }
}

TEST_CASE("threshold budget: every catalogue policy under every layout, monotone in tau, shared and whole",
          "[budget][threshold]") {
  Rng rng(3503);
  const Shape s{8, 2, 8, 96, 16};
  std::vector<kvevict_test::VStored<float>> stored;
  std::vector<kvevict::LayerInputs<float>> layers;
  for (int l = 0; l < 2; ++l)
    stored.push_back(kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 32, rng), Layout::heads_major));
  for (const auto& st : stored) layers.push_back(st.in);
  for (const kvevict_test::EngineLayout layout : kvevict_test::engine_layouts()) {
    kvevict::Knobs k;
    k.window = s.w;
    k.share = layout.share;
    k.block = layout.block;
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      INFO(e.name << " share " << kvevict::to_string(layout.share) << " block " << layout.block);
      const auto policy = e.make(k);
      if (e.name == std::string("pyramidkv")) {  // a scheduled count per layer
        CHECK_THROWS_MATCHES(kvevict::select_layers(policy, layers, Budget::threshold(0.1)), kvevict::invalid_argument,
                             MessageContains("a threshold budget decides its counts from the scores"));
        return;
      }
      std::vector<std::vector<Selection>> by_tau;
      for (const Scope scope : {Scope::head, Scope::layer, Scope::model}) {
        const Index lo = layout.block * 2, hi = scope == Scope::head ? 48 : scope == Scope::layer ? 96 : 192;
        const Budget bounded = Budget::threshold(0.02).count_bounds(lo, hi, scope);
        for (const Selection& x : kvevict::select_layers(policy, layers, bounded)) {
          Index total = 0;
          for (Index h = 0; h < s.Hkv; ++h) {
            total += x.length(h);
            if (layout.share != kvevict::Sharing::per_head) CHECK(head_rows(x, h) == head_rows(x, 0));
            if (layout.block > 1) CHECK(x.length(h) % layout.block == 0);  // L = 96: whole blocks, no tail
          }
          if (scope == Scope::head) CHECK(total <= s.Hkv * hi);
          if (scope == Scope::layer) CHECK(total <= (layout.share == kvevict::Sharing::per_head ? hi : s.Hkv * hi));
        }
      }
      // Without bounds, a higher threshold keeps a subset (CriticalKV's two stages excepted: its count comes from the
      // first stage's scores, the rows from the second).
      const bool two_stage = e.name == std::string("criticalkv") || e.name == std::string("criticalkv-snapkv");
      const auto low = kvevict::select_layers(policy, layers, Budget::threshold(0.005));
      const auto high = kvevict::select_layers(policy, layers, Budget::threshold(0.05));
      for (std::size_t l = 0; l < low.size(); ++l)
        for (Index h = 0; h < s.Hkv; ++h) {
          const Rows a = head_rows(low[l], h), b = head_rows(high[l], h);
          CHECK(b.size() <= a.size());
          if (!two_stage) CHECK(std::includes(a.begin(), a.end(), b.begin(), b.end()));
        }
    });
  }
}

TEST_CASE("threshold budget: bad input is refused by name", "[budget][threshold][errors]") {
  CHECK_THROWS_MATCHES(Budget::threshold(std::numeric_limits<double>::quiet_NaN()), kvevict::invalid_argument,
                       MessageContains("the threshold must be finite"));
  CHECK_THROWS_MATCHES(Budget::tokens(4).count_bounds(1, 2, Scope::head), kvevict::invalid_argument,
                       MessageContains("count bounds apply to a threshold budget"));
  CHECK_THROWS_MATCHES(Budget::threshold(0.1).count_bounds(-1, 2, Scope::head), kvevict::invalid_argument,
                       MessageContains("the lower bound must be >= 0, got -1"));
  CHECK_THROWS_MATCHES(Budget::threshold(0.1).count_bounds(5, 2, Scope::layer), kvevict::invalid_argument,
                       MessageContains("the upper bound must be >= the lower bound (5)"));
  // What the selectors that read n_kept see: L, or a per-head upper bound below it.
  CHECK(Budget::threshold(0.1).n_kept(40) == 40);
  CHECK(Budget::threshold(0.1).count_bounds(0, 8, Scope::head).n_kept(40) == 8);
  CHECK(Budget::threshold(0.1).count_bounds(0, 8, Scope::layer).n_kept(40) == 40);

  std::vector<double> s(12, 0.5);
  const Layer one(1, 12, s);
  const Budget per_model = Budget::threshold(0.1).count_bounds(0, 4, Scope::model);
  CHECK_THROWS_MATCHES(engine(0).select<double>(one.in, per_model, 0, 3), kvevict::invalid_argument,
                       MessageContains("a threshold budget bounded per model selects every layer at once"));
  kvevict::CacheBook book(1, 1, 16);
  book.append(12);
  CHECK_THROWS_MATCHES(
      kvevict::evict_over_budget(
          engine(0), book, Budget::threshold(0.1), [&](Index) { return one.in; }, [](Index, const Selection&) {}),
      kvevict::invalid_argument, MessageContains("token budget"));
}

}  // namespace test_threshold_budget
