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

#include "support/matchers.hpp"

namespace test_adapter_llama_cpp {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::LlamaCppPlan;
using kvevict::adapters::Positions;
using kvevict_test::MessageContains;

namespace {

using Rng = std::mt19937_64;
std::size_t sz(Index v) { return static_cast<std::size_t>(v); }

constexpr Index kLayers = 3, kH = 4, kHkv = 2, kW = 4, kD = 16, kHidden = 8;

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
        for (Index h = 0; h < kHkv; ++h) {
          float* row = krow(l, c, h);
          for (Index i = 0; i < kD / 2; ++i) {
            const Index x = layout == kvevict::RopeLayout::half ? i : 2 * i;
            const Index y = layout == kvevict::RopeLayout::half ? i + kD / 2 : 2 * i + 1;
            const double a = cells[c].shift * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(kD));
            const double xv = row[x], yv = row[y];
            row[x] = static_cast<float>(xv * std::cos(a) - yv * std::sin(a));
            row[y] = static_cast<float>(xv * std::sin(a) + yv * std::cos(a));
          }
        }
      cells[c].shift = 0;
    }
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

/// One sequence's cache as the library reads it: per layer keys and values [Hkv, L, d] heads-major, positions
/// [Hkv, L], with random window queries, W_o and engine scores.
struct SeqView {
  Index L = 0;
  std::vector<std::int64_t> pos;
  std::vector<std::vector<float>> q, k, v, w_o, scores;
  std::vector<kvevict::LayerInputs<float>> layers;

  SeqView(SimCache& cache, int seq, Rng& rng)
      : q(sz(kLayers)), k(sz(kLayers)), v(sz(kLayers)), w_o(sz(kLayers)), scores(sz(kLayers)) {
    const std::vector<std::size_t> cells = cache.of(seq);
    L = static_cast<Index>(cells.size());
    for (Index h = 0; h < kHkv; ++h)
      for (std::size_t c : cells) pos.push_back(cache.cells[c].pos);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (Index l = 0; l < kLayers; ++l) {
      auto& kl = k[sz(l)];
      auto& vl = v[sz(l)];
      for (Index h = 0; h < kHkv; ++h)
        for (std::size_t c : cells) {
          kl.insert(kl.end(), cache.krow(l, c, h), cache.krow(l, c, h) + kD);
          vl.insert(vl.end(), cache.vrow(l, c, h), cache.vrow(l, c, h) + kD);
        }
      for (Index i = 0; i < kH * kW * kD; ++i) q[sz(l)].push_back(normal(rng));
      for (Index i = 0; i < kHidden * kH * kD; ++i) w_o[sz(l)].push_back(0.2f * normal(rng));
      for (Index i = 0; i < kHkv * L; ++i) scores[sz(l)].push_back(normal(rng));
      kvevict::LayerInputs<float> in;
      in.queries = kvevict::HeadsView<const float>::heads_major(q[sz(l)].data(), kH, kW, kD);
      in.keys = kvevict::kv_heads_major<const float>(kl.data(), kHkv, L, kD);
      in.values = kvevict::kv_heads_major<const float>(vl.data(), kHkv, L, kD);
      in.w_o = kvevict::output_projection<const float>(w_o[sz(l)].data(), kHidden, kH, kD);
      in.scores = kvevict::HeadsView<const float>::heads_major(scores[sz(l)].data(), kHkv, L, 1);
      in.positions = kvevict::positions_heads_major(pos.data(), kHkv, L);
      layers.push_back(in);
    }
  }
};

/// What the sequence must hold after the plan: per layer its compacted keys (re-rotated when renumbered) and values,
/// and the positions.
struct Expected {
  std::vector<std::vector<float>> k, v;  // [layer][kept * Hkv * d], cell-major like the cache
  std::vector<std::int64_t> pos;
};

Expected expected(SeqView& view, const std::vector<Selection>& sels, Positions mode, const kvevict::Rope& rope) {
  Expected e;
  const Index n = sels[0].length(0);
  for (Index l = 0; l < kLayers; ++l) {
    const Selection& s = sels[sz(l)];
    std::vector<float> k = view.k[sz(l)], v = view.v[sz(l)];
    const auto keys = kvevict::HeadsView<float>::heads_major(k.data(), kHkv, view.L, kD);
    const auto values = kvevict::HeadsView<float>::heads_major(v.data(), kHkv, view.L, kD);
    s.compact(keys, keys);
    s.compact(values, values);
    if (mode == Positions::renumbered) kvevict::rerotate_kept(keys, s, rope);
    std::vector<float> kc, vc;
    for (Index j = 0; j < n; ++j)
      for (Index h = 0; h < kHkv; ++h) {
        kc.insert(kc.end(), keys.row(h, j), keys.row(h, j) + kD);
        vc.insert(vc.end(), values.row(h, j), values.row(h, j) + kD);
      }
    e.k.push_back(kc);
    e.v.push_back(vc);
  }
  const Selection::HeadIndices p = sels[0].head_positions(0);
  for (Index j = 0; j < n; ++j) e.pos.push_back(mode == Positions::renumbered ? j : p[j]);
  return e;
}

/// Whether `seq`'s cells now hold `e`: positions exactly, values exactly, keys within float rounding of the
/// rotation.
std::string holds(SimCache& cache, int seq, const Expected& e) {
  const std::vector<std::size_t> cells = cache.of(seq);
  if (cells.size() != e.pos.size()) return "holds " + std::to_string(cells.size()) + " cells";
  for (std::size_t j = 0; j < cells.size(); ++j) {
    if (cache.cells[cells[j]].pos != e.pos[j]) return "position of cell " + std::to_string(j);
    for (Index l = 0; l < kLayers; ++l)
      for (Index h = 0; h < kHkv; ++h)
        for (Index i = 0; i < kD; ++i) {
          const std::size_t at = (j * sz(kHkv) + sz(h)) * sz(kD) + sz(i);
          if (cache.vrow(l, cells[j], h)[i] != e.v[sz(l)][at]) return "value of cell " + std::to_string(j);
          if (std::abs(cache.krow(l, cells[j], h)[i] - e.k[sz(l)][at]) > 2e-5f)
            return "key of cell " + std::to_string(j);
        }
  }
  return "";
}

/// Selection over one head of `tokens` rows keeping `rows` at `positions` (rows when empty), on every KV head.
Selection hand(Index tokens, const std::vector<std::int64_t>& rows, std::vector<std::int64_t> positions = {},
               Index heads = 1) {
  std::vector<char> keep(sz(heads * tokens), 0);
  for (Index h = 0; h < heads; ++h)
    for (std::int64_t r : rows) keep[sz(h * tokens) + static_cast<std::size_t>(r)] = 1;
  if (positions.empty())
    for (Index j = 0; j < tokens; ++j) positions.push_back(j);
  std::vector<std::int64_t> all;
  for (Index h = 0; h < heads; ++h) all.insert(all.end(), positions.begin(), positions.end());
  kvevict::extend::LayerShape shape;
  shape.kv_heads = heads;
  shape.tokens = tokens;
  shape.positions = kvevict::positions_heads_major(all.data(), heads, tokens);
  return Selection::from_flags(keep, shape);
}

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
  const kvevict::Rope rope_half{10000.0, 0, kvevict::RopeLayout::half};
  const kvevict::Rope rope_gptj{10000.0, 0, kvevict::RopeLayout::interleaved};
  int checked = 0;
  for (const kvevict::Rope& rope : {rope_half, rope_gptj})
    for (Positions mode : {Positions::renumbered, Positions::kept})
      for (Index block : {Index{1}, Index{4}}) {
        kvevict::Knobs knobs;
        knobs.share = kvevict::Sharing::per_model;
        knobs.block = block;
        knobs.window = kW;
        kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
          INFO(entry.name << " mode " << kvevict::adapters::to_string(mode) << " block " << block << " rope "
                          << (rope.layout == kvevict::RopeLayout::half ? "half" : "interleaved"));
          const auto policy = entry.make(knobs);
          Rng rng(7 + static_cast<unsigned>(checked));
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
            SeqView view(cache, 0, rng);
            const std::vector<Selection> sels =
                kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(16).protect_prefix(4));
            const Expected want = expected(view, sels, mode, rope);
            const LlamaCppPlan plan = kvevict::adapters::llama_cpp_plan(sels, mode);
            for (const auto& r : plan.removes) cache.seq_rm(0, r.p0, r.p1);
            for (const auto& s : plan.shifts) cache.seq_add(0, s.p0, s.p1, s.delta);
            cache.k_shift(rope.layout, rope.theta);
            CHECK(holds(cache, 0, want) == "");
            CHECK(plan.kept == sels[0].length(0));
            // The protected prefix (positions 0..3, renumbered to themselves) is never removed.
            for (const auto& r : plan.removes) CHECK(r.p0 >= 4);
            // Sequence 1 is untouched, and the sequence continues at next_position.
            CHECK(cache.of(1) == other);
            CHECK(rows_of_other() == other_k);
            next = plan.next_position;
            CHECK(next == (mode == Positions::renumbered ? plan.kept : want.pos.back() + 1));
            for (std::int32_t p = next; p < next + 12; ++p) cache.add(0, p, rng);
            ++checked;
          }
        });
      }
  CHECK(checked >= 2 * 2 * 2 * 2 * 12);
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
