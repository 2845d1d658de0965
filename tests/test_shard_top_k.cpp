// shard/top_k.hpp: one top-k over score maps split across ranks (tensor-parallel heads, pipeline-parallel layers)
// gives every rank exactly the unsharded counts of its heads (docs/algorithms.md#sharded). Ranks are threads.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>
#include <kvevict/shard/top_k.hpp>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/shard_models.hpp"
#include "support/thread_communicator.hpp"

namespace test_shard_top_k {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::extend::ScoreMap;
using kvevict::extend::Tier;
using kvevict::shard::Communicator;
using kvevict::shard::ShardMap;
using kvevict_test::part_heads;
using kvevict_test::random_map;
using kvevict_test::Rng;
using kvevict_test::rows_of;
using kvevict_test::shard_sz;

namespace {

Index competing(const std::vector<ScoreMap<double>>& layers, bool scored_only) {
  Index n = 0;
  for (const auto& m : layers)
    for (Tier t : m.tier) n += t != Tier::absent && (!scored_only || t == Tier::scored);
  return n;
}

}  // namespace

TEST_CASE("sharded top-k equals the unsharded one for every split of heads and layers", "[shard]") {
  Rng rng(20261206);
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(300); ++c) {
    const Index layers = 1 + pick(rng) % 4, heads = 1 + pick(rng) % 8, tokens = 1 + pick(rng) % 40;
    std::vector<ScoreMap<double>> model;
    for (Index l = 0; l < layers; ++l) model.push_back(random_map(rng, heads, tokens));
    const bool scored_only = pick(rng) % 4 == 0;  // AdaKV's original variant ranks the scored tier alone
    const Index available = competing(model, scored_only);
    const Index k = available == 0 ? 0 : pick(rng) % (available + 1);
    std::vector<const ScoreMap<double>*> pointers;
    for (const auto& m : model) pointers.push_back(&m);
    const auto eligible = [&](const ScoreMap<double>& m, std::size_t f) {
      return !scored_only || m.tier[f] == Tier::scored;
    };
    // Unsharded: one top-k over every layer (allocate_layer_global), or the first layer alone (top_k_counts).
    std::vector<std::vector<Index>> expected;
    if (!scored_only) {
      expected = kvevict::extend::allocate_layer_global(pointers, k);
    } else {  // allocate_layer_global has no predicate: check one layer
      const Index k0 = std::min(k, competing({model.front()}, true));
      expected = {
          kvevict::extend::top_k_counts(model.front(), k0, [&](std::size_t f) { return eligible(model.front(), f); })};
    }
    const Index k_used = scored_only ? std::min(k, competing({model.front()}, true)) : k;
    const Index used_layers = scored_only ? 1 : layers;
    const int tp = 1 + pick(rng) % 4,
              pp = scored_only ? 1 : 1 + static_cast<int>(pick(rng) % std::min<Index>(2, layers));
    const bool contiguous = pick(rng) % 2 == 0;
    std::vector<std::vector<std::vector<Index>>> got(static_cast<std::size_t>(tp * pp));
    std::vector<std::vector<std::pair<Index, std::vector<Index>>>> held(got.size());  // (layer, heads) per map
    kvevict_test::run_ranks(tp * pp, [&](Communicator& comm) {
      const int stage = comm.rank() / tp, part = comm.rank() % tp;
      std::vector<ScoreMap<double>> local;
      std::vector<std::pair<Index, std::vector<Index>>> mine;
      for (Index l = 0; l < used_layers; ++l) {
        if (static_cast<int>(l * pp / used_layers) != stage) continue;
        std::vector<Index> hs = part_heads(heads, tp, part, contiguous);
        if (hs.empty()) continue;
        local.push_back(rows_of(model[shard_sz(l)], hs));
        mine.emplace_back(l, hs);
      }
      std::vector<ShardMap<double>> maps;
      for (std::size_t i = 0; i < local.size(); ++i) maps.push_back({&local[i], mine[i].first, mine[i].second});
      got[static_cast<std::size_t>(comm.rank())] = kvevict::shard::top_k_counts(
          comm, maps, k_used, [&](std::size_t m, std::size_t f) { return eligible(local[m], f); });
      held[static_cast<std::size_t>(comm.rank())] = mine;
    });
    for (std::size_t r = 0; r < got.size(); ++r)
      for (std::size_t m = 0; m < held[r].size(); ++m) {
        const auto& [layer, hs] = held[r][m];
        for (std::size_t i = 0; i < hs.size(); ++i) {
          INFO("case " << c << ", rank " << r << " of tp " << tp << " x pp " << pp << ", layer " << layer << ", head "
                       << hs[i] << ", k " << k_used);
          CHECK(got[r][m][i] == expected[shard_sz(layer)][shard_sz(hs[i])]);
          ++compared;
        }
      }
  }
  CHECK(compared > kvevict_test::cases(1000));  // a quarter of the cases under the sanitizers
}

TEST_CASE("sharded top-k sends at most min(k, candidates) entries per rank", "[shard]") {
  Rng rng(7);
  const ScoreMap<double> layer = random_map(rng, 8, 64);
  const Index k = 20;
  std::vector<std::uint64_t> bytes(4);
  std::vector<int> rounds(4);
  kvevict_test::run_ranks(4, [&](Communicator& comm) {
    kvevict::shard::CountingCommunicator counting(comm);
    const std::vector<Index> hs = part_heads(8, 4, comm.rank(), true);
    const ScoreMap<double> local = rows_of(layer, hs);
    (void)kvevict::shard::top_k_counts<double>(counting, {{&local, 0, hs}}, k);
    bytes[static_cast<std::size_t>(comm.rank())] = counting.bytes_sent();
    rounds[static_cast<std::size_t>(comm.rank())] = counting.rounds();
  });
  const std::uint64_t candidates = k * sizeof(kvevict::shard::detail::Candidate<double>);
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(rounds[r] == 6);  // the check (1: nothing failed), the ids (2), the counts, the candidates (2)
    CHECK(bytes[r] <= candidates + 6 * 8 + 2 * 2 * 8);  // + at most 8 bytes a round + 2 (layer, head) ids
    CHECK(bytes[r] >= candidates);
  }
}

TEST_CASE("sharded top-k refuses bad shards on every rank", "[shard][errors]") {
  Rng rng(11);
  const ScoreMap<double> layer = random_map(rng, 4, 16);
  const auto run = [&](const std::function<std::vector<Index>(int)>& heads_of, Index k, int bad_rank = -1) {
    std::vector<std::string> messages(2);
    std::mutex mutex;
    kvevict_test::run_ranks(2, [&](Communicator& comm) {
      const std::vector<Index> hs = heads_of(comm.rank());
      const ScoreMap<double> local = rows_of(layer, hs);
      ShardMap<double> map{&local, 0, hs};
      if (comm.rank() == bad_rank) map.heads.pop_back();
      try {
        (void)kvevict::shard::top_k_counts<double>(comm, {map}, k);
      } catch (const kvevict::invalid_argument& e) {
        std::lock_guard<std::mutex> lock(mutex);
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return messages;
  };
  SECTION("a KV head held by two ranks") {
    const auto m = run([](int r) { return r == 0 ? std::vector<Index>{0, 1, 2} : std::vector<Index>{2, 3}; }, 4);
    for (const auto& s : m)
      CHECK_THAT(s, Catch::Matchers::Contains("layer 0, KV head 2 is held twice (again by rank 1)"));
  }
  SECTION("one rank's map without an id per head") {
    const auto m = run([](int r) { return part_heads(4, 2, r, true); }, 4, 1);
    for (const auto& s : m)
      CHECK_THAT(s, Catch::Matchers::Contains(
                        "rank 1 of 2: map 0 (layer 0) needs one global head id per head of its map (2), got 1"));
  }
  SECTION("k larger than every rank's entries together") {
    const auto m = run([](int r) { return part_heads(4, 2, r, true); }, 65);
    for (const auto& s : m)
      CHECK_THAT(s, Catch::Matchers::Contains("k (65) must be <= the entries that compete on all ranks (64)"));
  }
}

}  // namespace test_shard_top_k
