// docs/algorithms.md#layouts on every catalogue policy: shared selections are identical across the shared
// heads (and layers), never over the budget, block selections are whole blocks plus each head's tail, the window
// is never cut for a group's forced entries, and the compaction plans reproduce compact(). The float64 reference
// comparison is in test_layout_reference.cpp.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_layout {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Reduce;
using kvevict::Selection;
using kvevict::Sharing;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

std::vector<std::int64_t> head_rows(const Selection& s, Index h) {
  const auto r = s.head(h);
  return {r.begin(), r.end()};
}

/// The rows at the end of each head that the policy keeps in its window tier: the window (OpenDefensiveKV's open
/// window keeps only the newest entry first; key-only and positional policies have window 0).
template <class Params>
Index kept_window(const Params& p) {
  if constexpr (std::is_base_of_v<kvevict::DefensiveSelector::Params, Params>)
    return p.open_window ? std::min<Index>(p.window, 1) : p.window;
  else
    return p.window;
}

/// docs/algorithms.md#layouts, "window first": a group that keeps at least as many whole blocks as its last
/// `window` rows span past its tail keeps all of those rows, whatever its members force. "" or the problem.
std::string window_errors(const Selection& s, Index h, Index L, Index B, Index window) {
  const auto rows = head_rows(s, h);
  const Index U = L / B, tail = L - U * B;
  const Index in_blocks =
      static_cast<Index>(std::count_if(rows.begin(), rows.end(), [&](std::int64_t j) { return j < U * B; })) / B;
  const Index window_blocks = (std::max<Index>(0, window - tail) + B - 1) / B;
  if (in_blocks < window_blocks) return "";  // too small a share to hold the window
  for (Index j = L - window; j < L; ++j)
    if (!std::binary_search(rows.begin(), rows.end(), static_cast<std::int64_t>(j)))
      return "head " + std::to_string(h) + " keeps " + std::to_string(in_blocks) + " whole blocks but not window row " +
             std::to_string(j);
  return "";
}

/// Checks the docs/algorithms.md#layouts invariants of one model's selections; returns "" or the first problem.
std::string layout_errors(const std::vector<Selection>& sels, const kvevict::LayoutParams& layout, Index L, Index n,
                          kvevict::BudgetScope scope, Index window) {
  const Index B = layout.block;
  Index model_total = 0;
  for (std::size_t l = 0; l < sels.size(); ++l) {
    const Selection& s = sels[l];
    Index layer_total = 0;
    for (Index h = 0; h < s.heads(); ++h) {
      const auto rows = head_rows(s, h);
      layer_total += static_cast<Index>(rows.size());
      if (layout.share != Sharing::per_head && rows != head_rows(sels[layout.share == Sharing::per_model ? 0 : l], 0))
        return "layer " + std::to_string(l) + " head " + std::to_string(h) + " differs from the shared set";
      // Whole blocks plus the tail [U B, L).
      const Index U = L / B;
      std::vector<int> in_block(static_cast<std::size_t>(U + 1), 0);
      for (std::int64_t j : rows) ++in_block[static_cast<std::size_t>(std::min<Index>(static_cast<Index>(j) / B, U))];
      for (Index u = 0; u < U; ++u)
        if (in_block[static_cast<std::size_t>(u)] != 0 && in_block[static_cast<std::size_t>(u)] != B)
          return "layer " + std::to_string(l) + " head " + std::to_string(h) + " keeps part of block " +
                 std::to_string(u);
      if (in_block[static_cast<std::size_t>(U)] != L - U * B) return "the tail is not kept whole";
      if (const std::string w = window_errors(s, h, L, B, window); !w.empty())
        return "layer " + std::to_string(l) + " " + w;
      if (B > 1) {
        const auto blocks = s.head_blocks(h);
        std::vector<std::int64_t> want;
        for (std::int64_t j : rows)
          if (want.empty() || want.back() != j / B) want.push_back(j / B);
        if (std::vector<std::int64_t>(blocks.begin(), blocks.end()) != want) return "head_blocks disagree with rows";
      }
    }
    const Index shared_heads = layout.share == Sharing::per_head ? s.heads() : 1;
    if (scope != kvevict::BudgetScope::model && layout.share != Sharing::per_model &&
        layer_total > shared_heads * n * (layout.share == Sharing::per_head ? 1 : s.heads()))
      return "layer " + std::to_string(l) + " keeps " + std::to_string(layer_total) + " entries, over its budget";
    model_total += layout.share == Sharing::per_head ? layer_total : layer_total / s.heads();
  }
  const auto NL = static_cast<Index>(sels.size());
  const Index heads = sels.front().heads();
  const Index budget = layout.share == Sharing::per_head    ? NL * heads * n
                       : layout.share == Sharing::per_layer ? NL * n
                                                            : NL * n;  // per_model: each layer counted once
  if (model_total > budget)
    return "the model keeps " + std::to_string(model_total) + ", over " + std::to_string(budget);
  if (layout.share == Sharing::per_model && model_total / NL > n) return "the shared set is over n";
  // At most one block short of the budget per group (round down to whole blocks).
  const Index groups = layout.share == Sharing::per_head ? NL * heads : layout.share == Sharing::per_layer ? NL : 1;
  const Index want = layout.share == Sharing::per_model ? n : groups * n;
  const Index got = layout.share == Sharing::per_model ? model_total / NL : model_total;
  if (scope != kvevict::BudgetScope::head && got < want - groups * B && B > 1) return "far under the budget";
  if (B == 1 && got != want) return "token mode keeps " + std::to_string(got) + ", not " + std::to_string(want);
  return "";
}

/// The first n of {max, mean}.
std::vector<Reduce> reduces(int n) {
  const std::vector<Reduce> both{Reduce::max, Reduce::mean};
  return {both.begin(), both.begin() + n};
}

/// Scores and forcing given by the test: entry j of KV head h scores keys[h][j][0] and is forced where
/// keys[h][j][1] > 0.5; the window rows are in the window tier (docs/algorithms.md#forcing-cap's worked example).
struct ScriptedSelector {
  static constexpr const char* type_name = "ScriptedSelector";
  struct Params {
    void validate(const char*) const {}
  };
  template <class S>
  struct Layer {
    kvevict::extend::ScoreMap<S> allocation;
  };
  explicit ScriptedSelector(const Params&) {}
  bool reads_values() const { return false; }
  void adjust_budget(kvevict::extend::LayerBudget&, const kvevict::extend::LayerShape&, const kvevict::ScoringParams&,
                     const char*) const {}
  template <class S, class In>
  Layer<S> score(const In& in, const kvevict::extend::LayerShape& shape, const kvevict::ScoringParams& common,
                 const kvevict::extend::LayerBudget&, const char*) const {
    kvevict::RowMatrix<S> prefix = kvevict::RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = 0; j < shape.prefix_of(h); ++j) prefix(h, j) = static_cast<S>(in.keys.row(h, j)[0]);
    Layer<S> layer{kvevict::extend::scores_with_window(prefix, shape, common.reference_quirks)};
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = 0; j < shape.prefix_of(h); ++j)
        if (in.keys.row(h, j)[1] > 0.5) layer.allocation.promote(h, j, kvevict::extend::Tier::forced);
    return layer;
  }
};

}  // namespace

TEST_CASE("layout: forcing cap, a group forces at most what its share holds next to its window", "[layout]") {
  // docs/algorithms.md#forcing-cap: Hkv 2, B 2, w 2, L 12, n_kept 6, one top-k of 6 blocks: cap 2 forced blocks.
  constexpr Index Hkv = 2, L = 12, d = 2;
  std::vector<double> keys(static_cast<std::size_t>(Hkv * L * d), 0.0);
  const auto set = [&](Index h, Index j, double score, bool forced) {
    keys[static_cast<std::size_t>((h * L + j) * d)] = score;
    keys[static_cast<std::size_t>((h * L + j) * d + 1)] = forced ? 1.0 : 0.0;
  };
  const double head0[] = {.1, .4, .3, .2, .05};  // blocks 0..3 forced (their first row)
  for (Index u = 0; u < 5; ++u) {
    set(0, 2 * u, head0[u], u < 4);
    set(1, 2 * u, .5 + .1 * static_cast<double>(u), false);
  }
  const std::vector<double> queries(static_cast<std::size_t>(Hkv * 2 * d), 0.0);  // [H, w, d]: read by no score
  kvevict::LayerInputs<double> in;
  in.queries = kvevict::HeadsView<const double>::heads_major(queries.data(), Hkv, 2, d);
  in.keys = kvevict::kv_heads_major<const double>(keys.data(), Hkv, L, d);
  using Adaptive = kvevict::Policy<kvevict::HeadAdaptiveAllocation, ScriptedSelector>;
  Adaptive::Params p;
  p.window = 2;
  p.alpha = 0.0;
  p.block = 2;
  const Adaptive adaptive(p);
  kvevict::LayerGlobalPolicy<ScriptedSelector>::Params g;
  g.window = 2;
  g.block = 2;
  const kvevict::LayerGlobalPolicy<ScriptedSelector> global(g);
  using Rows = std::vector<std::int64_t>;
  for (const Selection& s : {adaptive.select(in, Budget::tokens(6)), global.select(in, Budget::tokens(6))}) {
    CHECK(head_rows(s, 0) == Rows{2, 3, 4, 5, 10, 11});  // forced blocks 1 and 2 (.4, .3), the window block
    CHECK(head_rows(s, 1) == Rows{6, 7, 8, 9, 10, 11});  // blocks 3, 4 (.8, .9) over head 0's demoted blocks
  }
  in.retrieval_heads = {0};  // a named head's group is forced whole: the cap does not apply to it
  for (const Selection& s : {adaptive.select(in, Budget::tokens(6)), global.select(in, Budget::tokens(6))}) {
    CHECK(head_rows(s, 0) == Rows{0, 1, 2, 3, 4, 5, 6, 7, 10, 11});
    CHECK(head_rows(s, 1) == Rows{10, 11});
  }
  // Per head in tokens the cap does not apply (the policies' own caps hold): the same layer at B = 1 keeps head 0's
  // four forced rows and the window under one top-k of 12.
  in.retrieval_heads.clear();
  p.block = 1;
  const Selection tokens = Adaptive(p).select(in, Budget::tokens(6));
  CHECK(head_rows(tokens, 0) == Rows{0, 2, 4, 6, 10, 11});
}

TEST_CASE("layout: every policy x sharing x block x reduce keeps shared, whole-block selections within budget",
          "[layout]") {
  Rng rng(8080);
  for (int trial = 0; trial < kvevict_test::cases(6); ++trial) {
    Shape s;
    s.Hkv = trial % 2 == 0 ? 2 : 4;
    s.H = s.Hkv * (trial % 3 == 0 ? 1 : 2);
    s.w = trial % 2 == 0 ? 4 : 8;
    s.L = 40 + 13 * trial;
    s.d = 16;
    std::vector<kvevict_test::VStored<float>> stored;
    std::vector<kvevict::LayerInputs<float>> layers;
    for (int l = 0; l < 3; ++l)
      stored.push_back(kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major));
    for (const auto& st : stored) layers.push_back(st.in);
    const Index n = 18 + trial;
    for (Sharing share : {Sharing::per_head, Sharing::per_layer, Sharing::per_model})
      for (Index block : {Index(1), Index(4), Index(16)})
        for (Reduce reduce : {Reduce::max, Reduce::mean}) {
          kvevict::Knobs k;
          k.window = s.w;
          k.share = share;
          k.block = block;
          k.reduce = reduce;
          kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
            INFO(e.name << " share " << kvevict::to_string(share) << " block " << block << " reduce "
                        << kvevict::to_string(reduce) << " " << kvevict_test::describe(s) << " n " << n);
            const auto policy = e.make(k);
            const std::vector<Selection> sels = kvevict::select_layers(policy, layers, Budget::tokens(n));
            REQUIRE(sels.size() == 3);
            for (const Selection& x : sels) REQUIRE(kvevict_test::structure_errors(x, s.Hkv, s.L) == "");
            CHECK(layout_errors(sels, policy.params(), s.L, n, e.scope, kept_window(policy.params())) == "");
          });
        }
  }
}

TEST_CASE("layout: an engine's page table keeps every head's window, and one layer of LayerDefensiveKV is DefensiveKV",
          "[layout]") {
  // An engine author's check: with 128 of 256 entries per head, DefensiveKV's mass-forced entries (up to
  // n_kept - w per head) overflow a group shared by two KV heads, or a head's blocks of 16. The window comes first,
  // then the forced entries by their own scores.
  Rng rng(8084);
  const Shape s{8, 2, 32, 256, 64};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 64, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<float>> layers{st.in, st.in};  // per_model: two layers alike
  struct Case {
    Sharing share;
    Index block;
  };
  for (const Case c : {Case{Sharing::per_layer, 1}, Case{Sharing::per_head, 16}, Case{Sharing::per_layer, 16},
                       Case{Sharing::per_model, 16}})
    for (const Reduce reduce : reduces(kvevict_test::cases(2))) {  // max only under the sanitizers
      kvevict::Knobs k;
      k.window = s.w;
      k.share = c.share;
      k.block = c.block;
      k.reduce = reduce;
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
        INFO(e.name << " share " << kvevict::to_string(c.share) << " block " << c.block << " reduce "
                    << kvevict::to_string(reduce));
        const auto policy = e.make(k);
        const Index window = kept_window(policy.params());
        for (const Selection& x : kvevict::select_layers(policy, layers, Budget::tokens(128)))
          for (Index h = 0; h < s.Hkv; ++h) {
            const auto rows = head_rows(x, h);
            for (Index j = s.L - window; j < s.L; ++j)
              REQUIRE(std::binary_search(rows.begin(), rows.end(), static_cast<std::int64_t>(j)));
          }
      });
      if (c.share == Sharing::per_model) continue;  // one layer of a model shared across layers is no model
      kvevict::DefensiveKV::Params d;
      d.window = s.w;
      d.share = c.share;
      d.block = c.block;
      d.reduce = reduce;
      kvevict::LayerDefensiveKV::Params g;
      static_cast<kvevict::ScoringParams&>(g) = d;
      CHECK(kvevict::DefensiveKV(d).select(st.in, Budget::tokens(128)).indices() ==
            kvevict::LayerDefensiveKV(g).select(st.in, Budget::tokens(128)).indices());
    }
}

TEST_CASE("layout: a group of one KV head is per_head, and block 1 per_head is the default", "[layout]") {
  Rng rng(8081);
  const Shape s{2, 1, 4, 50, 16};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 24, rng), Layout::tokens_major);
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    INFO(e.name);
    kvevict::Knobs k;
    k.window = s.w;
    const auto plain = e.make(k);
    k.share = Sharing::per_layer;  // Hkv = 1: the same single group, through the unit maps
    const auto shared = e.make(k);
    const std::vector<kvevict::LayerInputs<float>> layers{st.in};
    const auto a = kvevict::select_layers(plain, layers, Budget::tokens(17));
    const auto b = kvevict::select_layers(shared, layers, Budget::tokens(17));
    CHECK(a[0].indices() == b[0].indices());
  });
}

TEST_CASE("layout: compaction plans reproduce compact() in rows and in blocks", "[layout]") {
  Rng rng(8082);
  const Shape s{4, 2, 4, 70, 8};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 16, rng), Layout::heads_major);
  kvevict::AdaKV::Params p;
  p.window = s.w;
  p.block = 8;
  const Selection sel = kvevict::AdaKV(p).select(st.in, Budget::tokens(30));
  CHECK(sel.block_size() == 8);
  // Rows: apply the moves in order on a copy of the keys, in place.
  std::vector<float> moved(st.k.begin(), st.k.end()), packed(st.k.size(), 0.0f);
  const auto view = kvevict::kv_heads_major<float>(moved.data(), s.Hkv, s.L, s.d);
  for (const Selection::Move& m : sel.compaction_plan()) {
    REQUIRE(m.to < m.from);
    for (std::int64_t r = 0; r < m.count; ++r)
      std::copy(view.row(m.head, m.from + r), view.row(m.head, m.from + r) + s.d, view.row(m.head, m.to + r));
  }
  sel.compact(kvevict::kv_heads_major<const float>(st.k.data(), s.Hkv, s.L, s.d),
              kvevict::kv_heads_major<float>(packed.data(), s.Hkv, s.L, s.d));
  for (Index h = 0; h < s.Hkv; ++h)
    for (Index r = 0; r < sel.length(h); ++r)
      for (Index c = 0; c < s.d; ++c)
        REQUIRE(*(view.row(h, r) + c) == packed[static_cast<std::size_t>((h * s.L + r) * s.d + c)]);
  // Blocks: the same moves, B rows at a time.
  std::vector<float> by_block(st.k.begin(), st.k.end());
  const auto bview = kvevict::kv_heads_major<float>(by_block.data(), s.Hkv, s.L, s.d);
  for (const Selection::Move& m : sel.block_compaction_plan())
    for (std::int64_t r = 0; r < m.count * 8; ++r) {
      const std::int64_t from = m.from * 8 + r, to = m.to * 8 + r;
      if (from >= s.L) break;  // the tail block is partial
      std::copy(bview.row(m.head, from), bview.row(m.head, from) + s.d, bview.row(m.head, to));
    }
  for (Index h = 0; h < s.Hkv; ++h)
    for (Index r = 0; r < sel.length(h); ++r)
      for (Index c = 0; c < s.d; ++c) REQUIRE(*(bview.row(h, r) + c) == *(view.row(h, r) + c));
  // A worked plan: kept rows {0, 1, 4, 5, 6, 9} of one head -> moves (4 -> 2, 3 rows), (9 -> 5, 1 row).
  kvevict::extend::LayerShape one;
  one.kv_heads = 1;
  one.tokens = 10;
  std::vector<std::uint8_t> keep{1, 1, 0, 0, 1, 1, 1, 0, 0, 1};
  const auto plan = Selection::from_flags(keep, one).compaction_plan();
  CHECK(plan == std::vector<Selection::Move>{{0, 4, 2, 3}, {0, 9, 5, 1}});
}

TEST_CASE("layout: refused layouts name what is wrong", "[layout][errors]") {
  Rng rng(8083);
  const Shape s{4, 2, 4, 40, 8};
  const auto st = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 16, rng), Layout::heads_major);
  kvevict::SnapKV::Params p;
  p.window = s.w;
  p.block = 16;
  REQUIRE_THROWS_MATCHES(kvevict::SnapKV(p).select(st.in, Budget::tokens(10)), kvevict::invalid_argument,
                         kvevict_test::MessageContains("block (16) must be <= n_kept (10)"));
  p.block = 0;
  REQUIRE_THROWS_MATCHES(kvevict::SnapKV{p}, kvevict::invalid_argument,
                         kvevict_test::MessageContains("block must be >= 1"));
  p.block = 1;
  p.share = Sharing::per_model;
  REQUIRE_THROWS_MATCHES(kvevict::SnapKV(p).select(st.in, Budget::tokens(10)), kvevict::invalid_argument,
                         kvevict_test::MessageContains("share = per_model selects every layer at once"));
  p.share = Sharing::per_layer;
  p.reference_quirks = true;
  REQUIRE_THROWS_MATCHES(kvevict::SnapKV{p}, kvevict::invalid_argument,
                         kvevict_test::MessageContains("reference_quirks reproduces the reference code"));
  // Shared heads must hold the same entries.
  p.reference_quirks = false;
  std::vector<std::int64_t> lengths{40, 30};
  kvevict::LayerInputs<float> ragged = st.in;
  ragged.lengths = lengths.data();
  REQUIRE_THROWS_MATCHES(kvevict::SnapKV(p).select(ragged, Budget::tokens(10)), kvevict::invalid_argument,
                         kvevict_test::MessageContains("per_layer sharing needs every KV head of the layer to hold "
                                                       "the same entries"));
}

}  // namespace test_layout
