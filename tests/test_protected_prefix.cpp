// docs/algorithms.md#protected-prefix: a shared prompt prefix the engine marks protected is never evicted, counted in
// the budget or kept on top of it, under every policy of the catalogue and every layout (a page-table engine: one
// set per layer, blocks of 16), while the cache grows, and a budget that cannot hold it is refused by name. The float64
// layout reference comparison is in tests/test_layout_reference.cpp.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_protected_prefix {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;
using Counting = Budget::PrefixBudget;

namespace {

/// Every catalogue policy on `layers` under `knobs` and `budget` (model-wide or layer by layer, as the engine calls).
template <class F>
void for_each_policy(const kvevict::Knobs& knobs, F&& f) {
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    const auto policy = e.make(knobs);
    f(std::string(e.name), policy);
  });
}

/// Whether every KV head of every layer keeps rows 0 .. p - 1 (dense layers: row = position).
bool keeps_prefix(const std::vector<Selection>& model, Index p) {
  for (const Selection& s : model)
    for (Index h = 0; h < s.heads(); ++h) {
      Index held = 0;
      for (Index j : s.head(h)) held += j < p;
      if (held != p) return false;
    }
  return true;
}

Index kept_entries(const std::vector<Selection>& model) {
  Index n = 0;
  for (const Selection& s : model)
    for (Index h = 0; h < s.heads(); ++h) n += s.length(h);
  return n;
}

}  // namespace

TEST_CASE(
    "a page-table engine with a protected 256-token prefix and blocks of 16 keeps the prefix pages intact under "
    "every policy",
    "[protected][catalogue][layout]") {
  // Two layers of 512 entries (H 4, Hkv 2, d 16: small enough for the sanitized build), half of them the prefix.
  Rng rng(20261206);
  const Shape s{4, 2, 8, 512, 16};
  std::vector<kvevict_test::VStored<float>> stored;
  std::vector<kvevict::LayerInputs<float>> layers;
  for (int l = 0; l < 2; ++l)
    stored.push_back(
        kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 32, rng), kvevict_test::Layout::heads_major));
  for (const auto& st : stored) layers.push_back(st.in);
  int runs = 0;
  for (kvevict::Sharing share : {kvevict::Sharing::per_layer, kvevict::Sharing::per_head}) {
    kvevict::Knobs knobs;
    knobs.share = share;
    knobs.block = 16;
    knobs.window = s.w;  // the engine keeps the last 8 queries (TOVA observes its last one by default)
    for (const Budget& budget :
         {Budget::tokens(320).protect_prefix(256), Budget::tokens(64).protect_prefix(256, Counting::extra),
          Budget::keep_ratio(0.25).protect_prefix(200, Counting::extra)}) {
      for_each_policy(knobs, [&](const std::string& name, const auto& policy) {
        INFO(name << " share " << kvevict::to_string(share) << " prefix " << budget.protected_prefix()
                  << (budget.extra() ? " extra" : " counted"));
        const std::vector<Selection> got = kvevict::select_layers(policy, layers, budget);
        CHECK(keeps_prefix(got, budget.protected_prefix()));
        // Whole blocks of 16 over 512 rows keep at most the budget, and less than one block below it (keep ratio
        // .25 of the 312 entries past the prefix, plus 200, is 278).
        const Index per_head = budget.kind() == Budget::Kind::keep_ratio ? 278 : 320;
        CHECK(kept_entries(got) <= 2 * 2 * per_head);
        CHECK(kept_entries(got) > 2 * 2 * (per_head - 16));
        ++runs;
      });
    }
  }
  // Counted, a budget that cannot hold the prefix is refused by name.
  kvevict::Knobs pages;
  pages.share = kvevict::Sharing::per_layer;
  pages.block = 16;
  pages.window = s.w;
  for_each_policy(pages, [&](const std::string& name, const auto& policy) {
    INFO(name);
    REQUIRE_THROWS_MATCHES(kvevict::select_layers(policy, layers, Budget::tokens(200).protect_prefix(256)),
                           kvevict::invalid_argument, MessageContains("its protected prefix: a budget that counts"));
  });
  CHECK(runs > 60);
}

TEST_CASE("a protected prefix: worked numbers, counted or on top", "[protected]") {
  // One KV head, L 12, window 2, engine scores that favour the newest prefix tokens: j / 12.
  std::vector<float> keys(12 * 2, 1.0f), scores(12);
  for (int j = 0; j < 12; ++j) scores[static_cast<std::size_t>(j)] = static_cast<float>(j) / 12.0f;
  kvevict::LayerInputs<float> in;
  in.keys = kvevict::kv_heads_major<const float>(keys.data(), 1, 12, 2);
  in.scores = kvevict::HeadsView<const float>::heads_major(scores.data(), 1, 12, 1);
  kvevict::EngineScores::Params p;
  p.window = 2;
  const kvevict::EngineScores policy(p);
  auto rows = [&](const Budget& b) {
    const Selection sel = policy.select(in, b);
    return std::vector<Index>(sel.head(0).begin(), sel.head(0).end());
  };
  CHECK(rows(Budget::tokens(5)) == std::vector<Index>{7, 8, 9, 10, 11});
  // Counted: the prefix 0..2 first, then the window, then the best scored: 9.
  CHECK(rows(Budget::tokens(6).protect_prefix(3)) == std::vector<Index>{0, 1, 2, 9, 10, 11});
  // On top: 3 more, the form resolved against the 9 entries past the prefix (keep ratio .5: 4).
  CHECK(rows(Budget::tokens(3).protect_prefix(3, Counting::extra)) == std::vector<Index>{0, 1, 2, 9, 10, 11});
  CHECK(rows(Budget::keep_ratio(0.5).protect_prefix(3, Counting::extra)) == std::vector<Index>{0, 1, 2, 8, 9, 10, 11});
  // The prefix may cut the window (it ranks above it): 4 protected of a budget of 5 leave one window entry.
  CHECK(rows(Budget::tokens(5).protect_prefix(4)) == std::vector<Index>{0, 1, 2, 3, 11});
  // A prefix longer than the layer protects all of it; on top, it adds at most L.
  CHECK(rows(Budget::tokens(12).protect_prefix(40)).size() == 12);
  CHECK(rows(Budget::keep_ratio(0.5).protect_prefix(40, Counting::extra)).size() == 12);
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(1).protect_prefix(40, Counting::extra)),
                         kvevict::invalid_argument,
                         MessageContains("n_kept must be in [1, 12] (the context length), got 13 with 40 protected "
                                         "prefix positions on top"));
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(2).protect_prefix(3)), kvevict::invalid_argument,
                         MessageContains("the budget keeps 2 entries of KV head 0, fewer than the 3 entries of its "
                                         "protected prefix"));
  REQUIRE_THROWS_MATCHES(
      Budget::tokens(4).protect_prefix(-1), kvevict::invalid_argument,
      MessageContains("Budget::protect_prefix: the protected prefix must be >= 0 positions, got -1"));
  // The original AdaKV formula has no place for it: refused by name.
  kvevict::AdaKV::Params ap;
  ap.variant = kvevict::HeadAdaptiveAllocation::Variant::original;
  ap.window = 2;
  ap.kernel = 1;
  std::vector<float> q(2 * 2, 0.5f);
  in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), 1, 2, 2);
  REQUIRE_THROWS_MATCHES(kvevict::AdaKV(ap).select(in, Budget::tokens(6).protect_prefix(3)), kvevict::invalid_argument,
                         MessageContains("variant original): a protected prefix is not supported"));
}

TEST_CASE("a protected prefix survives eviction while the cache grows, on pages of 8 shared per layer",
          "[protected][streaming]") {
  // Two layers of two KV heads grow to 200 entries in steps of 10 and are evicted to 40 per head (counted) or
  // 16 + the 24 protected (on top) after each step: positions 0 .. 23 stay, whatever the engine's scores say.
  for (Counting counting : {Counting::counted, Counting::extra}) {
    kvevict::CacheBook book(2, 2, 64);
    std::vector<float> keys(2 * 64 * 2, 1.0f), scores(2 * 64, 0.0f);
    kvevict::EngineScores::Params p;
    p.window = 4;
    p.share = kvevict::Sharing::per_layer;
    p.block = 8;
    const kvevict::EngineScores policy(p);
    const Budget budget = counting == Counting::counted ? Budget::tokens(40).protect_prefix(24)
                                                        : Budget::tokens(16).protect_prefix(24, Counting::extra);
    for (int step = 0; step < 20; ++step) {
      book.append(10);
      kvevict::evict_over_budget(
          policy, book, budget,
          [&](Index l) {
            for (Index h = 0; h < 2; ++h)
              for (Index j = 0; j < book.layer(l).length(h); ++j)
                scores[static_cast<std::size_t>(h * 64 + j)] =
                    static_cast<float>(kvevict_test::engine_score(int(h + 2 * l), book.layer(l).position(h, j)));
            kvevict::LayerInputs<float> in;
            in.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, 64, 2);
            in.scores = kvevict::HeadsView<const float>::heads_major(scores.data(), 2, 64, 1);
            return book.layer(l).describe(in);
          },
          [&](Index l, const Selection& s) { book.layer(l).apply(s); });
      for (Index l = 0; l < 2; ++l)
        for (Index h = 0; h < 2; ++h) {
          INFO("step " << step << " layer " << l << " head " << h);
          const Index held = std::min<Index>(24, 10 * (step + 1));
          for (Index j = 0; j < held; ++j) CHECK(book.layer(l).position(h, j) == j);
          CHECK(book.layer(l).length(h) <= 40);
        }
    }
  }
  kvevict::CacheBook book(1, 1, 8);
  book.append(8);
  REQUIRE_THROWS_MATCHES(kvevict::evict_over_budget(
                             kvevict::StreamingLLM{}, book, Budget::keep_ratio(0.5),
                             [&](Index) { return kvevict::LayerInputs<float>{}; }, [&](Index, const Selection&) {}),
                         kvevict::invalid_argument, MessageContains("is evicted to a token budget (Budget::tokens)"));
}

}  // namespace test_protected_prefix
