// Self-check of tests/support/reference_layout.hpp (sharing and blocks, docs/algorithms.md#layouts):
//   1. the pieces on hand-made numbers: the reduction over a group, the cut into blocks and the tail, the budgets in
//      blocks and the original AdaKV window in blocks;
//   2. hand-worked selections: per_layer max vs mean on a 2-head layer, blocks of 4 on L = 10 (the tail, a block
//      holding a window row, the budget rounding down), per_model over 2 layers, the layer-global step with
//      per_layer, StreamingLLM in blocks, CriticalKV and original AdaKV in blocks;
//   3. per_head with B = 1 is the ragged reference (tests/support/reference_ragged.hpp) for every method, on seeded
//      random ragged models, including tie-heavy ones;
//   4. invariants on random models for every share, reduce, block and method: the heads of a group keep identical
//      rows, every kept set is a union of whole blocks plus the tail, the totals per scope are within the budget (and
//      exact where the allocation is a flat top-k or uniform), and a few identities between the layouts.
// Every expected number below is derived in the comments from docs/algorithms.md#layouts.
#include "support/reference_layout.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/reference.hpp"
#include "support/reference_ragged.hpp"

namespace test_reference_selfcheck_layout {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace {

namespace rg = kvevict_ref::ragged;
namespace ly = kvevict_ref::layout;
using kvevict_ref::Pool;
using ly::Allocation;
using ly::Method;
using ly::Reduce;
using ly::Share;
using rg::KeptRows;
using rg::Positions;
using rg::Ragged;
using Model = std::vector<KeptRows>;
using Rows = std::vector<std::int64_t>;

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

Rows iota(std::int64_t first, std::int64_t last) {  // [first, last]
  Rows r;
  for (std::int64_t j = first; j <= last; ++j) r.push_back(j);
  return r;
}

Rows cat(Rows a, const Rows& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

ly::Layout layout(Share share, Reduce reduce, std::int64_t block) {
  ly::Layout l;
  l.share = share;
  l.reduce = reduce;
  l.block = block;
  return l;
}

ly::AllocParams alloc(Allocation a, double alpha = 0.0) {
  ly::AllocParams p;
  p.allocation = a;
  p.alpha = alpha;
  return p;
}

// Maps of hand-made layers: scores [Hkv][P_h], positions, window, forced rows (empty: none).
struct HandLayer {
  Ragged scores;
  Positions pos;
  int w;
  KeptRows forced;
};

ly::Maps hand_maps(const std::vector<HandLayer>& layers) {
  ly::Maps m;
  for (const HandLayer& l : layers) {
    m.pos.push_back(l.pos);
    m.w.push_back(l.w);
    m.alloc.push_back(ly::token_map(l.scores, l.pos, l.w, l.forced));
  }
  return m;
}

Positions same_positions(int Hkv, std::int64_t L) { return Positions(sz(Hkv), iota(0, L - 1)); }

// ---------------------------------------------------------------------------------------------
// 1. The pieces.

// Three members, one row each: tiers scored, window, scored -> window; scores .5, .25, .125: max .5, mean
// (.5 + .25 + .125) / 3 = .875 / 3 (summed in (layer, head) order). per_head: one member, the row unchanged.
TEST_CASE("layout reference: reducing a group takes the highest tier and the max or the mean", "[reference]") {
  const std::vector<Positions> pos = {{{7}, {7}}, {{7}}};
  ly::ModelMap map = {{{{ly::kScored, 0.5}}, {{ly::kWindow, 0.25}}}, {{{ly::kScored, 0.125}}}};
  const std::vector<ly::Group> model = ly::make_groups(Share::per_model, pos);
  REQUIRE(model.size() == 1);
  CHECK(model[0].members.size() == 3);
  const auto mx = ly::reduce_group(model[0], map, Reduce::max);
  const auto mean = ly::reduce_group(model[0], map, Reduce::mean);
  CHECK(mx[0].tier == ly::kWindow);
  CHECK(mx[0].score == 0.5);
  CHECK(mean[0].tier == ly::kWindow);
  CHECK(mean[0].score == 0.875 / 3.0);
  // per_layer: two groups (layer 0 of two members, layer 1 of one); per_head: three.
  const auto layers = ly::make_groups(Share::per_layer, pos);
  REQUIRE(layers.size() == 2);
  CHECK(layers[0].members.size() == 2);
  CHECK(layers[1].layer == 1);
  CHECK(ly::reduce_group(layers[0], map, Reduce::mean)[0].score == 0.375);
  const auto heads = ly::make_groups(Share::per_head, pos);
  REQUIRE(heads.size() == 3);
  CHECK(heads[1].index == 1);
  CHECK(heads[2].layer == 1);
  CHECK(heads[2].index == 0);
  CHECK(ly::reduce_group(heads[2], map, Reduce::mean)[0].score == 0.125);
  // A forced row of one member forces the group's row, unless another member has it in its window (window first).
  map[1][0][0].tier = ly::kForced;
  CHECK(ly::reduce_group(model[0], map, Reduce::max)[0].tier == ly::kWindow);
  map[0][1][0].tier = ly::kScored;
  CHECK(ly::reduce_group(model[0], map, Reduce::max)[0].tier == ly::kForced);
}

// L = 10, B = 4, w = 2, positions [10 11 12 13 20 21 22 23 30 31]: U = 2 whole blocks (rows 0-3, 4-7), tail
// r = 2 (rows 8, 9: the window). Scores rows 0..7 [.125 .875 .125 .125 .5 .5 .5 .5]:
//   block 0: max .875, mean 1.25 / 4 = .3125, position 13; block 1: .5 both ways, position 23; both scored.
// w = 3 puts row 7 in the window: block 1 is in the window tier.
TEST_CASE("layout reference: cutting a group into blocks of 4 leaves a tail of 2", "[reference]") {
  const Positions pos = {{10, 11, 12, 13, 20, 21, 22, 23, 30, 31}};
  const Ragged s = {{0.125, 0.875, 0.125, 0.125, 0.5, 0.5, 0.5, 0.5}};
  const ly::ModelMap map = {ly::token_map(s, pos, 2)};
  const auto g = ly::make_groups(Share::per_head, {pos});
  REQUIRE(g.size() == 1);
  const ly::Blocks mx = ly::cut_blocks(g[0], ly::reduce_group(g[0], map, Reduce::max), 4, Reduce::max);
  CHECK(mx.L == 10);
  CHECK(mx.U == 2);
  CHECK(mx.r == 2);
  REQUIRE(mx.blocks.size() == 2);
  CHECK(mx.blocks[0].tier == ly::kScored);
  CHECK(mx.blocks[0].score == 0.875);
  CHECK(mx.blocks[0].pos == 13);
  CHECK(mx.blocks[1].score == 0.5);
  CHECK(mx.blocks[1].pos == 23);
  const ly::Blocks mean = ly::cut_blocks(g[0], ly::reduce_group(g[0], map, Reduce::mean), 4, Reduce::mean);
  CHECK(mean.blocks[0].score == 0.3125);
  CHECK(mean.blocks[1].score == 0.5);
  const Ragged s3 = {{0.125, 0.875, 0.125, 0.125, 0.5, 0.5, 0.5}};
  const ly::ModelMap map3 = {ly::token_map(s3, pos, 3)};
  const ly::Blocks w3 = ly::cut_blocks(g[0], ly::reduce_group(g[0], map3, Reduce::max), 4, Reduce::max);
  CHECK(w3.blocks[0].tier == ly::kScored);
  CHECK(w3.blocks[1].tier == ly::kWindow);
  // B = 1: no tail, a block per row; B = 10: one block, no tail; B = 3: 3 blocks, tail 1.
  CHECK(ly::cut_blocks(g[0], ly::reduce_group(g[0], map, Reduce::max), 1, Reduce::max).r == 0);
  CHECK(ly::cut_blocks(g[0], ly::reduce_group(g[0], map, Reduce::max), 10, Reduce::max).U == 1);
  const ly::Blocks b3 = ly::cut_blocks(g[0], ly::reduce_group(g[0], map, Reduce::max), 3, Reduce::max);
  CHECK(b3.U == 3);
  CHECK(b3.r == 1);
  CHECK(b3.blocks[2].pos == 30);  // rows 6, 7, 8: row 8 is in the window
  CHECK(b3.blocks[2].tier == ly::kWindow);
  // Expansion: kept block 1 plus the tail.
  CHECK(ly::group_rows(mx, {1}) == Rows{4, 5, 6, 7, 8, 9});
  CHECK(ly::group_rows(mx, {}) == Rows{8, 9});
  CHECK(ly::group_rows(b3, {0, 2}) == Rows{0, 1, 2, 6, 7, 8, 9});
}

// docs/algorithms.md#layouts step 3 on numbers.
TEST_CASE("layout reference: budgets in blocks round down and never exceed the tokens", "[reference]") {
  // One group, n_kept 7, tail 2, B = 4: T = 7, total floor(5 / 4) = 1, n_blocks 1 (kept tokens 2 + 4 = 6 <= 7).
  ly::ScopeBudget b = ly::scope_budget(7, {2}, 4);
  CHECK(b.tokens == 7);
  CHECK(b.tails == 2);
  CHECK(b.total == 1);
  CHECK(b.n_blocks == 1);
  // Two groups with tails 2 and 1: T = 14, total floor(11 / 4) = 2, n_blocks 1.
  b = ly::scope_budget(7, {2, 1}, 4);
  CHECK(b.tokens == 14);
  CHECK(b.tails == 3);
  CHECK(b.total == 2);
  CHECK(b.n_blocks == 1);
  // Three groups, n_kept 5, tails 0, B = 2: T = 15, total 7, n_blocks floor(7 / 3) = 2.
  b = ly::scope_budget(5, {0, 0, 0}, 2);
  CHECK(b.total == 7);
  CHECK(b.n_blocks == 2);
  // n_kept 4, tail 2, B = 4: total floor(2 / 4) = 0: the tail alone.
  CHECK(ly::scope_budget(4, {2}, 4).total == 0);
  // B = 1: the token budget.
  b = ly::scope_budget(6, {0, 0}, 1);
  CHECK(b.total == 12);
  CHECK(b.n_blocks == 6);
  CHECK(ly::blocks_total(7, 1, 2) == 3);
  // Original AdaKV window in blocks: max over groups of ceil(max(0, w - r) / B).
  CHECK(ly::window_blocks(5, {2, 0}, 4) == 2);  // ceil(3 / 4) = 1, ceil(5 / 4) = 2
  CHECK(ly::window_blocks(2, {2}, 4) == 0);     // the tail holds the window
  CHECK(ly::window_blocks(3, {1, 1}, 2) == 1);
  CHECK(ly::window_blocks(3, {0}, 2) == 2);
  CHECK(ly::window_blocks(3, {0}, 1) == 3);
}

// ---------------------------------------------------------------------------------------------
// 2. Hand-worked selections.

// (a) Two heads, w = 1, L = 5 (positions = rows), prefix scores
//   head 0 [.75 0 .5 .125], head 1 [0 .125 .5 .25]
//   max  [.75 .125 .5 .25]       -> the best prefix row is 0
//   mean [.375 .0625 .5 .1875]   -> the best prefix row is 2
// per_layer, n_kept 2: one group, T = 2, total = n_blocks = 2: the window row 4 and the best prefix row.
TEST_CASE("layout reference: per_layer max and mean keep different tokens", "[reference]") {
  const HandLayer l{{{0.75, 0.0, 0.5, 0.125}, {0.0, 0.125, 0.5, 0.25}}, same_positions(2, 5), 1, {}};
  const ly::Maps m = hand_maps({l});
  for (Allocation a : {Allocation::uniform, Allocation::head_adaptive}) {
    INFO("allocation " << static_cast<int>(a));
    CHECK(ly::select_maps(m, {2}, alloc(a, 0.2), layout(Share::per_layer, Reduce::max, 1)) == Model{{{0, 4}, {0, 4}}});
    CHECK(ly::select_maps(m, {2}, alloc(a, 0.2), layout(Share::per_layer, Reduce::mean, 1)) == Model{{{2, 4}, {2, 4}}});
    // per_head: each head its own best.
    CHECK(ly::select_maps(m, {2}, alloc(Allocation::uniform), layout(Share::per_head, Reduce::mean, 1)) ==
          Model{{{0, 4}, {2, 4}}});
  }
  // n_kept 3: both reductions rank rows 0 and 2 above 1 and 3 -> {0, 2, 4}.
  CHECK(ly::select_maps(m, {3}, alloc(Allocation::uniform), layout(Share::per_layer, Reduce::max, 1)) ==
        Model{{{0, 2, 4}, {0, 2, 4}}});
  CHECK(ly::select_maps(m, {3}, alloc(Allocation::uniform), layout(Share::per_layer, Reduce::mean, 1)) ==
        Model{{{0, 2, 4}, {0, 2, 4}}});
  // Row 1 forced in head 1 only (a DefensiveKV mass-forced token): the group's row 1 is forced and, with the window,
  // fills n_kept 2 with either reduction. per_head, flat top-k of 4 (alpha 0): h1 r1 forced, the two windows, then
  // .75 (h0 r0).
  HandLayer f = l;
  f.forced = {{}, {1}};
  const ly::Maps mf = hand_maps({f});
  CHECK(ly::select_maps(mf, {2}, alloc(Allocation::head_adaptive), layout(Share::per_layer, Reduce::max, 1)) ==
        Model{{{1, 4}, {1, 4}}});
  CHECK(ly::select_maps(mf, {2}, alloc(Allocation::head_adaptive), layout(Share::per_layer, Reduce::mean, 1)) ==
        Model{{{1, 4}, {1, 4}}});
  CHECK(ly::select_maps(mf, {2}, alloc(Allocation::head_adaptive), layout(Share::per_head, Reduce::max, 1)) ==
        Model{{{0, 4}, {1, 4}}});
}

// Window first, then the forced rows by score (docs/algorithms.md#layouts): two heads, w = 1,
// L = 6, head scores [.1 .9 .2 .3 .4] and [.8 .1 .5 .2 .6], head 0 forcing rows {0, 1}, head 1 rows {2, 3}. Shared,
// the group forces the union {0, 1, 2, 3} (max .8 .9 .5 .3, mean .45 .5 .35 .25), more than n_kept 3 can hold next to
// the window row 5: the window, then the two best forced rows, {0, 1, 5}, with either reduction (forced above the
// window and cut by recency would have kept {1, 2, 3} and lost the window). The layer-global step keeps the same.
// Blocks of 2 (per_layer, n_kept 4, no tail): blocks 0-1 forced (max .9, mean .475), 2-3 forced (max .5, mean .3),
// 4-5 window; two blocks: the window block and the better forced one, {0, 1, 4, 5} (by recency: {0, 1, 2, 3}).
TEST_CASE("layout reference: a shared group keeps its window, then its best forced rows", "[reference]") {
  const HandLayer l{{{0.1, 0.9, 0.2, 0.3, 0.4}, {0.8, 0.1, 0.5, 0.2, 0.6}}, same_positions(2, 6), 1, {{0, 1}, {2, 3}}};
  const ly::Maps m = hand_maps({l});
  for (Reduce reduce : {Reduce::max, Reduce::mean})
    for (Allocation a : {Allocation::uniform, Allocation::head_adaptive, Allocation::layer_global}) {
      INFO("reduce " << static_cast<int>(reduce) << " allocation " << static_cast<int>(a));
      CHECK(ly::select_maps(m, {3}, alloc(a), layout(Share::per_layer, reduce, 1)) == Model{{{0, 1, 5}, {0, 1, 5}}});
    }
  for (Reduce reduce : {Reduce::max, Reduce::mean})
    CHECK(ly::select_maps(m, {4}, alloc(Allocation::uniform), layout(Share::per_layer, reduce, 2)) ==
          Model{{{0, 1, 4, 5}, {0, 1, 4, 5}}});
}

// (b) L = 10, B = 4, w = 2, positions = rows, scores as in the cutting test: block 0 (max .875, mean .3125), block
// 1 (.5), tail rows 8, 9.
//   n_kept 7: T = 7, total floor((7 - 2) / 4) = 1: the tail and one block, 6 tokens. max: block 0; mean: block 1.
//   n_kept 9: total floor(7 / 4) = 1 (rounding down); n_kept 10: total 2, everything; n_kept 4 and 5: total 0.
//   w = 3: row 7 is in the window, block 1 is in the window tier and wins whatever the scores.
TEST_CASE("layout reference: blocks of 4 on 10 entries keep the tail and whole blocks", "[reference]") {
  const Ragged s = {{0.125, 0.875, 0.125, 0.125, 0.5, 0.5, 0.5, 0.5}};
  const ly::Maps m = hand_maps({{s, same_positions(1, 10), 2, {}}});
  const auto mx = layout(Share::per_head, Reduce::max, 4);
  const auto mean = layout(Share::per_head, Reduce::mean, 4);
  const Rows tail = {8, 9};
  for (Allocation a : {Allocation::uniform, Allocation::head_adaptive}) {
    INFO("allocation " << static_cast<int>(a));
    CHECK(ly::select_maps(m, {7}, alloc(a, 0.2), mx) == Model{{cat(iota(0, 3), tail)}});
    CHECK(ly::select_maps(m, {7}, alloc(a, 0.2), mean) == Model{{iota(4, 9)}});
    CHECK(ly::select_maps(m, {9}, alloc(a, 0.2), mx) == Model{{cat(iota(0, 3), tail)}});
    CHECK(ly::select_maps(m, {10}, alloc(a, 0.2), mx) == Model{{iota(0, 9)}});
    CHECK(ly::select_maps(m, {5}, alloc(a, 0.2), mx) == Model{{tail}});
    CHECK(ly::select_maps(m, {4}, alloc(a, 0.2), mean) == Model{{tail}});
  }
  const Ragged s3 = {{0.125, 0.875, 0.125, 0.125, 0.5, 0.5, 0.5}};
  const ly::Maps m3 = hand_maps({{s3, same_positions(1, 10), 3, {}}});
  CHECK(ly::select_maps(m3, {7}, alloc(Allocation::uniform), mx) == Model{{iota(4, 9)}});
  CHECK(ly::select_maps(m3, {7}, alloc(Allocation::head_adaptive), mx) == Model{{iota(4, 9)}});

  // Two heads, per_head, B = 4, w = 2: head 0 as above, head 1 scores [.0625 x4 | .25 x4] (block maxes .0625, .25).
  // n_kept 7: T = 14, tails 4, total floor(10 / 4) = 2, n_blocks 1.
  //   AdaKV alpha 0: flat top-2 of the 4 blocks: .875 (h0 b0), .5 (h0 b1) -> head 0 keeps all 10, head 1 its tail;
  //   12 tokens <= 14.
  //   alpha 1: n_safe int(1 * 1) = 1 per group: h0 b0 and h1 b1 forced, and they fill the 2 places.
  //   SnapKV: b_v = min(1, 2) = 1: each group's best, the same as alpha 1.
  const Ragged s2 = {{0.125, 0.875, 0.125, 0.125, 0.5, 0.5, 0.5, 0.5},
                     {0.0625, 0.0625, 0.0625, 0.0625, 0.25, 0.25, 0.25, 0.25}};
  const ly::Maps m2 = hand_maps({{s2, same_positions(2, 10), 2, {}}});
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::head_adaptive, 0.0), mx) == Model{{iota(0, 9), tail}});
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::head_adaptive, 0.0), mean) == Model{{iota(0, 9), tail}});
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::head_adaptive, 1.0), mx) ==
        Model{{cat(iota(0, 3), tail), iota(4, 9)}});
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::uniform), mx) == Model{{cat(iota(0, 3), tail), iota(4, 9)}});
  // per_layer, the same layer: one group, T = 7, total 1: max rows [.125 .875 .125 .125 .5 .5 .5 .5] -> block 0;
  // mean rows [.09375 .46875 .09375 .09375 .375 x4] -> block means .1875 and .375 -> block 1.
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::head_adaptive, 0.0), layout(Share::per_layer, Reduce::max, 4)) ==
        Model{{cat(iota(0, 3), tail), cat(iota(0, 3), tail)}});
  CHECK(ly::select_maps(m2, {7}, alloc(Allocation::head_adaptive, 0.0), layout(Share::per_layer, Reduce::mean, 4)) ==
        Model{{iota(4, 9), iota(4, 9)}});
}

// (c) per_model over 2 layers of 2 heads, L = 6, w = 1, B = 2, positions = rows, prefix scores (rows 0..4):
//   l0 h0 [.5 0 0 0 0], l0 h1 [0 0 .125 0 0], l1 h0 [0 0 .25 0 0], l1 h1 [0 .0625 .25 .25 0]
// Blocks: b0 rows 0-1, b1 rows 2-3, b2 rows 4-5 (row 5: window). n_kept 4: one group, T = 4, total 2: b2 and one.
//   max rows [.5 .0625 .25 .25 0]: b0 .5, b1 .25 -> b0: rows {0, 1, 4, 5} in every head of both layers.
//   mean rows [.125 .015625 .15625 .0625 0]: b0 .0703125, b1 .109375 -> b1: rows {2, 3, 4, 5}.
// per_layer instead: layer 0 max rows [.5 0 .125 0 0] -> b0; layer 1 max rows [0 .0625 .25 .25 0] -> b1.
TEST_CASE("layout reference: per_model shares one set over 2 layers", "[reference]") {
  const HandLayer l0{{{0.5, 0, 0, 0, 0}, {0, 0, 0.125, 0, 0}}, same_positions(2, 6), 1, {}};
  const HandLayer l1{{{0, 0, 0.25, 0, 0}, {0, 0.0625, 0.25, 0.25, 0}}, same_positions(2, 6), 1, {}};
  const ly::Maps m = hand_maps({l0, l1});
  const Rows first = {0, 1, 4, 5};
  const Rows second = {2, 3, 4, 5};
  for (Allocation a : {Allocation::uniform, Allocation::head_adaptive, Allocation::layer_global}) {
    INFO("allocation " << static_cast<int>(a));
    CHECK(ly::select_maps(m, {4, 4}, alloc(a, 0.2), layout(Share::per_model, Reduce::max, 2)) ==
          Model{{first, first}, {first, first}});
    CHECK(ly::select_maps(m, {4, 4}, alloc(a, 0.2), layout(Share::per_model, Reduce::mean, 2)) ==
          Model{{second, second}, {second, second}});
    // n_kept 5: total floor(5 / 2) = 2, the same; n_kept 6: total 3, everything.
    CHECK(ly::select_maps(m, {5, 5}, alloc(a, 0.2), layout(Share::per_model, Reduce::mean, 2)) ==
          Model{{second, second}, {second, second}});
    CHECK(ly::select_maps(m, {6, 6}, alloc(a, 0.2), layout(Share::per_model, Reduce::max, 2)) ==
          Model{{iota(0, 5), iota(0, 5)}, {iota(0, 5), iota(0, 5)}});
    // per_layer: each layer its own group (layer-global: total floor(8 / 2) = 4: the two window blocks, then .5
    // (l0 b0) and .25 (l1 b1), the same).
    CHECK(ly::select_maps(m, {4, 4}, alloc(a, 0.2), layout(Share::per_layer, Reduce::max, 2)) ==
          Model{{first, first}, {second, second}});
  }
}

// (d) Layer-global (Layer-DefensiveKV) with per_layer, w = 1, positions = rows, scores in sixteenths:
//   layer 0 (L = 5): h0 [8 1 5 3], h1 [1 10 1 1]  -> max [8 10 5 3], mean [4.5 5.5 3 2]
//   layer 1 (L = 4): h0 [6 4 1],   h1 [2 7 1]     -> max [6 7 1],    mean [4 5.5 1]
// n_kept (2, 2): T = 2 + 2 = 4 (one group per layer), total 4: the two windows, then the two best rows of both
// layers. max: 10 (l0 r1), 8 (l0 r0) -> layer 0 {0, 1, 4}, layer 1 {3}.
// n_kept (2, 1): T = 3, one scored place. mean: 5.5 at l0 r1 and l1 r1, the same position 1 -> the lower layer.
// per_head (total 2 * 2 + 2 * 2 = 8): 10, 8, 7, 6 -> {0, 4}, {1, 4} and {0, 3}, {1, 3}.
// B = 2: layer 0 U = 2, r = 1 (row 4); layer 1 U = 2, r = 0, b1 = rows 2-3 holds the window. n_kept (2, 2):
// total floor((4 - 1) / 2) = 1: l1 b1 (non-scored) -> layer 0 {4}, layer 1 {2, 3}. n_kept (4, 3): total
// floor((7 - 1) / 2) = 3: l1 b1, then max 10 (l0 b0), 7 (l1 b0) -> layer 0 {0, 1, 4}, layer 1 {0, 1, 2, 3}.
TEST_CASE("layout reference: the layer-global step with per_layer sharing", "[reference]") {
  const double u = 1.0 / 16.0;
  const HandLayer l0{{{8 * u, 1 * u, 5 * u, 3 * u}, {1 * u, 10 * u, 1 * u, 1 * u}}, same_positions(2, 5), 1, {}};
  const HandLayer l1{{{6 * u, 4 * u, 1 * u}, {2 * u, 7 * u, 1 * u}}, same_positions(2, 4), 1, {}};
  const ly::Maps m = hand_maps({l0, l1});
  const auto lg = alloc(Allocation::layer_global);
  CHECK(ly::select_maps(m, {2, 2}, lg, layout(Share::per_layer, Reduce::max, 1)) ==
        Model{{{0, 1, 4}, {0, 1, 4}}, {{3}, {3}}});
  CHECK(ly::select_maps(m, {2, 2}, lg, layout(Share::per_layer, Reduce::mean, 1)) ==
        Model{{{1, 4}, {1, 4}}, {{1, 3}, {1, 3}}});
  CHECK(ly::select_maps(m, {2, 1}, lg, layout(Share::per_layer, Reduce::mean, 1)) ==
        Model{{{1, 4}, {1, 4}}, {{3}, {3}}});
  CHECK(ly::select_maps(m, {2, 1}, lg, layout(Share::per_layer, Reduce::max, 1)) ==
        Model{{{1, 4}, {1, 4}}, {{3}, {3}}});
  CHECK(ly::select_maps(m, {2, 2}, lg, layout(Share::per_head, Reduce::max, 1)) ==
        Model{{{0, 4}, {1, 4}}, {{0, 3}, {1, 3}}});
  // Not layer-global (each layer its own budget of 2): the window and each layer's best row.
  CHECK(ly::select_maps(m, {2, 2}, alloc(Allocation::head_adaptive), layout(Share::per_layer, Reduce::max, 1)) ==
        Model{{{1, 4}, {1, 4}}, {{1, 3}, {1, 3}}});
  // Blocks of 2.
  CHECK(ly::select_maps(m, {2, 2}, lg, layout(Share::per_layer, Reduce::max, 2)) ==
        Model{{{4}, {4}}, {{2, 3}, {2, 3}}});
  CHECK(ly::select_maps(m, {4, 3}, lg, layout(Share::per_layer, Reduce::max, 2)) ==
        Model{{{0, 1, 4}, {0, 1, 4}}, {iota(0, 3), iota(0, 3)}});
  // The same with a forced row (layer 0 head 0 row 3, score 3/16): l0 b1 (rows 2-3) joins the non-scored tier and
  // ranks with l1 b1 by position (both end at position 3: the lower layer first), then 10 (l0 b0).
  HandLayer f0 = l0;
  f0.forced = {{3}, {}};
  const ly::Maps mf = hand_maps({f0, l1});
  CHECK(ly::select_maps(mf, {4, 3}, lg, layout(Share::per_layer, Reduce::max, 2)) ==
        Model{{iota(0, 4), iota(0, 4)}, {{2, 3}, {2, 3}}});
}

// (e) StreamingLLM in blocks, L = 10, positions = rows: the map forces rows j < min(sinks, min(n_kept, L)) and scores
// the others by position.
//   B = 4, n_kept 8: U = 2, r = 2, total floor(6 / 4) = 1. sinks 4 or 2: block 0 is forced -> {0..3, 8, 9};
//   sinks 0: the most recent block 1 -> {4..9}. n_kept 5: total 0 -> the tail {8, 9}.
//   B = 3, n_kept 8: U = 3, r = 1, total floor(7 / 3) = 2. sinks 4: rows 0..3 force blocks 0 and 1 -> {0..5, 9};
//   sinks 1: block 0, then the most recent scored block 2 -> {0, 1, 2, 6, 7, 8, 9}; sinks 0: blocks 2, 1 -> {3..9}.
//   B = 3, n_kept 4, sinks 4: total floor(3 / 3) = 1 place for two forced blocks: the more recent (block 1, rows
//   3-5) wins, as any forced block cut by the budget (docs/algorithms.md#ties) -> {3, 4, 5, 9}.
TEST_CASE("layout reference: StreamingLLM keeps its sinks and the most recent blocks", "[reference]") {
  auto run = [](int Hkv, std::int64_t n_kept, int sinks, std::int64_t B, Share share) {
    ly::Maps m;
    m.pos = {same_positions(Hkv, 10)};
    m.w = {1};
    m.alloc = {ly::streaming_map(m.pos[0], n_kept, sinks)};
    return ly::select_maps(m, {n_kept}, alloc(Allocation::uniform), layout(share, Reduce::max, B));
  };
  CHECK(run(1, 8, 4, 4, Share::per_head) == Model{{cat(iota(0, 3), {8, 9})}});
  CHECK(run(1, 8, 2, 4, Share::per_head) == Model{{cat(iota(0, 3), {8, 9})}});
  CHECK(run(1, 8, 0, 4, Share::per_head) == Model{{iota(4, 9)}});
  CHECK(run(1, 5, 4, 4, Share::per_head) == Model{{{8, 9}}});
  CHECK(run(1, 8, 4, 3, Share::per_head) == Model{{cat(iota(0, 5), {9})}});
  CHECK(run(1, 8, 1, 3, Share::per_head) == Model{{{0, 1, 2, 6, 7, 8, 9}}});
  CHECK(run(1, 8, 0, 3, Share::per_head) == Model{{iota(3, 9)}});
  CHECK(run(1, 4, 4, 3, Share::per_head) == Model{{{3, 4, 5, 9}}});
  // Two heads: per_head T = 16, total floor(12 / 4) = 3, n_blocks 1 per head; per_layer T = 8, total 1: the same.
  const Model two = {{cat(iota(0, 3), {8, 9}), cat(iota(0, 3), {8, 9})}};
  CHECK(run(2, 8, 4, 4, Share::per_head) == two);
  CHECK(run(2, 8, 4, 4, Share::per_layer) == two);
  // B = 1 is the rule of docs/algorithms.md#allocation: the first min(sinks, n_kept) tokens and the most recent.
  CHECK(run(1, 6, 4, 1, Share::per_head) == Model{{{0, 1, 2, 3, 8, 9}}});
  CHECK(run(1, 3, 4, 1, Share::per_head) == Model{{{0, 1, 2}}});
  CHECK(run(1, 3, 0, 1, Share::per_head) == Model{{{7, 8, 9}}});
}

// CriticalKV in blocks: one head, L = 8, w = 2, B = 2 (blocks rows 0-1, 2-3, 4-5, 6-7; block 3 is the window),
// s rows 0..5 [.5 .5 .25 .25 .125 .125], N [.1 .1 1 1 4 4 1 1], eps 1e-4:
//   allocation map (max): b0 .5, b1 .25, b2 .125, b3 window;
//   stage-2 map (s + eps) N: b0 .05001, b1 .2501, b2 .5004, b3 window.
// n_kept 6: total 3. Uniform base, ratio .5: stage 1 int(1.5) = 1 block, b3; stage 2 the best 2 of b0, b1, b2 by
// the second map: b2, b1 -> rows {2..7} (SnapKV would keep {0..3, 6, 7}). Ratio 1: SnapKV's; ratio 0: b3, b2, b1.
// Adaptive base with alpha 1: n_safe int(3 * 1) = 3: b3, b0, b1 forced; the flat top-3 of the one group is them;
// stage 1 the forced b3 (most recent), stage 2 the forced b1 and b0 before the scored b2 -> {0..3, 6, 7}.
// Alpha .2: n_safe int(.6) = 0, as the uniform base.
TEST_CASE("layout reference: CriticalKV stages on blocks", "[reference]") {
  const Positions pos = same_positions(1, 8);
  const Ragged s = {{0.5, 0.5, 0.25, 0.25, 0.125, 0.125}};
  const std::vector<double> n = {0.1, 0.1, 1, 1, 4, 4, 1, 1};
  Ragged s2(1);
  for (std::size_t j = 0; j < s[0].size(); ++j) s2[0].push_back((s[0][j] + 1e-4) * n[j]);
  ly::Maps m;
  m.pos = {pos};
  m.w = {2};
  m.alloc = {ly::token_map(s, pos, 2)};
  m.stage2 = {ly::token_map(s2, pos, 2)};
  auto run = [&](Allocation a, double alpha, double ratio) {
    ly::AllocParams p = alloc(a, alpha);
    p.critical = true;
    p.first_stage_ratio = ratio;
    return ly::select_maps(m, {6}, p, layout(Share::per_head, Reduce::max, 2));
  };
  const Model snap = {{{0, 1, 2, 3, 6, 7}}};
  CHECK(run(Allocation::uniform, 0.2, 0.5) == Model{{iota(2, 7)}});
  CHECK(run(Allocation::uniform, 0.2, 1.0) == snap);
  CHECK(ly::select_maps(hand_maps({{s, pos, 2, {}}}), {6}, alloc(Allocation::uniform),
                        layout(Share::per_head, Reduce::max, 2)) == snap);
  CHECK(run(Allocation::uniform, 0.2, 0.0) == Model{{iota(2, 7)}});
  CHECK(run(Allocation::head_adaptive, 1.0, 0.5) == snap);
  CHECK(run(Allocation::head_adaptive, 0.2, 0.5) == Model{{iota(2, 7)}});
}

// Original AdaKV in blocks: two heads, L = 12, w = 3, B = 2: U = 6, r = 0, w_b = ceil(3 / 2) = 2 (blocks 4, 5 =
// rows 8..11; block 4 holds window row 9). Prefix blocks 0..3, block maxes h0 [.5 0 .4375 0], h1 [.375 .125 0 0].
// n_kept 6: T = 12, total 6, n_blocks 3, Bb = 1: the top 2 prefix blocks are h0 b0, h0 b2 -> counts (2, 0).
//   alpha 0: b - w_b = counts -> h0 blocks 0, 2, 4, 5; h1 blocks 4, 5 (the kvpress flat top-k gives the same).
//   alpha .5: floor(.5) = 0, round(1) = 1 and round(0) = 0 -> h0 blocks 0, 4, 5; h1 4, 5 (10 tokens of 12).
//   alpha 1: floor(1) = 1 -> one prefix block each: h0 b0, h1 b0.
// n_kept 4: n_blocks 2 <= w_b: each group its last 2 blocks.
TEST_CASE("layout reference: original AdaKV on blocks with the window in blocks", "[reference]") {
  const Ragged s = {{0.5, 0.5, 0, 0, 0.4375, 0, 0, 0, 0.75}, {0.375, 0, 0.125, 0, 0, 0, 0, 0, 0}};
  const ly::Maps m = hand_maps({{s, same_positions(2, 12), 3, {}}});
  const auto b2 = layout(Share::per_head, Reduce::max, 2);
  const Rows win = iota(8, 11);
  CHECK(ly::select_maps(m, {6}, alloc(Allocation::adakv_original, 0.0), b2) == Model{{cat({0, 1, 4, 5}, win), win}});
  CHECK(ly::select_maps(m, {6}, alloc(Allocation::head_adaptive, 0.0), b2) == Model{{cat({0, 1, 4, 5}, win), win}});
  CHECK(ly::select_maps(m, {6}, alloc(Allocation::adakv_original, 0.5), b2) == Model{{cat({0, 1}, win), win}});
  CHECK(ly::select_maps(m, {6}, alloc(Allocation::adakv_original, 1.0), b2) ==
        Model{{cat({0, 1}, win), cat({0, 1}, win)}});
  CHECK(ly::select_maps(m, {4}, alloc(Allocation::adakv_original, 0.5), b2) == Model{{win, win}});

  // The rounded shares can exceed the budget, in tokens as in blocks (so the "never over the budget" of
  // docs/algorithms.md#layouts does not hold for this variant). Three heads, L = 6, w = 1, n_kept 3, alpha .5, B = 1:
  // Bb = 2, floor(.5 * 2) = 1.
  //   h0 [.875 .0625 x4], h1 [.75 .0625 x4], h2 [.5 x4 .0625]: the top 6 prefix entries are .875, .75 and h2's four
  //   .5 -> counts (1, 1, 4) -> round(1.5) + 1 = 2 + 1, 2 + 1 and round(3) + 1 = 3 + 1: 10 tokens for a budget of 9.
  //   h0, h1: .875 / .75 and the tie at .0625 to the most recent row 4; h2: the .5s at rows 3, 2, 1.
  const Ragged s3 = {
      {0.875, 0.0625, 0.0625, 0.0625, 0.0625}, {0.75, 0.0625, 0.0625, 0.0625, 0.0625}, {0.5, 0.5, 0.5, 0.5, 0.0625}};
  const KeptRows over = {{0, 4, 5}, {0, 4, 5}, {1, 2, 3, 5}};
  CHECK(ly::select_maps(hand_maps({{s3, same_positions(3, 6), 1, {}}}), {3}, alloc(Allocation::adakv_original, 0.5),
                        layout(Share::per_head, Reduce::max, 1)) == Model{over});
  CHECK(rg::adakv_original(s3, same_positions(3, 6), 1, 3, 0.5) == over);
}

// ---------------------------------------------------------------------------------------------
// Random models.

// Uniform double in [lo, hi) from the raw 32-bit output (portable, unlike std::uniform_real_distribution).
double uniform(std::mt19937& rng, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(rng()) / 4294967296.0);
}

// An integer in [lo, hi].
int integer(std::mt19937& rng, int lo, int hi) {
  return lo + static_cast<int>(rng() % static_cast<std::uint32_t>(hi - lo + 1));
}

// L distinct positions out of [0, span), ascending.
Rows random_positions(std::mt19937& rng, int L, int span) {
  Rows all = iota(0, span - 1);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(sz(L));
  std::sort(all.begin(), all.end());
  return all;
}

// A layer whose KV head h holds positions pos[h]; random queries, keys, values and W_o. `ties`: small integers
// (and zero queries for query head 0), so that scores tie exactly within and across heads.
rg::Layer random_layer(std::mt19937& rng, int G, int w, const Positions& pos, int d, int D, bool ties) {
  rg::Layer l;
  l.Hkv = static_cast<int>(pos.size());
  l.H = G * l.Hkv;
  l.w = w;
  l.d = d;
  l.D = D;
  auto fill = [&](std::vector<double>& t, std::size_t n, double scale) {
    t.resize(n);
    for (double& e : t) e = ties ? static_cast<double>(integer(rng, -1, 1)) : uniform(rng, -scale, scale);
  };
  fill(l.q, sz(l.H) * sz(w) * sz(d), 2.0);
  if (ties)
    for (std::size_t i = 0; i < sz(w) * sz(d); ++i) l.q[i] = 0.0;
  fill(l.w_o, sz(D) * sz(l.H) * sz(d), 1.0);
  for (const Rows& p : pos) {
    rg::Head h;
    fill(h.keys, p.size() * sz(d), 1.5);
    fill(h.values, p.size() * sz(d), 1.0);
    h.pos = p;
    l.heads.push_back(h);
  }
  return l;
}

std::string describe(const std::vector<rg::Layer>& layers) {
  std::ostringstream o;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const rg::Layer& l = layers[i];
    o << "layer " << i << ": H=" << l.H << " Hkv=" << l.Hkv << " w=" << l.w << " L=[";
    for (const rg::Head& h : l.heads) o << h.pos.size() << " ";
    o << "] ";
  }
  return o.str();
}

// Hkv n_kept <= sum of L_h.
std::int64_t max_n_kept(const rg::Layer& l) {
  std::int64_t sum = 0;
  for (std::int64_t n : rg::lengths(l)) sum += n;
  return sum / l.Hkv;
}

struct Case {
  Method method;
  ly::MethodParams params;
  std::string name;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&](Method m, const std::string& name, auto&& edit) {
    ly::MethodParams p = ly::preset(m);
    edit(p);
    c.push_back({m, p, name});
  };
  auto none = [](ly::MethodParams&) {};
  add(Method::snapkv, "snapkv", none);
  add(Method::snapkv, "snapkv max3", [](ly::MethodParams& p) {
    p.kernel = 3;
    p.pool = Pool::max;
  });
  for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
    add(Method::adakv, "adakv alpha " + std::to_string(alpha), [&](ly::MethodParams& p) { p.alpha = alpha; });
    add(Method::adakv_original, "adakv_original alpha " + std::to_string(alpha), [&](ly::MethodParams& p) {
      p.alpha = alpha;
      p.kernel = 3;
      p.pool = Pool::max;
    });
  }
  add(Method::criticalkv, "criticalkv", none);
  add(Method::criticalkv, "criticalkv l2 .25 alpha .5", [](ly::MethodParams& p) {
    p.value_norm = 2;
    p.first_stage_ratio = 0.25;
    p.alpha = 0.5;
    p.kernel = 3;
    p.pool = Pool::max;
  });
  add(Method::criticalkv, "criticalkv ratio 0", [](ly::MethodParams& p) { p.first_stage_ratio = 0.0; });
  add(Method::critical_snapkv, "critical_snapkv", none);
  add(Method::critical_snapkv, "critical_snapkv l2 ratio 1", [](ly::MethodParams& p) {
    p.value_norm = 2;
    p.first_stage_ratio = 1.0;
  });
  add(Method::defensivekv, "defensivekv", none);
  add(Method::defensivekv, "defensivekv l2 max3 .5", [](ly::MethodParams& p) {
    p.value_norm = 2;
    p.kernel = 3;
    p.pool = Pool::max;
    p.mass_threshold = 0.5;
  });
  add(Method::defensivekv, "defensivekv no floor k1 .97 alpha .5", [](ly::MethodParams& p) {
    p.floor = false;
    p.kernel = 1;
    p.mass_threshold = 0.97;
    p.alpha = 0.5;
  });
  add(Method::adakv_defensive, "adakv_defensive", none);
  add(Method::tova, "tova", none);
  add(Method::knorm, "knorm", none);
  add(Method::keydiff, "keydiff", none);
  add(Method::layer_defensivekv, "layer_defensivekv", none);
  add(Method::layer_defensivekv, "layer_defensivekv l2 no floor .5", [](ly::MethodParams& p) {
    p.value_norm = 2;
    p.floor = false;
    p.mass_threshold = 0.5;
  });
  for (int sinks : {0, 2, 4})
    add(Method::streamingllm, "streamingllm sinks " + std::to_string(sinks),
        [&](ly::MethodParams& p) { p.sinks = sinks; });
  return c;
}

// The ragged reference's selection for a case, all layers.
Model ragged_select(const Case& c, const std::vector<rg::Layer>& layers, const std::vector<std::int64_t>& n_kept) {
  const ly::MethodParams& p = c.params;
  rg::DefensiveParams dp = ly::defensive_params(p);
  if (c.method == Method::layer_defensivekv) {
    dp.alpha = 0.0;
    return rg::layer_defensivekv(layers, n_kept, dp);
  }
  Model out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const rg::Layer& l = layers[i];
    const std::int64_t n = n_kept[i];
    rg::CriticalParams cp;
    cp.alpha = p.alpha;
    cp.eps = p.eps;
    cp.first_stage_ratio = p.first_stage_ratio;
    cp.value_norm = p.value_norm;
    cp.kernel = p.kernel;
    cp.pool = p.pool;
    switch (c.method) {
      case Method::snapkv:
      case Method::tova:  // per head: SnapKV with TOVA's parameters
        out.push_back(rg::snapkv(l, n, p.kernel, p.pool));
        break;
      case Method::knorm:
        out.push_back(rg::snapkv(rg::key_norm_scores(l), rg::positions(l), l.w, n));
        break;
      case Method::keydiff:
        out.push_back(rg::snapkv(rg::key_diff_scores(l), rg::positions(l), l.w, n));
        break;
      case Method::adakv:
        out.push_back(rg::adakv(l, n, p.alpha, p.kernel, p.pool));
        break;
      case Method::adakv_original:
        out.push_back(rg::adakv_original(l, n, p.alpha, p.kernel, p.pool));
        break;
      case Method::criticalkv:
        cp.adaptive = true;
        out.push_back(rg::criticalkv(l, n, cp));
        break;
      case Method::critical_snapkv:
        cp.adaptive = false;
        out.push_back(rg::criticalkv(l, n, cp));
        break;
      case Method::defensivekv:
      case Method::adakv_defensive:
        out.push_back(rg::defensivekv(l, n, dp));
        break;
      case Method::streamingllm:
        out.push_back(rg::streamingllm(rg::lengths(l), n, p.sinks));
        break;
      case Method::layer_defensivekv:
        break;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// 3. per_head with B = 1 is the ragged reference.

TEST_CASE("layout reference: per_head with blocks of 1 is the ragged reference for every method", "[reference]") {
  std::mt19937 rng(20250101u);
  const std::vector<Case> all = cases();
  for (int rep = 0; rep < 10; ++rep) {
    const int NL = 1 + rep % 2;
    const bool ties = rep % 3 == 0;
    std::vector<rg::Layer> layers;
    for (int i = 0; i < NL; ++i) {
      const int Hkv = 1 + (rep + i) % 3;
      const int G = 1 + (rep / 2 + i) % 2;
      const int w = 1 + (rep + 2 * i) % 3;
      const int Lmax = w + 6;
      Positions pos;
      for (int h = 0; h < Hkv; ++h) pos.push_back(random_positions(rng, integer(rng, w + 1, Lmax), 2 * Lmax));
      layers.push_back(random_layer(rng, G, w, pos, 2, 3, ties));
    }
    std::int64_t top = 0;
    for (const rg::Layer& l : layers) top = std::max(top, max_n_kept(l));
    for (std::int64_t n = 1; n <= top; ++n) {
      std::vector<std::int64_t> n_kept;
      for (const rg::Layer& l : layers) n_kept.push_back(std::min(n, max_n_kept(l)));
      for (const Case& c : all)
        for (Reduce reduce : {Reduce::max, Reduce::mean}) {
          INFO(describe(layers) << "rep=" << rep << " n=" << n << " " << c.name
                                << (reduce == Reduce::mean ? " mean" : " max"));
          CHECK(ly::select(c.method, layers, n_kept, c.params, layout(Share::per_head, reduce, 1)) ==
                ragged_select(c, layers, n_kept));
        }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Invariants on random models.

// Rows kept by a head: whole blocks of B plus every tail row.
bool whole_blocks_and_tail(const Rows& rows, std::int64_t L, std::int64_t B) {
  const std::int64_t U = L / B;
  auto has = [&](std::int64_t j) { return std::binary_search(rows.begin(), rows.end(), j); };
  for (std::int64_t j = U * B; j < L; ++j)
    if (!has(j)) return false;
  for (std::int64_t u = 0; u < U; ++u) {
    const bool first = has(u * B);
    for (std::int64_t j = u * B; j < u * B + B; ++j)
      if (has(j) != first) return false;
  }
  for (std::int64_t j : rows)
    if (j < 0 || j >= L) return false;
  return std::is_sorted(rows.begin(), rows.end()) && std::adjacent_find(rows.begin(), rows.end()) == rows.end();
}

std::int64_t size_of(const Rows& r) { return static_cast<std::int64_t>(r.size()); }

// A random model for `share`: per_head: every head its own positions; per_layer: one set per layer; per_model: one
// set for every layer (and one window).
std::vector<rg::Layer> random_model(std::mt19937& rng, Share share, int NL, bool ties) {
  std::vector<rg::Layer> layers;
  const int w_model = integer(rng, 1, 3);
  const int L_model = integer(rng, w_model + 4, w_model + 9);
  const Rows p_model = random_positions(rng, L_model, 2 * L_model);
  for (int i = 0; i < NL; ++i) {
    const int Hkv = integer(rng, 1, 3);
    const int G = integer(rng, 1, 2);
    const int w = share == Share::per_model ? w_model : integer(rng, 1, 3);
    const int L_layer = integer(rng, w + 4, w + 9);
    const Rows p_layer = random_positions(rng, L_layer, 2 * L_layer);
    Positions pos;
    for (int h = 0; h < Hkv; ++h) {
      if (share == Share::per_model)
        pos.push_back(p_model);
      else if (share == Share::per_layer)
        pos.push_back(p_layer);
      else
        pos.push_back(random_positions(rng, integer(rng, w + 4, w + 9), 24));
    }
    layers.push_back(random_layer(rng, G, w, pos, 2, 3, ties));
  }
  return layers;
}

TEST_CASE("layout reference: shared heads agree, blocks are whole and totals fit the budget", "[reference]") {
  std::mt19937 rng(777u);
  const std::vector<Case> all = cases();
  for (Share share : {Share::per_head, Share::per_layer, Share::per_model})
    for (int rep = 0; rep < 4; ++rep) {
      const int NL = 1 + rep % 3;
      const std::vector<rg::Layer> layers = random_model(rng, share, NL, rep == 3);
      std::int64_t top = 0;
      for (const rg::Layer& l : layers) top = std::max(top, max_n_kept(l));
      if (share == Share::per_model) top = max_n_kept(layers[0]);
      for (std::int64_t B = 1; B <= 4; ++B)
        for (std::int64_t n = B; n <= top; n += 1 + (n % 2)) {
          std::vector<std::int64_t> n_kept;
          for (const rg::Layer& l : layers) n_kept.push_back(std::max(B, std::min(n, max_n_kept(l))));
          for (const Case& c : all)
            for (Reduce reduce : {Reduce::max, Reduce::mean}) {
              INFO(describe(layers) << "share=" << static_cast<int>(share) << " B=" << B << " n=" << n << " " << c.name
                                    << (reduce == Reduce::mean ? " mean" : " max"));
              const Model out = ly::select(c.method, layers, n_kept, c.params, layout(share, reduce, B));
              REQUIRE(out.size() == layers.size());
              const Allocation a = ly::allocation_of(c.method);
              // Per scope: the kept tokens (each group counted once), the budget T and the tails.
              std::int64_t kept_all = 0, tokens_all = 0, tails_all = 0;
              for (std::size_t l = 0; l < layers.size(); ++l) {
                REQUIRE(out[l].size() == sz(layers[l].Hkv));
                std::int64_t kept = 0, tails = 0, V = 0;
                std::vector<std::int64_t> U;
                for (std::size_t h = 0; h < out[l].size(); ++h) {
                  const std::int64_t L = size_of(layers[l].heads[h].pos);
                  CHECK(whole_blocks_and_tail(out[l][h], L, B));
                  if (share == Share::per_layer) CHECK(out[l][h] == out[l][0]);
                  if (share == Share::per_model) CHECK(out[l][h] == out[0][0]);
                  const bool counted = share == Share::per_head || (h == 0 && (share == Share::per_layer || l == 0));
                  if (!counted) continue;
                  ++V;
                  kept += size_of(out[l][h]);
                  tails += L % B;
                  U.push_back(L / B);
                }
                if (V == 0) continue;
                const std::int64_t T = V * n_kept[l];
                const std::int64_t total = (T - tails) / B;
                const std::int64_t n_blocks = total / V;
                std::int64_t uni = tails;
                for (std::int64_t x : U) uni += B * std::min(n_blocks, x);
                kept_all += kept;
                tokens_all += T;
                tails_all += tails;
                if (a == Allocation::layer_global) continue;
                // Not for the original AdaKV: its rounded per-group shares can exceed T (see its hand-worked test).
                if (a != Allocation::adakv_original) CHECK(kept <= T);
                if (a == Allocation::head_adaptive) CHECK(kept == tails + B * total);
                if (a == Allocation::uniform) CHECK(kept == uni);
              }
              if (a == Allocation::layer_global) {
                CHECK(kept_all <= tokens_all);
                CHECK(kept_all == tails_all + B * ((tokens_all - tails_all) / B));
              }
              // SnapKV keeps its window whenever its blocks fit: the window blocks of a group number
              // ceil(max(0, w - r) / B) <= min(n_blocks, U).
              if (c.method == Method::snapkv && share == Share::per_head)
                for (std::size_t l = 0; l < layers.size(); ++l) {
                  std::vector<std::int64_t> tails;
                  for (const rg::Head& h : layers[l].heads) tails.push_back(size_of(h.pos) % B);
                  const std::int64_t n_blocks = ly::scope_budget(n_kept[l], tails, B).n_blocks;
                  for (std::size_t h = 0; h < out[l].size(); ++h) {
                    const std::int64_t L = size_of(layers[l].heads[h].pos);
                    const std::int64_t wb = ly::window_blocks(layers[l].w, {L % B}, B);
                    if (std::min(n_blocks, L / B) < wb) continue;
                    for (std::int64_t j = L - layers[l].w; j < L; ++j)
                      CHECK(std::binary_search(out[l][h].begin(), out[l][h].end(), j));
                  }
                }
            }
        }
    }
}

// One layer of one KV head: per_head, per_layer and per_model are the same group; with B = 1 and one member the
// mean and the max of a row agree, and a block of one row is that row.
TEST_CASE("layout reference: the layouts coincide where the groups do", "[reference]") {
  std::mt19937 rng(4711u);
  const std::vector<Case> all = cases();
  for (int rep = 0; rep < 6; ++rep) {
    const int w = 1 + rep % 3;
    const int L = w + 4 + rep;
    const std::vector<rg::Layer> one = {
        random_layer(rng, 1 + rep % 2, w, {random_positions(rng, L, 2 * L)}, 2, 3, rep % 3 == 0)};
    for (std::int64_t B = 1; B <= 3; ++B)
      for (std::int64_t n = B; n <= L; ++n)
        for (const Case& c : all) {
          INFO(describe(one) << "B=" << B << " n=" << n << " " << c.name);
          const Model want = ly::select(c.method, one, {n}, c.params, layout(Share::per_head, Reduce::max, B));
          CHECK(ly::select(c.method, one, {n}, c.params, layout(Share::per_layer, Reduce::max, B)) == want);
          CHECK(ly::select(c.method, one, {n}, c.params, layout(Share::per_model, Reduce::max, B)) == want);
          if (B == 1)
            CHECK(ly::select(c.method, one, {n}, c.params, layout(Share::per_model, Reduce::mean, B)) == want);
        }
  }
  // per_head with B = 1: mean = max on multi-head, multi-layer models too (every group has one member).
  for (int rep = 0; rep < 3; ++rep) {
    const std::vector<rg::Layer> layers = random_model(rng, Share::per_head, 2, rep == 0);
    const std::int64_t top = std::min(max_n_kept(layers[0]), max_n_kept(layers[1]));
    for (std::int64_t n = 1; n <= top; ++n)
      for (const Case& c : all) {
        INFO(describe(layers) << "n=" << n << " " << c.name);
        CHECK(ly::select(c.method, layers, {n, n}, c.params, layout(Share::per_head, Reduce::mean, 1)) ==
              ly::select(c.method, layers, {n, n}, c.params, layout(Share::per_head, Reduce::max, 1)));
      }
  }
}

}  // namespace

}  // namespace test_reference_selfcheck_layout
