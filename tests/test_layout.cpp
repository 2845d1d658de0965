// docs/algorithms.md#layouts on every catalogue policy: shared selections are identical across the shared
// heads (and layers), never over the budget, block selections are whole blocks plus each head's tail, and the
// compaction plans reproduce compact(). The float64 reference comparison is in test_layout_reference.cpp.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <string>
#include <vector>

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

/// Checks the docs/algorithms.md#layouts invariants of one model's selections; returns "" or the first problem.
std::string layout_errors(const std::vector<Selection>& sels, const kvevict::LayoutParams& layout, Index L, Index n,
                          kvevict::BudgetScope scope) {
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

}  // namespace

TEST_CASE("layout: every policy x sharing x block x reduce keeps shared, whole-block selections within budget",
          "[layout]") {
  Rng rng(8080);
  for (int trial = 0; trial < 6; ++trial) {
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
            CHECK(layout_errors(sels, policy.params(), s.L, n, e.scope) == "");
          });
        }
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
