// adapters/sglang.hpp (docs/engines.md#sglang): the plan applied to a simulated SGLang token pool, written from
// SGLang's mem_cache (ReqToTokenPool's req_to_token map of a request's tokens to slots, the token-to-KV pool of one
// [Hkv, d] K and V row per slot and layer at page size 1, the allocator's free, the radix cache holding a prefix's
// slots for every request that shares it), equals Selection::compact plus rerotate_kept on the same cache, for every
// catalogue policy sharing one set per model, over two rounds of eviction with new tokens between them, positions
// kept or renumbered, a second request sharing the first's cached prefix left untouched.
#include <catch2/catch.hpp>

#include <kvevict/adapters/sglang.hpp>
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/engine_sim.hpp"
#include "support/matchers.hpp"

namespace test_adapter_sglang {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::Positions;
using kvevict::adapters::SGLangPlan;
using kvevict_test::MessageContains;
using namespace kvevict_test::engine_sim;

namespace {

constexpr Index kSlots = 160;

/// SGLang's token-to-KV pool: per layer K and V [slots, Hkv, d] and the allocator's free slots.
struct TokenPool {
  std::vector<std::vector<float>> k, v;  // [layer][slot * Hkv * d]
  std::set<std::int64_t> free;
  TokenPool() : k(sz(kLayers)), v(sz(kLayers)) {
    for (Index l = 0; l < kLayers; ++l) {
      k[sz(l)].assign(sz(kSlots * kHkv * kD), 0.f);
      v[sz(l)].assign(sz(kSlots * kHkv * kD), 0.f);
    }
    for (Index s = 0; s < kSlots; ++s) free.insert(s);
  }
  float* krow(Index l, std::int64_t slot, Index h) { return k[sz(l)].data() + (sz(slot) * sz(kHkv) + sz(h)) * sz(kD); }
  float* vrow(Index l, std::int64_t slot, Index h) { return v[sz(l)].data() + (sz(slot) * sz(kHkv) + sz(h)) * sz(kD); }
  /// A free slot: the allocator hands out slots in runs, so take the lowest free one half the time, else any.
  std::int64_t allocate(Rng& rng) {
    REQUIRE(!free.empty());
    auto it = free.begin();
    if (std::uniform_int_distribution<int>(0, 1)(rng) == 1)
      std::advance(it, std::uniform_int_distribution<std::size_t>(0, free.size() - 1)(rng));
    const std::int64_t s = *it;
    free.erase(it);
    return s;
  }
  void release(std::int64_t s) {
    REQUIRE(s >= 0);
    REQUIRE(s < kSlots);
    REQUIRE(free.insert(s).second);  // never freed twice
  }
};

/// One request: req_to_token[req, :L] and its tokens' positions.
struct Request {
  std::vector<std::int64_t> slots;
  std::vector<std::int64_t> pos;
  RowOf key(TokenPool& pool) const {
    return [this, &pool](Index l, Index j, Index h) -> const float* { return pool.krow(l, slots[sz(j)], h); };
  }
  RowOf value(TokenPool& pool) const {
    return [this, &pool](Index l, Index j, Index h) -> const float* { return pool.vrow(l, slots[sz(j)], h); };
  }
  void append(TokenPool& pool, std::int64_t position, Rng& rng) {
    slots.push_back(pool.allocate(rng));
    pos.push_back(position);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (Index l = 0; l < kLayers; ++l)
      for (Index h = 0; h < kHkv; ++h)
        for (Index i = 0; i < kD; ++i) {
          pool.krow(l, slots.back(), h)[i] = normal(rng);
          pool.vrow(l, slots.back(), h)[i] = normal(rng);
        }
  }
};

/// What the engine does with a plan: the rotations, the new map, the freed slots back to the allocator.
void apply(TokenPool& pool, Request& r, const SGLangPlan& plan, const kvevict::Rope& rope) {
  for (const SGLangPlan::Rotation& rot : plan.rotations)
    for (std::int64_t t = 0; t < rot.count; ++t)
      for (Index l = 0; l < kLayers; ++l)
        for (Index h = 0; h < kHkv; ++h) rotate_row(pool.krow(l, rot.slot + t, h), rot.delta, rope.layout, rope.theta);
  r.slots = plan.slots;
  for (std::int64_t s : plan.freed_slots) pool.release(s);
}

std::vector<float> contents(TokenPool& pool, const Request& r) {
  std::vector<float> out;
  for (std::int64_t s : r.slots)
    for (Index l = 0; l < kLayers; ++l)
      for (Index h = 0; h < kHkv; ++h) {
        out.insert(out.end(), pool.krow(l, s, h), pool.krow(l, s, h) + kD);
        out.insert(out.end(), pool.vrow(l, s, h), pool.vrow(l, s, h) + kD);
      }
  return out;
}

}  // namespace

TEST_CASE("SGLang plan: worked numbers", "[adapters][sglang]") {
  const std::vector<std::int64_t> slots{40, 41, 42, 43, 17, 18, 19, 5};  // 8 tokens
  // Rows 0, 1, 4, 5, 7 kept: the map keeps their slots; slots 42, 43, 19 are freed.
  const SGLangPlan plan = kvevict::adapters::sglang_plan({hand(8, {0, 1, 4, 5, 7})}, slots);
  CHECK(plan.slots == std::vector<std::int64_t>{40, 41, 17, 18, 5});
  CHECK(plan.freed_slots == std::vector<std::int64_t>{42, 43, 19});
  REQUIRE(plan.rotations.size() == 2);  // rows 4, 5 -> positions 2, 3 in slots 17, 18; row 7 -> 4 in slot 5
  CHECK((plan.rotations[0].slot == 17 && plan.rotations[0].count == 2 && plan.rotations[0].delta == -2));
  CHECK((plan.rotations[1].slot == 5 && plan.rotations[1].count == 1 && plan.rotations[1].delta == -3));
  CHECK((plan.num_tokens == 5 && plan.next_position == 5));

  // The first 2 tokens in the radix cache: an evicted one leaves the map and is not freed.
  const SGLangPlan shared =
      kvevict::adapters::sglang_plan({hand(8, {0, 4, 5, 7})}, slots, Positions::kept, 0, /*shared_tokens=*/2);
  CHECK(shared.slots == std::vector<std::int64_t>{40, 17, 18, 5});
  CHECK(shared.freed_slots == std::vector<std::int64_t>{42, 43, 19});
  CHECK(shared.rotations.empty());
  CHECK(shared.next_position == 8);

  // Nothing kept: every slot freed.
  const SGLangPlan none = kvevict::adapters::sglang_plan({hand(8, {})}, slots);
  CHECK((none.slots.empty() && none.freed_slots == slots && none.num_tokens == 0 && none.next_position == 0));
}

TEST_CASE("SGLang plan: the simulated token pool holds what compact and rerotate_kept give, for every catalogue policy",
          "[adapters][sglang][catalogue]") {
  constexpr Index kShared = 8;  // request 1 shares request 0's first 8 tokens (a radix-cached prefix)
  const int cases = for_each_adapter_case(4, [&](const auto& policy, const AdapterCase& tc) {
    const kvevict::Rope& rope = tc.rope;
    const Positions mode = tc.mode;
    Rng rng(tc.seed);
    TokenPool pool;
    Request a, b;
    for (std::int64_t p = 0; p < 37; ++p) a.append(pool, p, rng);
    b.slots.assign(a.slots.begin(), a.slots.begin() + kShared);
    b.pos.assign(a.pos.begin(), a.pos.begin() + kShared);
    for (std::int64_t p = kShared; p < kShared + 5; ++p) b.append(pool, p, rng);
    const std::vector<float> b_before = contents(pool, b);
    for (int round = 0; round < 2; ++round) {
      INFO("round " << round);
      SeqView view(a.pos, a.key(pool), a.value(pool), rng);
      const std::vector<Selection> sels =
          kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(16).protect_prefix(kShared));
      const Expected want = expected(view, sels, mode == Positions::renumbered, rope);
      const std::size_t free_before = pool.free.size();
      const SGLangPlan plan = kvevict::adapters::sglang_plan(sels, a.slots, mode, 0, kShared);
      apply(pool, a, plan, rope);
      a.pos = want.pos;
      CHECK(holds(static_cast<Index>(a.slots.size()), a.key(pool), a.value(pool), want) == "");
      CHECK(plan.num_tokens == sels[0].length(0));
      CHECK(pool.free.size() == free_before + plan.freed_slots.size());
      for (Index j = 0; j < kShared; ++j) CHECK(pool.free.count(b.slots[sz(j)]) == 0);
      CHECK(contents(pool, b) == b_before);
      CHECK(plan.next_position == (mode == Positions::renumbered ? plan.num_tokens : want.pos.back() + 1));
      for (std::int64_t p = plan.next_position; p < plan.next_position + 6; ++p) a.append(pool, p, rng);
    }
  });
  CHECK(cases >= 2 * 2 * 2 * 12);
}

TEST_CASE("SGLang plan: refuses a selection or a map its slots cannot hold", "[adapters][sglang][errors]") {
  const std::vector<std::int64_t> slots{40, 41, 42, 43, 17, 18, 19, 5};
  std::vector<char> keep{1, 1, 0, 1, 1, 0, 1, 1};
  REQUIRE_THROWS_MATCHES(kvevict::adapters::sglang_plan({Selection::from_flags(keep, 2, 4)}, {1, 2, 3, 4}),
                         kvevict::invalid_argument,
                         MessageContains("layer 0 KV head 1 keeps other entries than its KV head 0 (select with "
                                         "share = per_model)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::sglang_plan({hand(8, {0, 7})}, {1, 2, 3}), kvevict::invalid_argument,
                         MessageContains("slots holds 3 entries, but the request has 8 tokens"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::sglang_plan({hand(4, {0, 3})}, {1, -2, 3, 4}), kvevict::invalid_argument,
                         MessageContains("slots[1] must be >= 0, got -2"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::sglang_plan({hand(4, {0, 3})}, {7, 2, 7, 4}), kvevict::invalid_argument,
                         MessageContains("slot 7 appears twice in slots"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::sglang_plan({hand(8, {0, 2, 7})}, slots, Positions::renumbered, 0, 4),
                         kvevict::invalid_argument,
                         MessageContains("would turn the key of shared token 2 (slot 42, position 2 -> 1)"));
}

}  // namespace test_adapter_sglang
