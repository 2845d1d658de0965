// adapters/llama_cpp.hpp (docs/engines.md#llamacpp): the plan applied to a simulated llama.cpp KV cache, written from
// llama.cpp's src/llama-kv-cache.cpp and llama-kv-cells.h (seq_rm and seq_add over [p0, p1) with p0 < 0 read as 0 and
// p1 < 0 as the end; seq_add adds delta to a cell's position and to its pending shift, freeing a cell whose position
// turns negative; the K-shift at the next decode rotates each cell's keys by its pending shift), equals
// Selection::compact plus rerotate_kept on the same cache, for every catalogue policy sharing one set per model, over
// two rounds of eviction with a second sequence's cells interleaved, positions kept or renumbered.
#include <catch2/catch.hpp>

#include <kvevict/adapters/llama_cpp.hpp>
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/engine_sim.hpp"
#include "support/matchers.hpp"

namespace test_adapter_llama_cpp {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::LlamaCppPlan;
using kvevict::adapters::Positions;
using kvevict_test::MessageContains;
using namespace kvevict_test::engine_sim;

namespace {

// ---- a simulated llama.cpp unified KV cache ------------------------------------------------------------------------

/// One cell: a position, the sequences holding it and the shift pending for the K-shift (llama_kv_cells).
struct Cell {
  std::int32_t pos = -1;  // -1: free
  std::set<int> seqs;
  std::int32_t shift = 0;
};

/// llama.cpp's cells with each layer's K and V rows [cells, Hkv, d] (a cell holds every KV head of its token).
struct SimCache {
  std::vector<Cell> cells;
  std::vector<std::vector<float>> k, v;  // [layer][cell * Hkv * d]
  explicit SimCache(Index size) : cells(sz(size)), k(sz(kLayers)), v(sz(kLayers)) {
    for (Index l = 0; l < kLayers; ++l) {
      k[sz(l)].assign(sz(size * kHkv * kD), 0.f);
      v[sz(l)].assign(sz(size * kHkv * kD), 0.f);
    }
  }
  float* krow(Index l, std::size_t c, Index h) { return k[sz(l)].data() + (c * sz(kHkv) + sz(h)) * sz(kD); }
  float* vrow(Index l, std::size_t c, Index h) { return v[sz(l)].data() + (c * sz(kHkv) + sz(h)) * sz(kD); }

  /// Places a token of `seq` at `pos` in the first free cell, with random K and V rows.
  void add(int seq, std::int32_t pos, Rng& rng) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (std::size_t c = 0; c < cells.size(); ++c)
      if (cells[c].pos < 0) {
        cells[c].pos = pos;
        cells[c].seqs = {seq};
        cells[c].shift = 0;
        for (Index l = 0; l < kLayers; ++l)
          for (Index h = 0; h < kHkv; ++h)
            for (Index i = 0; i < kD; ++i) {
              krow(l, c, h)[i] = normal(rng);
              vrow(l, c, h)[i] = normal(rng);
            }
        return;
      }
    FAIL("the simulated cache is full");
  }
  static void range(std::int32_t& p0, std::int32_t& p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = std::numeric_limits<std::int32_t>::max();
  }
  void seq_rm(int seq, std::int32_t p0, std::int32_t p1) {
    range(p0, p1);
    for (Cell& c : cells)
      if (c.pos >= p0 && c.pos < p1 && c.seqs.count(seq)) {
        c.seqs.erase(seq);
        if (c.seqs.empty()) c = Cell{};
      }
  }
  void seq_add(int seq, std::int32_t p0, std::int32_t p1, std::int32_t delta) {
    if (delta == 0) return;
    range(p0, p1);
    if (p0 == p1) return;
    for (Cell& c : cells)
      if (c.pos >= p0 && c.pos < p1 && c.seqs.count(seq)) {
        c.pos += delta;
        c.shift += delta;
        if (c.pos < 0) c = Cell{};
      }
  }
  /// The K-shift: each cell's keys turn by its pending shift, in float64 (pairs as `layout` says), stored as float.
  void k_shift(kvevict::RopeLayout layout, double theta) {
    for (std::size_t c = 0; c < cells.size(); ++c) {
      if (cells[c].shift == 0) continue;
      for (Index l = 0; l < kLayers; ++l)
        for (Index h = 0; h < kHkv; ++h) rotate_row(krow(l, c, h), cells[c].shift, layout, theta);
      cells[c].shift = 0;
    }
  }
  /// The positions of `seq`'s cells, ascending, and their rows (token j: the sequence's j-th cell).
  std::vector<std::int64_t> positions(int seq) const {
    std::vector<std::int64_t> out;
    for (std::size_t c : of(seq)) out.push_back(cells[c].pos);
    return out;
  }
  RowOf key(int seq) {
    return
        [this, cells_of = of(seq)](Index l, Index j, Index h) -> const float* { return krow(l, cells_of[sz(j)], h); };
  }
  RowOf value(int seq) {
    return
        [this, cells_of = of(seq)](Index l, Index j, Index h) -> const float* { return vrow(l, cells_of[sz(j)], h); };
  }
  /// The cells of `seq`, ascending by position.
  std::vector<std::size_t> of(int seq) const {
    std::vector<std::size_t> out;
    for (std::size_t c = 0; c < cells.size(); ++c)
      if (cells[c].pos >= 0 && cells[c].seqs.count(seq)) out.push_back(c);
    std::sort(out.begin(), out.end(), [&](std::size_t a, std::size_t b) { return cells[a].pos < cells[b].pos; });
    return out;
  }
};

}  // namespace

TEST_CASE("llama.cpp plan: worked numbers", "[adapters][llama.cpp]") {
  // 10 cells at positions 0..9 keep rows 0, 1, 4, 5, 6, 9.
  const std::vector<Selection> sel{hand(10, {0, 1, 4, 5, 6, 9})};
  const LlamaCppPlan renumbered = kvevict::adapters::llama_cpp_plan(sel);
  REQUIRE(renumbered.removes.size() == 2);
  CHECK((renumbered.removes[0].p0 == 2 && renumbered.removes[0].p1 == 4));
  CHECK((renumbered.removes[1].p0 == 7 && renumbered.removes[1].p1 == 9));
  REQUIRE(renumbered.shifts.size() == 2);  // 4..6 -> 2..4, 9 -> 5
  CHECK((renumbered.shifts[0].p0 == 4 && renumbered.shifts[0].p1 == 7 && renumbered.shifts[0].delta == -2));
  CHECK((renumbered.shifts[1].p0 == 9 && renumbered.shifts[1].p1 == 10 && renumbered.shifts[1].delta == -4));
  CHECK(renumbered.kept == 6);
  CHECK(renumbered.next_position == 6);

  const LlamaCppPlan kept = kvevict::adapters::llama_cpp_plan(sel, Positions::kept);
  CHECK(kept.removes.size() == 2);
  CHECK(kept.shifts.empty());
  CHECK(kept.next_position == 10);

  // Rows 3..5 of 8 cells whose positions already have gaps (an earlier round kept them): 0 1 2 5 6 9 10 11.
  const std::vector<Selection> gaps{hand(8, {3, 4, 5}, {0, 1, 2, 5, 6, 9, 10, 11})};
  const LlamaCppPlan g = kvevict::adapters::llama_cpp_plan(gaps);
  REQUIRE(g.removes.size() == 2);
  CHECK((g.removes[0].p0 == 0 && g.removes[0].p1 == 5));
  CHECK((g.removes[1].p0 == 10 && g.removes[1].p1 == -1));
  REQUIRE(g.shifts.size() == 2);  // 5, 6 -> 0, 1; 9 -> 2
  CHECK((g.shifts[0].p0 == 5 && g.shifts[0].p1 == 7 && g.shifts[0].delta == -5));
  CHECK((g.shifts[1].p0 == 9 && g.shifts[1].p1 == 10 && g.shifts[1].delta == -7));

  // Renumbered from first = 4: positions 0, 1 go up (moved last, right to left), 9 goes down (moved first).
  const LlamaCppPlan up = kvevict::adapters::llama_cpp_plan({hand(10, {0, 1, 9})}, Positions::renumbered, 4);
  REQUIRE(up.shifts.size() == 2);
  CHECK((up.shifts[0].p0 == 9 && up.shifts[0].delta == -3));
  CHECK((up.shifts[1].p0 == 0 && up.shifts[1].p1 == 2 && up.shifts[1].delta == 4));
  CHECK(up.next_position == 7);

  // Nothing kept: every position goes.
  const LlamaCppPlan none = kvevict::adapters::llama_cpp_plan({hand(5, {})});
  REQUIRE(none.removes.size() == 1);
  CHECK((none.removes[0].p0 == 0 && none.removes[0].p1 == -1));
}

TEST_CASE("llama.cpp plan: the simulated cache holds what compact and rerotate_kept give, for every catalogue policy",
          "[adapters][llama.cpp][catalogue]") {
  const int cases = for_each_adapter_case(Index{4}, [&](const auto& policy, const AdapterCase& tc) {
    const kvevict::Rope& rope = tc.rope;
    const Positions mode = tc.mode;
    Rng rng(tc.seed);
    // Sequence 0 (40 tokens) interleaved with sequence 1 (24) in one cache of 96 cells.
    SimCache cache(96);
    for (std::int32_t p = 0; p < 40; ++p) {
      cache.add(0, p, rng);
      if (p < 24) cache.add(1, p, rng);
    }
    const std::vector<std::size_t> other = cache.of(1);
    const auto rows_of_other = [&] {
      std::vector<float> rows;
      for (std::size_t c : other) rows.insert(rows.end(), cache.krow(2, c, 0), cache.krow(2, c, 0) + kHkv * kD);
      return rows;
    };
    const std::vector<float> other_k = rows_of_other();
    std::int32_t next = 40;
    for (int round = 0; round < 2; ++round) {
      INFO("round " << round);
      SeqView view(cache.positions(0), cache.key(0), cache.value(0), rng);
      const std::vector<Selection> sels =
          kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(16).protect_prefix(4));
      const std::int64_t first = round == 0 ? 0 : 3;  // round 1 renumbers from 3: the prefix's cells move up
      const Expected want = expected(view, sels, mode == Positions::renumbered, rope, first);
      const LlamaCppPlan plan = kvevict::adapters::llama_cpp_plan(sels, mode, first);
      for (const auto& r : plan.removes) cache.seq_rm(0, r.p0, r.p1);
      for (const auto& s : plan.shifts) cache.seq_add(0, s.p0, s.p1, s.delta);
      cache.k_shift(rope.layout, rope.theta);
      CHECK(holds(static_cast<Index>(cache.of(0).size()), cache.key(0), cache.value(0), want) == "");
      CHECK(cache.positions(0) == want.pos);
      CHECK(plan.kept == sels[0].length(0));
      // The protected prefix (positions 0..3, renumbered to themselves) is never removed.
      for (const auto& r : plan.removes) CHECK(r.p0 >= 4);
      // Sequence 1 is untouched, and the sequence continues at next_position.
      CHECK(cache.of(1) == other);
      CHECK(rows_of_other() == other_k);
      next = plan.next_position;
      CHECK(next == (mode == Positions::renumbered ? first + plan.kept : want.pos.back() + 1));
      for (std::int32_t p = next; p < next + 12; ++p) cache.add(0, p, rng);
    }
  });
  CHECK(cases >= 2 * 2 * 2 * 12);
}

TEST_CASE("llama.cpp plan: refuses a selection its cells cannot hold", "[adapters][llama.cpp][errors]") {
  // Two KV heads keeping different rows: a per-head selection.
  std::vector<char> keep{1, 1, 0, 1, 1, 0, 1, 1};
  const Selection per_head = Selection::from_flags(keep, 2, 4);
  REQUIRE_THROWS_MATCHES(kvevict::adapters::llama_cpp_plan({per_head}), kvevict::invalid_argument,
                         MessageContains("layer 0 KV head 1 keeps other entries than its KV head 0 (select with "
                                         "share = per_model)"));
  // Two layers keeping different sets: per_layer.
  REQUIRE_THROWS_MATCHES(kvevict::adapters::llama_cpp_plan({hand(6, {0, 5}, {}, 2), hand(6, {1, 5}, {}, 2)}),
                         kvevict::invalid_argument,
                         MessageContains("layer 1 keeps other entries than layer 0 (select with share = per_model)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::llama_cpp_plan({}), kvevict::invalid_argument,
                         MessageContains("needs the selections of the sequence's layers, got none"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::llama_cpp_plan({hand(4, {0, 3})}, Positions::renumbered, -1),
                         kvevict::invalid_argument, MessageContains("first (-1) must be >= 0"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::llama_cpp_plan({hand(2, {0, 1}, {5, std::int64_t{1} << 33})}),
                         kvevict::invalid_argument, MessageContains("positions must be in [0, INT32_MAX) (llama_pos)"));
}

}  // namespace test_adapter_llama_cpp
