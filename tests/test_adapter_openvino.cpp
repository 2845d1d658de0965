// adapters/openvino.hpp (docs/engines.md#openvino): the plan applied to a simulated OpenVINO GenAI paged cache,
// written from its continuous batching pipeline (a block table per decoder layer over that layer's own pool of
// [Hkv, block_size, d] K and V blocks; Scheduler::free_blocks_from_sequence drops each layer's logical blocks of
// CacheEvictionAlgorithm::evict_logical_blocks and the kept ones close up; CacheRotationCalculator::get_rotation_data
// turns each moved block's keys back by the tokens evicted before it), equals Selection::compact plus rerotate_kept
// on the same cache, for every catalogue policy sharing one set per layer in whole blocks, over two rounds of
// eviction with new tokens between them; policies whose layers keep different counts, and token selections that
// cut a block, are refused by name.
#include <catch2/catch.hpp>

#include <kvevict/adapters/openvino.hpp>
#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/engine_sim.hpp"
#include "support/matchers.hpp"

namespace test_adapter_openvino {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::OpenVinoPlan;
using kvevict::adapters::Positions;
using kvevict_test::MessageContains;
using namespace kvevict_test::engine_sim;

namespace {

constexpr Index kBlock = 4, kBlocks = 24;

/// One decoder layer's cache: K and V blocks [block][Hkv][block_size][d] (OpenVINO's key cache layout), its free
/// blocks, and the sequence's block table.
struct LayerCache {
  std::vector<float> k, v;
  std::set<std::int64_t> free;
  std::vector<std::int64_t> table;
  LayerCache() : k(sz(kBlocks * kHkv * kBlock * kD)), v(sz(kBlocks * kHkv * kBlock * kD)) {
    for (Index b = 0; b < kBlocks; ++b) free.insert(b);
  }
  std::size_t at(std::int64_t block, Index h, Index offset) const {
    return ((sz(block) * sz(kHkv) + sz(h)) * sz(kBlock) + sz(offset)) * sz(kD);
  }
  float* krow(Index j, Index h) { return k.data() + at(table[sz(j / kBlock)], h, j % kBlock); }
  float* vrow(Index j, Index h) { return v.data() + at(table[sz(j / kBlock)], h, j % kBlock); }
};

/// The sequence in every layer, its length and positions (one per sequence).
struct Sequence {
  std::vector<LayerCache> layers = std::vector<LayerCache>(sz(kLayers));
  std::vector<std::int64_t> pos;
  Index length() const { return static_cast<Index>(pos.size()); }
  RowOf key() {
    return [this](Index l, Index j, Index h) -> const float* { return layers[sz(l)].krow(j, h); };
  }
  RowOf value() {
    return [this](Index l, Index j, Index h) -> const float* { return layers[sz(l)].vrow(j, h); };
  }
  void append(std::int64_t position, Rng& rng) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (LayerCache& c : layers)
      if (length() % kBlock == 0) {
        c.table.push_back(*c.free.begin());
        c.free.erase(c.free.begin());
      }
    pos.push_back(position);
    for (LayerCache& c : layers)
      for (Index h = 0; h < kHkv; ++h)
        for (Index i = 0; i < kD; ++i) {
          c.krow(length() - 1, h)[i] = normal(rng);
          c.vrow(length() - 1, h)[i] = normal(rng);
        }
  }
  /// free_blocks_from_sequence, then each moved block's keys turned back (all block_size slots, as OpenVINO does).
  void apply(const OpenVinoPlan& plan, const kvevict::Rope& rope) {
    for (std::size_t l = 0; l < layers.size(); ++l) {
      LayerCache& c = layers[l];
      std::vector<std::int64_t> table;
      for (std::size_t u = 0; u < c.table.size(); ++u)
        if (plan.evicted_blocks[l].count(u))
          REQUIRE(c.free.insert(c.table[u]).second);
        else
          table.push_back(c.table[u]);
      c.table = table;
      for (const OpenVinoPlan::BlockRotation& r : plan.rotations[l])
        for (Index h = 0; h < kHkv; ++h)
          for (Index o = 0; o < kBlock; ++o)
            rotate_row(c.k.data() + c.at(c.table[r.logical_block_idx], h, o),
                       -static_cast<std::int64_t>(r.rotation_delta), rope.layout, rope.theta);
    }
  }
};

/// Whether every layer keeps the same count and every block of `sels` is kept whole or not at all (the last,
/// partial one kept): what OpenVINO GenAI can hold.
std::string fits(const std::vector<Selection>& sels) {
  for (const Selection& s : sels) {  // in the adapter's order: a block cut, the last block evicted, the count
    std::vector<Index> kept(sz((s.context_length() + kBlock - 1) / kBlock), 0);
    for (std::int64_t r : s.head(0)) ++kept[static_cast<std::size_t>(r / kBlock)];
    for (std::size_t u = 0; u < kept.size(); ++u) {
      const Index size = std::min(kBlock, s.context_length() - static_cast<Index>(u) * kBlock);
      if (kept[u] != 0 && kept[u] != size) return "blocks";
    }
    if (s.context_length() % kBlock != 0 && kept.back() == 0) return "last";
    if (s.length(0) != sels[0].length(0)) return "counts";
  }
  return "";
}

}  // namespace

TEST_CASE("OpenVINO plan: worked numbers", "[adapters][openvino]") {
  // Two layers of 10 tokens in blocks of 4: layer 0 keeps blocks 0, 2 (the tail), layer 1 blocks 1, 2.
  const std::vector<Selection> sels{hand(10, {0, 1, 2, 3, 8, 9}), hand(10, {4, 5, 6, 7, 8, 9})};
  const OpenVinoPlan plan = kvevict::adapters::openvino_plan(sels, kBlock);
  CHECK(plan.evicted_blocks == std::vector<std::set<std::size_t>>{{1}, {0}});
  REQUIRE(plan.rotations[0].size() == 1);  // layer 0: the tail moves from block 2 to block 1, 4 tokens back
  CHECK((plan.rotations[0][0].logical_block_idx == 1 && plan.rotations[0][0].rotation_delta == 4));
  REQUIRE(plan.rotations[1].size() == 2);  // layer 1: blocks 1, 2 -> 0, 1
  CHECK((plan.rotations[1][0].logical_block_idx == 0 && plan.rotations[1][0].rotation_delta == 4));
  CHECK((plan.rotations[1][1].logical_block_idx == 1 && plan.rotations[1][1].rotation_delta == 4));
  CHECK((plan.evicted_tokens == 4 && plan.num_tokens == 6));
  // Every block of 8 tokens evicted (no partial block to keep).
  const OpenVinoPlan all = kvevict::adapters::openvino_plan({hand(8, {})}, kBlock);
  CHECK((all.evicted_blocks == std::vector<std::set<std::size_t>>{{0, 1}} && all.evicted_tokens == 8));
  CHECK((all.rotations[0].empty() && all.num_tokens == 0));
  const OpenVinoPlan kept = kvevict::adapters::openvino_plan(sels, kBlock, Positions::kept);
  CHECK((kept.rotations[0].empty() && kept.rotations[1].empty()));
}

TEST_CASE("OpenVINO plan: the simulated per-layer block tables hold what compact and rerotate_kept give",
          "[adapters][openvino][catalogue]") {
  int golden = 0, refused = 0;
  const int cases = for_each_adapter_case(
      kBlock,
      [&](const auto& policy, const AdapterCase& tc) {
        Rng rng(tc.seed);
        Sequence seq;
        for (std::int64_t p = 0; p < 37; ++p) seq.append(p, rng);
        for (int round = 0; round < 2; ++round) {
          INFO("round " << round);
          SeqView view(seq.pos, seq.key(), seq.value(), rng);
          const std::vector<Selection> sels =
              kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(16).protect_prefix(kBlock));
          const std::string why = fits(sels);
          if (why == "counts") {
            REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan(sels, kBlock, tc.mode), kvevict::invalid_argument,
                                   MessageContains("evicts as many blocks from every layer"));
            ++refused;
            return;
          }
          if (why == "blocks" || why == "last") {
            REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan(sels, kBlock, tc.mode), kvevict::invalid_argument,
                                   MessageContains(why == "blocks" ? "OpenVINO GenAI evicts whole blocks of 4 tokens"
                                                                   : "evicts its last, partial block"));
            ++refused;
            return;
          }
          const Expected want = expected(view, sels, tc.mode == Positions::renumbered, tc.rope);
          const OpenVinoPlan plan = kvevict::adapters::openvino_plan(sels, kBlock, tc.mode);
          seq.apply(plan, tc.rope);
          seq.pos = want.pos;
          for (const LayerCache& c : seq.layers)
            REQUIRE(static_cast<Index>(c.table.size()) == (plan.num_tokens + kBlock - 1) / kBlock);
          CHECK(holds(plan.num_tokens, seq.key(), seq.value(), want) == "");
          CHECK(plan.evicted_tokens + static_cast<std::size_t>(plan.num_tokens) == static_cast<std::size_t>(view.L));
          for (const auto& evicted : plan.evicted_blocks) CHECK(evicted.count(0) == 0);  // the protected prefix
          const std::int64_t next = seq.pos.back() + 1;
          for (std::int64_t p = next; p < next + 6; ++p) seq.append(p, rng);
          ++golden;
        }
      },
      kvevict::Sharing::per_layer);
  CHECK(cases >= 2 * 2 * 2 * 12);
  CHECK(golden >= 2 * 2 * 2 * 8);  // every per-layer allocation in whole blocks, both rounds
  CHECK(refused >= 2 * 2 * 3);     // the layer-global and scheduled ones
}

TEST_CASE("OpenVINO plan: refuses a selection its blocks cannot hold", "[adapters][openvino][errors]") {
  std::vector<char> keep{1, 1, 0, 1, 1, 0, 1, 1};
  REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan({Selection::from_flags(keep, 2, 4)}, 2),
                         kvevict::invalid_argument,
                         MessageContains("layer 0 KV head 1 keeps other entries than its KV head 0 (select with "
                                         "share = per_layer)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan({hand(10, {0, 1, 2, 8, 9})}, kBlock),
                         kvevict::invalid_argument,
                         MessageContains("layer 0 keeps 3 of the 4 tokens of block 0 (select with block = block_size "
                                         "and share = per_layer)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan({hand(10, {0, 1, 2, 3})}, kBlock), kvevict::invalid_argument,
                         MessageContains("layer 0 evicts its last, partial block 2"));
  REQUIRE_THROWS_MATCHES(
      kvevict::adapters::openvino_plan({hand(10, {0, 1, 2, 3, 8, 9}), hand(10, {8, 9})}, kBlock),
      kvevict::invalid_argument,
      MessageContains("evicts as many blocks from every layer (the sequence has one length), but layer 1 evicts 2"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan({hand(8, {4, 5, 6, 7}, {0, 1, 2, 3, 9, 10, 11, 12})}, kBlock),
                         kvevict::invalid_argument, MessageContains("layer 0 row 4 is at position 9"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::openvino_plan({hand(8, {0, 7})}, 0), kvevict::invalid_argument,
                         MessageContains("block_size must be >= 1, got 0"));
}

}  // namespace test_adapter_openvino
