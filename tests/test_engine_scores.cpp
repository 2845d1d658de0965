// docs/algorithms.md#engine-scores: EngineScoreSelector ranks the scores the engine gives (LayerInputs::scores) as any
// selector's; worked numbers, the float64 layout reference on random ragged layers under every layout (per-layer
// and layer-global allocations, pooling), the storage types, streaming, and bad input refused by name.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"
#include "support/reference.hpp"
#include "support/reference_layout.hpp"

namespace test_engine_scores {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::MessageContains;
using kvevict_test::Ragged;
using kvevict_test::Rng;
using kvevict_test::rows_of;
namespace ref = kvevict_ref::ragged;
namespace lref = kvevict_ref::layout;

namespace {

using Rows = std::vector<std::int64_t>;

/// A dense layer [Hkv = 2, L = 12, d = 2] whose scores are `scores` [2, 12] (keys are never read for the ranking).
struct Dense {
  std::vector<float> keys = std::vector<float>(2 * 12 * 2, 1.0f);
  std::vector<float> scores;
  kvevict::LayerInputs<float> in;
  explicit Dense(std::vector<float> s) : scores(std::move(s)) {
    in.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, 12, 2);
    in.scores = HeadsView<const float>::heads_major(scores.data(), 2, 12, 1);
  }
};

// SnapKV's worked prefix scores (docs/algorithms.md#allocation); the window entries carry scores the window tier
// ignores (-5, 9: neither the lowest nor the highest may matter).
const std::vector<float> kWorked = {.10f, .50f, .20f, .05f, .30f, .01f, .02f, .40f, -5, 9,  -5, 9,
                                    .03f, .70f, .06f, .90f, .65f, .08f, .09f, .60f, 9,  -5, 9,  -5};

template <class P>
P with_window(Index w, kvevict::LayoutParams layout = {}) {
  typename P::Params p;
  p.window = w;
  static_cast<kvevict::LayoutParams&>(p) = layout;
  return P(p);
}

/// NL random ragged layers (every head its own positions), or one set per layer / per model.
std::vector<Ragged> random_model(Rng& rng, int NL, int H, int Hkv, int w, int T, kvevict::Sharing share) {
  std::vector<Ragged> layers;
  for (int l = 0; l < NL; ++l) {
    Ragged r = kvevict_test::random_ragged(rng, H, Hkv, w, 4, T, 0.5);
    for (int h = 0; h < Hkv; ++h) {
      auto& head = r.heads[static_cast<std::size_t>(h)];
      const auto& src = share == kvevict::Sharing::per_model   ? (l == 0 ? r.heads[0] : layers.front().heads[0])
                        : share == kvevict::Sharing::per_layer ? r.heads[0]
                                                               : head;
      if (&src == &head) continue;
      head.pos = src.pos;
      head.keys = src.keys;
      head.values = src.values;
    }
    layers.push_back(r);
  }
  return layers;
}

/// The float64 reference: each head's prefix entries scored by engine_score() of their position, pooled, the
/// window in its tier; then the layout reference's allocation.
std::vector<ref::KeptRows> reference(const std::vector<Ragged>& model, std::int64_t n, lref::Allocation allocation,
                                     int kernel, const lref::Layout& layout) {
  lref::Maps maps;
  for (const Ragged& r : model) {
    const ref::Positions pos = ref::positions(r);
    ref::Ragged scores(pos.size());
    for (std::size_t h = 0; h < pos.size(); ++h) {
      std::vector<double> prefix;
      for (std::size_t j = 0; j + static_cast<std::size_t>(r.w) < pos[h].size(); ++j)
        prefix.push_back(kvevict_test::engine_score(static_cast<int>(h), pos[h][j]));
      scores[h] = kvevict_ref::pool1d(prefix, kernel, kvevict_ref::Pool::avg);
    }
    maps.pos.push_back(pos);
    maps.w.push_back(r.w);
    maps.alloc.push_back(lref::token_map(scores, pos, r.w));
  }
  lref::AllocParams ap;
  ap.allocation = allocation;
  return lref::select_maps(maps, std::vector<std::int64_t>(model.size(), n), ap, layout);
}

}  // namespace

TEST_CASE("engine scores: worked numbers", "[engine_scores]") {
  const Dense layer(kWorked);
  // n_kept 6, w 4: the flat top-k gives the layer's 4 scored places to .90, .70, .65, .60, all of head 1.
  const Selection flat = with_window<kvevict::EngineScores>(4).select(layer.in, Budget::tokens(6));
  CHECK(rows_of(flat)[0] == Rows{8, 9, 10, 11});
  CHECK(rows_of(flat)[1] == Rows{1, 3, 4, 7, 8, 9, 10, 11});
  // Uniform (SnapKV's allocation): each head its window and its top 2: SnapKV's worked selection.
  using Uniform = kvevict::Policy<kvevict::SnapKV, kvevict::EngineScoreSelector>;
  Uniform::Params up;  // SnapKV's defaults: pooled with kernel 5; the engine's scores are used as they are
  up.window = 4;
  up.kernel = 1;
  const Selection uniform = Uniform(up).select(layer.in, Budget::tokens(6));
  CHECK(rows_of(uniform)[0] == Rows{1, 7, 8, 9, 10, 11});
  CHECK(rows_of(uniform)[1] == Rows{1, 3, 8, 9, 10, 11});
  // Window 0: every entry competes by its score (the 9s now win, the -5s lose).
  const Selection open = with_window<kvevict::EngineScores>(0).select(layer.in, Budget::tokens(3));
  CHECK(rows_of(open)[0] == Rows{9, 11});  // the layer's 6 largest: the four 9s, then .90 and .70
  CHECK(rows_of(open)[1] == Rows{1, 3, 8, 10});
  // Layer-global over two copies of the layer: the same top-k per layer, ties to the lower layer.
  const std::vector<kvevict::LayerInputs<float>> two = {layer.in, layer.in};
  const std::vector<Selection> global = with_window<kvevict::LayerEngineScores>(4).select(two, Budget::tokens(6));
  CHECK(rows_of(global[0]) == rows_of(flat));
  CHECK(rows_of(global[1]) == rows_of(flat));
}

TEST_CASE("engine scores: the float64 layout reference, random ragged layers", "[engine_scores][reference]") {
  Rng rng(3507);
  int compared = 0;
  for (int trial = 0; trial < 12; ++trial) {
    const int Hkv = 1 + trial % 3, w = 1 + trial % 3, NL = 1 + trial % 3, T = 30 + 7 * trial;
    for (kvevict::Sharing share :
         {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model}) {
      const std::vector<Ragged> model = random_model(rng, NL, 2 * Hkv, Hkv, w, T, share);
      std::vector<kvevict_test::RaggedStored<double>> stored;
      std::vector<kvevict::LayerInputs<double>> inputs;
      Index min_entries = std::numeric_limits<Index>::max();
      for (const Ragged& r : model) {
        stored.push_back(kvevict_test::store<double>(r, kvevict_test::longest(r) + 2, trial % 2 == 1,
                                                     std::numeric_limits<double>::quiet_NaN(), 5 * trial));
        Index entries = 0;
        for (int h = 0; h < Hkv; ++h) entries += kvevict_test::length(r, h);
        min_entries = std::min(min_entries, entries / Hkv);
      }
      for (const auto& s : stored) inputs.push_back(s.in);
      for (Index block : {Index(1), Index(3)})
        for (kvevict::Reduce reduce : {kvevict::Reduce::max, kvevict::Reduce::mean})
          for (int kernel : {1, 3})
            for (Index n : {std::max<Index>(block, w), std::max<Index>(block, min_entries / 2)}) {
              if (n > min_entries) continue;
              kvevict::LayoutParams layout;
              layout.share = share;
              layout.block = block;
              layout.reduce = reduce;
              lref::Layout rl;
              rl.share = share == kvevict::Sharing::per_head    ? lref::Share::per_head
                         : share == kvevict::Sharing::per_layer ? lref::Share::per_layer
                                                                : lref::Share::per_model;
              rl.reduce = reduce == kvevict::Reduce::max ? lref::Reduce::max : lref::Reduce::mean;
              rl.block = block;
              kvevict::EngineScores::Params fp;
              kvevict::LayerEngineScores::Params gp;
              fp.window = gp.window = w;
              fp.kernel = gp.kernel = kernel;
              static_cast<kvevict::LayoutParams&>(fp) = layout;
              static_cast<kvevict::LayoutParams&>(gp) = layout;
              INFO("trial " << trial << " share " << kvevict::to_string(share) << " block " << block << " reduce "
                            << kvevict::to_string(reduce) << " kernel " << kernel << " n " << n);
              const Budget budget = Budget::tokens(n);
              CHECK(rows_of(kvevict::select_layers<double>(kvevict::EngineScores(fp), inputs, budget)) ==
                    reference(model, n, lref::Allocation::head_adaptive, kernel, rl));
              CHECK(rows_of(kvevict::select_layers<double>(kvevict::LayerEngineScores(gp), inputs, budget)) ==
                    reference(model, n, lref::Allocation::layer_global, kernel, rl));
              compared += 2;
            }
    }
  }
  CHECK(compared > 300);
}

TEST_CASE("engine scores: every storage type selects as float64 on scores it holds exactly", "[engine_scores]") {
  // Scores that are multiples of 1/8 in [0, 2): exact in half, bfloat16, float and double.
  std::vector<double> s(2 * 12);
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<double>((i * 7) % 16) / 8.0;
  const std::vector<double> keys(2 * 12 * 2, 1.0);
  const auto select = [&](auto zero) {
    using T = decltype(zero);
    const std::vector<T> k = kvevict_test::cast_to<T>(keys), sc = kvevict_test::cast_to<T>(s);
    kvevict::LayerInputs<T> in;
    in.keys = kvevict::kv_heads_major<const T>(k.data(), 2, 12, 2);
    in.scores = HeadsView<const T>::heads_major(sc.data(), 2, 12, 1);
    return rows_of(with_window<kvevict::EngineScores>(2).select(in, Budget::tokens(5)));
  };
  const auto want = select(0.0);
  CHECK(select(0.0f) == want);
  CHECK(select(Eigen::half(0)) == want);
  CHECK(select(Eigen::bfloat16(0)) == want);
}

TEST_CASE("engine scores: eviction while the cache grows reads the scores of what each head holds", "[engine_scores]") {
  // Two KV heads, d 2: grow to 20 entries in steps of 5, evicting to 8 per head after each; the engine scores an
  // entry by engine_score(h, position), so the kept set is always the window plus the best of what is held.
  kvevict::CacheBook book(1, 2, 32);
  std::vector<float> keys(2 * 32 * 2, 1.0f), scores(2 * 32, 0.0f);
  const kvevict::EngineScores policy = with_window<kvevict::EngineScores>(2);
  std::vector<std::vector<std::int64_t>> held(2);
  for (int step = 0; step < 4; ++step) {
    book.append(5);
    for (Index h = 0; h < 2; ++h) {
      held[static_cast<std::size_t>(h)].clear();
      for (Index j = 0; j < book.layer(0).length(h); ++j) {
        const std::int64_t p = book.layer(0).position(h, j);
        held[static_cast<std::size_t>(h)].push_back(p);
        scores[static_cast<std::size_t>(h * 32 + j)] = static_cast<float>(kvevict_test::engine_score(int(h), p));
      }
    }
    std::vector<std::vector<std::int64_t>> want(2);
    for (std::size_t h = 0; h < 2; ++h) {
      const auto& pos = held[h];
      std::vector<std::int64_t> prefix(pos.begin(), pos.end() - 2);
      if (pos.size() > 8) {
        std::sort(prefix.begin(), prefix.end(), [&](std::int64_t a, std::int64_t b) {
          return kvevict_test::engine_score(int(h), a) > kvevict_test::engine_score(int(h), b);
        });
        prefix.resize(6);
      }
      want[h] = prefix;
      want[h].insert(want[h].end(), pos.end() - 2, pos.end());
      std::sort(want[h].begin(), want[h].end());
    }
    kvevict::evict_over_budget(
        policy, book, 8,
        [&](Index) {
          kvevict::LayerInputs<float> in;
          in.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, 32, 2);
          in.scores = HeadsView<const float>::heads_major(scores.data(), 2, 32, 1);
          return book.layer(0).describe(in);
        },
        [&](Index, const Selection& s) { book.layer(0).apply(s); });
    for (Index h = 0; h < 2; ++h) {
      std::vector<std::int64_t> got;
      for (Index j = 0; j < book.layer(0).length(h); ++j) got.push_back(book.layer(0).position(h, j));
      INFO("step " << step << " head " << h);
      // The flat top-k may give one head more than the other; each head keeps a prefix of its own ranking.
      CHECK(std::includes(want[static_cast<std::size_t>(h)].begin(), want[static_cast<std::size_t>(h)].end(),
                          got.end() - 2, got.end()));
    }
    CHECK(book.layer(0).entries() <= 16);
  }
}

TEST_CASE("engine scores: bad input is refused by name", "[engine_scores][errors]") {
  const std::vector<float> keys(2 * 8 * 2, 1.0f);
  kvevict::LayerInputs<float> in;
  in.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, 8, 2);
  const kvevict::EngineScores policy = with_window<kvevict::EngineScores>(2);
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("kvevict::EngineScores::select: needs LayerInputs::scores [kv_heads, >= "
                                         "entries, 1], the score the engine computed for each cached entry"));
  std::vector<float> s(2 * 7, 1.0f);
  in.scores = HeadsView<const float>::heads_major(s.data(), 2, 7, 1);
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("scores [2, 7, 1] must be [kv_heads = 2, >= 8 entries, 1]"));
  s.assign(2 * 8 * 2, 1.0f);
  in.scores = HeadsView<const float>::heads_major(s.data(), 2, 8, 2);
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("scores [2, 8, 2] must be [kv_heads = 2, >= 8 entries, 1]"));
  s.assign(2 * 8, 1.0f);
  s[11] = std::numeric_limits<float>::infinity();
  in.scores = HeadsView<const float>::heads_major(s.data(), 2, 8, 1);
  REQUIRE_THROWS_MATCHES(policy.select(in, Budget::tokens(4)), kvevict::invalid_argument,
                         MessageContains("scores[1, 3] is not finite (inf)"));
  s[11] = 0.5f;
  CHECK(policy.select(in, Budget::tokens(4)).total() == 8);
  kvevict::EngineScores::Params p;
  p.kernel = 2;
  REQUIRE_THROWS_MATCHES(kvevict::EngineScores{p}, kvevict::invalid_argument,
                         MessageContains("kernel must be an odd number >= 1, got 2"));
}

}  // namespace test_engine_scores
