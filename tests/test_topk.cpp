// ranking/score_map.hpp and ranking/topk.hpp: tiers and the deterministic top-k of docs/algorithms.md#ties.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_topk {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::extend::KeepFlags;
using kvevict::extend::ScoreMap;
using kvevict::extend::Tier;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::sz;

namespace {

// Brute force: every flat entry sorted by (tier desc, score desc, token desc, head asc), first k.
std::vector<std::size_t> brute_top_k(const ScoreMap<double>& m, std::vector<std::size_t> cand, std::size_t k) {
  std::sort(cand.begin(), cand.end(), [&](std::size_t a, std::size_t b) {
    if (m.tier[a] != m.tier[b]) return m.tier[a] > m.tier[b];
    if (m.score[a] != m.score[b]) return m.score[a] > m.score[b];
    const std::size_t ja = a % sz(m.tokens), jb = b % sz(m.tokens);
    if (ja != jb) return ja > jb;
    return a < b;
  });
  cand.resize(k);
  return cand;
}

ScoreMap<double> random_map(Rng& rng, Index heads, Index tokens, int levels, bool tiers) {
  ScoreMap<double> m(heads, tokens);
  m.score = kvevict_test::quantised_scores(sz(heads * tokens), levels, rng);
  if (tiers) {
    std::uniform_int_distribution<int> t(0, 5);
    for (Index h = 0; h < heads; ++h)
      for (Index j = 0; j < tokens; ++j) {
        const int r = t(rng);
        if (r == 4) m.promote(h, j, Tier::window);
        if (r == 5) m.promote(h, j, Tier::forced);
      }
  }
  return m;
}

}  // namespace

TEST_CASE("ScoreMap: construction, with_window, flat indexing", "[topk][score_map]") {
  const ScoreMap<double> empty(3, 4);
  CHECK(empty.heads == 3);
  CHECK(empty.tokens == 4);
  CHECK(empty.score == std::vector<double>(12, 0.0));
  CHECK(std::all_of(empty.tier.begin(), empty.tier.end(), [](Tier t) { return t == Tier::scored; }));

  kvevict::RowMatrix<double> prefix(2, 3);
  prefix << 1, 2, 3, 4, 5, 6;
  const ScoreMap<double> m = ScoreMap<double>::with_window(prefix, 2);
  REQUIRE(m.heads == 2);
  REQUIRE(m.tokens == 5);
  for (Index h = 0; h < 2; ++h) {
    for (Index j = 0; j < 3; ++j) {
      CHECK(m.at(h, j) == prefix(h, j));
      CHECK(m.tier_of(h, j) == Tier::scored);
      CHECK(m.flat(h, j) == sz(h * 5 + j));
    }
    for (Index j = 3; j < 5; ++j) {
      CHECK(m.tier_of(h, j) == Tier::window);
      CHECK(m.at(h, j) == 0.0);
    }
  }
}

TEST_CASE("ScoreMap::promote only moves entries up: a forced entry keeps its score, a window entry's is cleared",
          "[topk][score_map]") {
  ScoreMap<double> m(1, 3);
  m.at(0, 0) = 0.5;
  m.promote(0, 0, Tier::forced);
  CHECK(m.tier_of(0, 0) == Tier::forced);
  CHECK(m.at(0, 0) == 0.5);  // forced entries rank among themselves by score
  m.promote(0, 0, Tier::window);
  CHECK(m.tier_of(0, 0) == Tier::window);
  CHECK(m.at(0, 0) == 0.0);
  m.promote(0, 0, Tier::forced);  // never down
  CHECK(m.tier_of(0, 0) == Tier::window);
  m.promote(0, 0, Tier::safeguard);  // an allocation's guarantee ranks above the window
  CHECK(m.tier_of(0, 0) == Tier::safeguard);
  m.at(0, 1) = 0.25;
  m.promote(0, 1, Tier::scored);  // no-op
  CHECK(m.tier_of(0, 1) == Tier::scored);
  CHECK(m.at(0, 1) == 0.25);
}

TEST_CASE("ScoreMap::require_finite names the first non-finite scored entry and ignores promoted ones",
          "[topk][score_map][errors]") {
  ScoreMap<double> m(2, 4);
  CHECK_NOTHROW(m.require_finite("select"));
  m.at(1, 2) = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_THROWS_MATCHES(m.require_finite("select"), kvevict::invalid_argument,
                         MessageContains("kvevict::select: score of KV head 1, token 2 is not finite"));
  m.at(1, 2) = 0.0;
  m.at(0, 3) = -std::numeric_limits<double>::infinity();
  REQUIRE_THROWS_MATCHES(m.require_finite("select"), kvevict::invalid_argument, MessageContains("not finite (-inf)"));
  m.promote(0, 3, Tier::window);
  CHECK_NOTHROW(m.require_finite("select"));
}

TEST_CASE("top_k_of_head matches a full sort in the docs/algorithms.md#ties order, with many exact ties and all tiers",
          "[topk]") {
  Rng rng(61);
  for (int t = 0; t < 60; ++t) {
    const Index heads = std::uniform_int_distribution<Index>(1, 8)(rng);
    const Index tokens = std::uniform_int_distribution<Index>(1, t < 50 ? 40 : 700)(rng);
    const int levels = std::uniform_int_distribution<int>(1, 4)(rng);
    const ScoreMap<double> m = random_map(rng, heads, tokens, levels, t % 2 == 0);
    for (Index h = 0; h < heads; ++h)
      for (Index k : {Index(0), Index(1), tokens / 2, tokens - 1, tokens}) {
        if (k < 0) continue;
        INFO("heads=" << heads << " tokens=" << tokens << " levels=" << levels << " head=" << h << " k=" << k);
        KeepFlags keep(m.score.size(), 0);
        kvevict::extend::top_k_of_head(m, h, k, keep);
        std::vector<std::size_t> cand(sz(tokens));
        for (Index j = 0; j < tokens; ++j) cand[sz(j)] = m.flat(h, j);
        KeepFlags want(m.score.size(), 0);
        for (std::size_t f : brute_top_k(m, cand, sz(k))) want[f] = 1;
        REQUIRE(keep == want);  // other heads untouched, exactly the top k of head h
      }
  }
}

TEST_CASE("top_k_counts matches a full sort of the flattened layer, with and without an eligibility filter", "[topk]") {
  Rng rng(62);
  for (int t = 0; t < 60; ++t) {
    const Index heads = std::uniform_int_distribution<Index>(1, 8)(rng);
    const Index tokens = std::uniform_int_distribution<Index>(1, t < 50 ? 40 : 700)(rng);
    const int levels = std::uniform_int_distribution<int>(1, 4)(rng);
    const ScoreMap<double> m = random_map(rng, heads, tokens, levels, t % 2 == 1);
    std::vector<std::size_t> all(m.score.size()), scored;
    std::iota(all.begin(), all.end(), std::size_t(0));
    for (std::size_t f : all)
      if (m.tier[f] == Tier::scored) scored.push_back(f);
    const Index n = heads * tokens;
    for (Index k : {Index(0), Index(1), Index(tokens), n / 3, n - 1, n}) {
      if (k < 0) continue;
      INFO("heads=" << heads << " tokens=" << tokens << " levels=" << levels << " k=" << k);
      std::vector<Index> want(sz(heads), 0);
      for (std::size_t f : brute_top_k(m, all, sz(k))) ++want[f / sz(tokens)];
      REQUIRE(kvevict::extend::top_k_counts(m, k) == want);
      if (sz(k) <= scored.size()) {
        std::vector<Index> want_s(sz(heads), 0);
        for (std::size_t f : brute_top_k(m, scored, sz(k))) ++want_s[f / sz(tokens)];
        REQUIRE(kvevict::extend::top_k_counts(m, k, [&](std::size_t f) { return m.tier[f] == Tier::scored; }) ==
                want_s);
      }
    }
  }
}

TEST_CASE("tie rule: equal scores go to the more recent token, then to the lower KV head", "[topk]") {
  ScoreMap<double> m(3, 5);  // all scores equal (0)
  KeepFlags keep(m.score.size(), 0);
  kvevict::extend::top_k_of_head(m, 1, 2, keep);
  for (Index j = 0; j < 5; ++j) CHECK(keep[m.flat(1, j)] == (j >= 3 ? 1 : 0));
  // Flat: 3 heads x 5 tokens all tied; the top 4 are token 4 of heads 0, 1, 2, then token 3 of head 0.
  CHECK(kvevict::extend::top_k_counts(m, 4) == std::vector<Index>{2, 1, 1});
  CHECK(kvevict::extend::top_k_counts(m, 3) == std::vector<Index>{1, 1, 1});
  CHECK(kvevict::extend::top_k_counts(m, 1) == std::vector<Index>{1, 0, 0});
  CHECK(kvevict::extend::top_k_counts(m, 7) == std::vector<Index>{3, 2, 2});
  // A higher score beats recency; a higher tier beats any score.
  m.at(2, 0) = 1.0;
  CHECK(kvevict::extend::top_k_counts(m, 1) == std::vector<Index>{0, 0, 1});
  m.promote(1, 0, Tier::window);
  CHECK(kvevict::extend::top_k_counts(m, 1) == std::vector<Index>{0, 1, 0});
  m.promote(0, 1, Tier::forced);  // forced ranks below the window, above every scored entry
  CHECK(kvevict::extend::top_k_counts(m, 1) == std::vector<Index>{0, 1, 0});
  CHECK(kvevict::extend::top_k_counts(m, 2) == std::vector<Index>{1, 1, 0});
  CHECK(kvevict::extend::top_k_counts(m, 3) == std::vector<Index>{1, 1, 1});
  m.promote(2, 3, Tier::safeguard);  // the safeguard ranks above the window
  CHECK(kvevict::extend::top_k_counts(m, 1) == std::vector<Index>{0, 0, 1});
}

TEST_CASE("forced entries rank among themselves by score, then by recency", "[topk]") {
  ScoreMap<double> m(1, 6);
  for (Index j = 0; j < 6; ++j) m.at(0, j) = j == 3 ? 5.0 : 1.0;
  for (Index j : {0, 1, 3}) m.promote(0, j, Tier::forced);
  m.promote(0, 5, Tier::window);
  KeepFlags keep(6, 0);
  kvevict::extend::top_k_of_head(m, 0, 2, keep);  // the window, then the best forced entry (token 3: 5.0)
  CHECK(keep == KeepFlags{0, 0, 0, 1, 0, 1});
  keep.assign(6, 0);
  kvevict::extend::top_k_of_head(m, 0, 3, keep);  // then the more recent of the forced tie (token 1)
  CHECK(keep == KeepFlags{0, 1, 0, 1, 0, 1});
}

TEST_CASE("within the window tier entries rank by recency only", "[topk]") {
  ScoreMap<double> m(1, 6);
  for (Index j = 0; j < 6; ++j) m.at(0, j) = static_cast<double>(10 - j);
  for (Index j : {0, 2, 4}) m.promote(0, j, Tier::window);
  KeepFlags keep(6, 0);
  kvevict::extend::top_k_of_head(m, 0, 2, keep);
  CHECK(keep == KeepFlags{0, 0, 1, 0, 1, 0});
  keep.assign(6, 0);
  kvevict::extend::top_k_of_head(m, 0, 4, keep);  // the window tier, then the best scored (token 1: 9)
  CHECK(keep == KeepFlags{1, 1, 1, 0, 1, 0});
}

TEST_CASE("top-k in float scores behaves like double", "[topk]") {
  Rng rng(63);
  ScoreMap<float> mf(4, 50);
  ScoreMap<double> md(4, 50);
  md.score = kvevict_test::quantised_scores(200, 3, rng);
  mf.score = kvevict_test::cast_to<float>(md.score);
  for (Index k : {0, 1, 33, 100, 200})
    CHECK(kvevict::extend::top_k_counts(mf, k) == kvevict::extend::top_k_counts(md, k));
}

}  // namespace test_topk
