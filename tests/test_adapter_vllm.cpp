// adapters/vllm.hpp (docs/engines.md#vllm): the plan applied to a simulated vLLM paged cache, written from vLLM's
// v1 KV cache manager and attention backends (a pool of physical blocks of block_size slots holding every layer's K
// and V [Hkv, d] per slot; a request's token i at block_table[i / block_size], offset i % block_size; blocks
// reference-counted, a prefix's blocks shared between requests), equals Selection::compact plus rerotate_kept on the
// same cache, for every catalogue policy sharing one set per model, over two rounds of eviction with new tokens
// between them, positions kept or renumbered, a second request sharing the first's prefix blocks left untouched.
#include <catch2/catch.hpp>

#include <kvevict/adapters/vllm.hpp>
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/engine_sim.hpp"
#include "support/matchers.hpp"

namespace test_adapter_vllm {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::Positions;
using kvevict::adapters::VllmPlan;
using kvevict_test::MessageContains;
using namespace kvevict_test::engine_sim;

namespace {

constexpr Index kBlock = 4, kBlocks = 48;

/// vLLM's paged cache: per layer K and V [num_blocks * block_size slots, Hkv, d], blocks with reference counts.
struct Pool {
  std::vector<std::vector<float>> k, v;  // [layer][slot * Hkv * d]
  std::vector<int> refs;                 // [block]
  Pool() : k(sz(kLayers)), v(sz(kLayers)), refs(sz(kBlocks), 0) {
    for (Index l = 0; l < kLayers; ++l) {
      k[sz(l)].assign(sz(kBlocks * kBlock * kHkv * kD), 0.f);
      v[sz(l)].assign(sz(kBlocks * kBlock * kHkv * kD), 0.f);
    }
  }
  float* krow(Index l, std::int64_t slot, Index h) { return k[sz(l)].data() + (sz(slot) * sz(kHkv) + sz(h)) * sz(kD); }
  float* vrow(Index l, std::int64_t slot, Index h) { return v[sz(l)].data() + (sz(slot) * sz(kHkv) + sz(h)) * sz(kD); }
  /// A free block, drawn at random so that tables are not in order.
  std::int64_t allocate(Rng& rng) {
    std::vector<std::int64_t> free;
    for (Index b = 0; b < kBlocks; ++b)
      if (refs[sz(b)] == 0) free.push_back(b);
    REQUIRE(!free.empty());
    const std::int64_t b = free[std::uniform_int_distribution<std::size_t>(0, free.size() - 1)(rng)];
    refs[static_cast<std::size_t>(b)] = 1;
    return b;
  }
};

/// One request: its block table and its tokens' positions.
struct Request {
  std::vector<std::int64_t> table;
  std::vector<std::int64_t> pos;
  Index length() const { return static_cast<Index>(pos.size()); }
  std::int64_t slot(Index j) const { return table[sz(j / kBlock)] * kBlock + j % kBlock; }
  /// Token j's rows in `pool`.
  RowOf key(Pool& pool) const {
    return [this, &pool](Index l, Index j, Index h) -> const float* { return pool.krow(l, slot(j), h); };
  }
  RowOf value(Pool& pool) const {
    return [this, &pool](Index l, Index j, Index h) -> const float* { return pool.vrow(l, slot(j), h); };
  }
  /// Appends a token at `position` with random K and V rows (a new block when the last one is full).
  void append(Pool& pool, std::int64_t position, Rng& rng) {
    if (length() % kBlock == 0) table.push_back(pool.allocate(rng));
    pos.push_back(position);
    std::normal_distribution<float> normal(0.f, 1.f);
    const std::int64_t s = slot(length() - 1);
    for (Index l = 0; l < kLayers; ++l)
      for (Index h = 0; h < kHkv; ++h)
        for (Index i = 0; i < kD; ++i) {
          pool.krow(l, s, h)[i] = normal(rng);
          pool.vrow(l, s, h)[i] = normal(rng);
        }
  }
};

/// What the engine does with a plan: the copies in order (ascending within a run), the rotations, the new table,
/// the freed blocks' references released.
void apply(Pool& pool, Request& r, const VllmPlan& plan, const kvevict::Rope& rope) {
  for (const VllmPlan::Copy& c : plan.copies)
    for (std::int64_t t = 0; t < c.count; ++t)
      for (Index l = 0; l < kLayers; ++l)
        for (Index h = 0; h < kHkv; ++h) {
          std::copy(pool.krow(l, c.src_slot + t, h), pool.krow(l, c.src_slot + t, h) + kD,
                    pool.krow(l, c.dst_slot + t, h));
          std::copy(pool.vrow(l, c.src_slot + t, h), pool.vrow(l, c.src_slot + t, h) + kD,
                    pool.vrow(l, c.dst_slot + t, h));
        }
  for (const VllmPlan::Rotation& rot : plan.rotations)
    for (std::int64_t t = 0; t < rot.count; ++t)
      for (Index l = 0; l < kLayers; ++l)
        for (Index h = 0; h < kHkv; ++h) rotate_row(pool.krow(l, rot.slot + t, h), rot.delta, rope.layout, rope.theta);
  r.table = plan.block_table;
  for (std::int64_t b : plan.freed_blocks) --pool.refs[static_cast<std::size_t>(b)];
}

/// Every slot of `r`'s blocks, every layer, K and V.
std::vector<float> contents(Pool& pool, const Request& r) {
  std::vector<float> out;
  for (std::int64_t b : r.table)
    for (Index o = 0; o < kBlock; ++o)
      for (Index l = 0; l < kLayers; ++l)
        for (Index h = 0; h < kHkv; ++h) {
          out.insert(out.end(), pool.krow(l, b * kBlock + o, h), pool.krow(l, b * kBlock + o, h) + kD);
          out.insert(out.end(), pool.vrow(l, b * kBlock + o, h), pool.vrow(l, b * kBlock + o, h) + kD);
        }
  return out;
}

}  // namespace

TEST_CASE("vLLM plan: worked numbers", "[adapters][vllm]") {
  const std::vector<std::int64_t> table{7, 2, 5};  // 10 tokens in blocks of 4

  // Block 0 whole and the tail (rows 8, 9): the table drops block 2 and nothing moves.
  const VllmPlan whole = kvevict::adapters::vllm_plan({hand(10, {0, 1, 2, 3, 8, 9})}, table, kBlock);
  CHECK(whole.table_only);
  CHECK(whole.block_table == std::vector<std::int64_t>{7, 5});
  CHECK(whole.freed_blocks == std::vector<std::int64_t>{2});
  CHECK(whole.copies.empty());
  REQUIRE(whole.rotations.size() == 1);  // rows 8, 9 -> positions 4, 5, in block 5's slots 20, 21
  CHECK((whole.rotations[0].slot == 20 && whole.rotations[0].count == 2 && whole.rotations[0].delta == -4));
  CHECK((whole.num_tokens == 6 && whole.next_position == 6));

  // Rows 0, 1, 5, 6, 9: compacted into blocks 7 and 2, block 5 freed.
  const VllmPlan moved = kvevict::adapters::vllm_plan({hand(10, {0, 1, 5, 6, 9})}, table, kBlock);
  CHECK_FALSE(moved.table_only);
  CHECK(moved.block_table == std::vector<std::int64_t>{7, 2});
  CHECK(moved.freed_blocks == std::vector<std::int64_t>{5});
  REQUIRE(moved.copies.size() == 2);  // rows 5, 6 (slots 9, 10) -> tokens 2, 3 (slots 30, 31); row 9 -> token 4
  CHECK((moved.copies[0].src_slot == 9 && moved.copies[0].dst_slot == 30 && moved.copies[0].count == 2));
  CHECK((moved.copies[1].src_slot == 21 && moved.copies[1].dst_slot == 8 && moved.copies[1].count == 1));
  REQUIRE(moved.rotations.size() == 2);
  CHECK((moved.rotations[0].slot == 30 && moved.rotations[0].count == 2 && moved.rotations[0].delta == -3));
  CHECK((moved.rotations[1].slot == 8 && moved.rotations[1].count == 1 && moved.rotations[1].delta == -5));
  CHECK(moved.next_position == 5);

  // Nothing kept: every block freed; no tokens: an empty table.
  const VllmPlan none = kvevict::adapters::vllm_plan({hand(10, {})}, table, kBlock, Positions::kept, 3);
  CHECK((none.block_table.empty() && none.freed_blocks == table && none.copies.empty()));
  CHECK((none.num_tokens == 0 && none.next_position == 3));
  const VllmPlan empty = kvevict::adapters::vllm_plan({hand(0, {})}, {}, kBlock);
  CHECK((empty.block_table.empty() && empty.freed_blocks.empty() && empty.num_tokens == 0));

  const VllmPlan kept = kvevict::adapters::vllm_plan({hand(10, {0, 1, 5, 6, 9})}, table, kBlock, Positions::kept);
  CHECK(kept.rotations.empty());
  CHECK(kept.copies.size() == 2);
  CHECK(kept.next_position == 10);
}

TEST_CASE("vLLM plan: the simulated paged cache holds what compact and rerotate_kept give, for every catalogue policy",
          "[adapters][vllm][catalogue]") {
  constexpr Index kShared = 2;  // request 1 shares request 0's first two blocks (a cached prefix)
  const int cases = for_each_adapter_case(kBlock, [&](const auto& policy, const AdapterCase& tc) {
    const kvevict::Rope& rope = tc.rope;
    const Positions mode = tc.mode;
    const Index block = tc.block;
    Rng rng(tc.seed);
    Pool pool;
    Request a, b;
    for (std::int64_t p = 0; p < 37; ++p) a.append(pool, p, rng);
    b.table.assign(a.table.begin(), a.table.begin() + kShared);
    for (Index s = 0; s < kShared; ++s) ++pool.refs[sz(a.table[sz(s)])];
    b.pos.assign(a.pos.begin(), a.pos.begin() + kShared * kBlock);
    for (std::int64_t p = kShared * kBlock; p < kShared * kBlock + 5; ++p) b.append(pool, p, rng);
    const std::vector<float> b_before = contents(pool, b);
    for (int round = 0; round < 2; ++round) {
      INFO("round " << round);
      SeqView view(a.pos, a.key(pool), a.value(pool), rng);
      const std::vector<Selection> sels =
          kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(16).protect_prefix(kShared * kBlock));
      const Expected want = expected(view, sels, mode == Positions::renumbered, rope);
      const std::vector<std::int64_t> old_table = a.table;
      const VllmPlan plan = kvevict::adapters::vllm_plan(sels, a.table, kBlock, mode, 0, kShared);
      apply(pool, a, plan, rope);
      a.pos = want.pos;
      REQUIRE(static_cast<Index>(plan.block_table.size()) == (plan.num_tokens + kBlock - 1) / kBlock);
      CHECK(holds(plan.num_tokens, a.key(pool), a.value(pool), want) == "");
      CHECK(plan.num_tokens == sels[0].length(0));
      if (block == kBlock) CHECK((plan.table_only && plan.copies.empty()));
      // The new and the freed blocks split the old table; the shared blocks stay first, referenced by both.
      std::vector<std::int64_t> all = plan.block_table;
      all.insert(all.end(), plan.freed_blocks.begin(), plan.freed_blocks.end());
      std::vector<std::int64_t> old_sorted = old_table;
      std::sort(all.begin(), all.end());
      std::sort(old_sorted.begin(), old_sorted.end());
      CHECK(all == old_sorted);
      CHECK(std::equal(b.table.begin(), b.table.begin() + kShared, a.table.begin()));
      for (Index s = 0; s < kShared; ++s) CHECK(pool.refs[sz(b.table[sz(s)])] == 2);
      CHECK(contents(pool, b) == b_before);
      CHECK(plan.next_position == (mode == Positions::renumbered ? plan.num_tokens : want.pos.back() + 1));
      for (std::int64_t p = plan.next_position; p < plan.next_position + 6; ++p) a.append(pool, p, rng);
    }
  });
  CHECK(cases >= 2 * 2 * 2 * 12);
}

TEST_CASE("vLLM plan: refuses a selection or a table its blocks cannot hold", "[adapters][vllm][errors]") {
  const std::vector<std::int64_t> table{7, 2, 5};
  std::vector<char> keep{1, 1, 0, 1, 1, 0, 1, 1};
  REQUIRE_THROWS_MATCHES(kvevict::adapters::vllm_plan({Selection::from_flags(keep, 2, 4)}, {3}, kBlock),
                         kvevict::invalid_argument,
                         MessageContains("layer 0 KV head 1 keeps other entries than its KV head 0 (select with "
                                         "share = per_model)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::vllm_plan({hand(10, {0, 9})}, {7, 2}, kBlock), kvevict::invalid_argument,
                         MessageContains("block_table holds 2 blocks, but the request's 10 tokens in blocks of 4 "
                                         "need 3"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::vllm_plan({hand(10, {0, 9})}, {7, 2, 7}, kBlock), kvevict::invalid_argument,
                         MessageContains("block_table[0] and [2] are the same block (7)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::vllm_plan({hand(10, {0, 9})}, table, 0), kvevict::invalid_argument,
                         MessageContains("block_size must be >= 1, got 0"));
  REQUIRE_THROWS_MATCHES(
      kvevict::adapters::vllm_plan({hand(10, {0, 1, 2, 4, 9})}, table, kBlock, Positions::renumbered, 0, 1),
      kvevict::invalid_argument,
      MessageContains("row 3 of shared block 0 (physical 7, used by other requests) is evicted: protect the shared "
                      "prefix (Budget::protect_prefix(4))"));
  REQUIRE_THROWS_MATCHES(
      kvevict::adapters::vllm_plan({hand(10, {0, 1, 2, 3, 9})}, table, kBlock, Positions::renumbered, 2, 1),
      kvevict::invalid_argument, MessageContains("renumbering from first = 2 would turn the keys of shared block 0"));
}

}  // namespace test_adapter_vllm
