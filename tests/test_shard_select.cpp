// Policy::select(in, budget, shard::LayerShard): a layer's KV heads split across tensor-parallel ranks (threads
// here) keep, on every rank, exactly what the one-rank selection keeps for those heads (docs/algorithms.md#sharded).
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/ragged_inputs.hpp"
#include "support/shard_models.hpp"
#include "support/thread_communicator.hpp"

namespace test_shard_select {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::HeadsView;
using kvevict::Index;
using kvevict::LayerInputs;
using kvevict::Selection;
using kvevict::shard::Communicator;
using kvevict::shard::LayerShard;
using kvevict_test::heads_of;
using kvevict_test::part_of;
using kvevict_test::with_window;

namespace {

// Every rank's selection of its heads, against the one-rank selection of the layer.
template <class P>
int compare(const P& policy, const LayerInputs<float>& in, const Budget& budget, Index kv_heads, Index group, int ranks,
            const std::string& what) {
  const Selection whole = policy.select(in, budget);
  std::vector<Selection> parts(static_cast<std::size_t>(ranks));
  std::vector<std::vector<Index>> held(parts.size());
  kvevict_test::run_ranks(ranks, [&](Communicator& comm) {
    const std::vector<Index> hs = kvevict_test::part_heads(kv_heads, ranks, comm.rank(), true);
    const LayerShard shard{&comm, hs, 3};
    const Index h0 = hs.empty() ? 0 : hs.front();
    parts[static_cast<std::size_t>(comm.rank())] =
        policy.select(part_of(in, h0, static_cast<Index>(hs.size()), group), budget, shard);
    held[static_cast<std::size_t>(comm.rank())] = hs;
  });
  int compared = 0;
  for (std::size_t r = 0; r < parts.size(); ++r)
    for (std::size_t i = 0; i < held[r].size(); ++i, ++compared) {
      INFO(what << ", rank " << r << " of " << ranks << ", KV head " << held[r][i]);
      const auto mine = parts[r].head(static_cast<Index>(i));
      const auto one = whole.head(held[r][i]);
      CHECK(std::vector<std::int64_t>(mine.begin(), mine.end()) == std::vector<std::int64_t>(one.begin(), one.end()));
    }
  return compared;
}

}  // namespace

TEST_CASE("a layer split across tensor-parallel ranks keeps what one rank keeps", "[shard]") {
  kvevict_test::Rng rng(20261207);
  kvevict::AdaKV::Params original;
  original.variant = kvevict::HeadAdaptiveAllocation::Variant::original;
  const auto adakv_original = with_window<kvevict::AdaKV>(4, original);
  kvevict::DefensiveKV::Params l2, no_mass;
  l2.value_norm = kvevict::ValueNorm::l2;
  no_mass.mass_forcing = false;   // the scores decide (forcing alone can fill these small budgets)
  kvevict::AdaKV::Params blocks;  // layouts (docs/algorithms.md#layouts): the layer assembled on every rank
  blocks.block = 4;
  kvevict::DefensiveKV::Params blocks_defensive;
  blocks_defensive.block = 4;
  kvevict::DefensiveKV::Params pages;
  pages.share = kvevict::Sharing::per_layer;
  pages.block = 4;
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(12); ++c) {
    const int Hkv = 1 + c % 5, G = 1 + c % 3, w = 4, d = 8, T = 40 + 7 * c;
    const bool dense = c % 3 == 0;
    const kvevict_test::Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, T, dense ? 1.0 : 0.6);
    const auto stored = kvevict_test::store<float>(r, T + 3, c % 2 == 1, 0.0f, 0, c % 4 != 2);
    const std::vector<std::pair<Budget, std::string>> budgets{
        {Budget::keep_ratio(0.5), "keep 0.5"}, {Budget::keep_ratio(0.2), "keep 0.2"}, {Budget::tokens(9), "9 tokens"}};
    for (const auto& [budget, label] : budgets) {
      for (int ranks = 1; ranks <= std::min(4, Hkv); ranks *= 2) {  // every rank holds a KV head
        const std::string what = "case " + std::to_string(c) + ", Hkv " + std::to_string(Hkv) + ", G " +
                                 std::to_string(G) + (dense ? ", dense" : ", ragged") + ", " + label;
        compared += compare(with_window<kvevict::SnapKV>(w), stored.in, budget, Hkv, G, ranks, "SnapKV, " + what);
        compared += compare(with_window<kvevict::AdaKV>(w), stored.in, budget, Hkv, G, ranks, "AdaKV, " + what);
        compared += compare(adakv_original, stored.in, budget, Hkv, G, ranks, "AdaKV original, " + what);
        compared +=
            compare(with_window<kvevict::CriticalKV>(w), stored.in, budget, Hkv, G, ranks, "CriticalKV, " + what);
        compared += compare(with_window<kvevict::CriticalSnapKV>(w), stored.in, budget, Hkv, G, ranks,
                            "CriticalSnapKV, " + what);
        compared += compare(with_window<kvevict::KNorm>(w), stored.in, budget, Hkv, G, ranks, "KNorm, " + what);
        compared += compare(with_window<kvevict::KeyDiff>(w), stored.in, budget, Hkv, G, ranks, "KeyDiff, " + what);
        compared += compare(with_window<kvevict::H2O>(w), stored.in, budget, Hkv, G, ranks, "H2O, " + what);
        compared +=
            compare(with_window<kvevict::StreamingLLM>(w), stored.in, budget, Hkv, G, ranks, "StreamingLLM, " + what);
        compared +=
            compare(with_window<kvevict::EngineScores>(w), stored.in, budget, Hkv, G, ranks, "EngineScores, " + what);
        compared +=
            compare(with_window<kvevict::DefensiveKV>(w), stored.in, budget, Hkv, G, ranks, "DefensiveKV, " + what);
        compared += compare(with_window<kvevict::DefensiveKV>(w, l2), stored.in, budget, Hkv, G, ranks,
                            "DefensiveKV L2, " + what);
        compared += compare(with_window<kvevict::AdaKVDefensive>(w), stored.in, budget, Hkv, G, ranks,
                            "AdaKVDefensive, " + what);
        compared += compare(with_window<kvevict::DefensiveKV>(w, no_mass), stored.in, budget, Hkv, G, ranks,
                            "DefensiveKV without mass forcing, " + what);
        compared += compare(with_window<kvevict::ExpectedAttention>(w), stored.in, budget, Hkv, G, ranks,
                            "ExpectedAttention, " + what);
        compared += compare(with_window<kvevict::AdaKV>(w, blocks), stored.in, budget, Hkv, G, ranks,
                            "AdaKV in blocks of 4, " + what);
        // The last KV head named a retrieval head: forced on the rank that holds it, as on one rank.
        LayerInputs<float> named = stored.in;
        named.retrieval_heads = {Hkv - 1};
        compared += compare(with_window<kvevict::AdaKV>(w), named, budget, Hkv, G, ranks, "AdaKV, head named, " + what);
        compared += compare(with_window<kvevict::DefensiveKV>(w), named, budget, Hkv, G, ranks,
                            "DefensiveKV, head named, " + what);
        compared += compare(with_window<kvevict::DefensiveKV>(w, blocks_defensive), named, budget, Hkv, G, ranks,
                            "DefensiveKV in blocks of 4, head named (the assembled layers carry it), " + what);
        if (dense) {  // one set per layer: its heads hold the same entries
          compared += compare(with_window<kvevict::TOVA>(w), stored.in, budget, Hkv, G, ranks, "TOVA, " + what);
          compared += compare(with_window<kvevict::DefensiveKV>(w, pages), stored.in, budget, Hkv, G, ranks,
                              "DefensiveKV per layer in blocks of 4, " + what);
          compared += compare(with_window<kvevict::DefensiveKV>(w, pages), named, budget, Hkv, G, ranks,
                              "DefensiveKV per layer in blocks of 4, head named, " + what);
        }
      }
    }
  }
  CHECK(compared > kvevict_test::cases(1000));  // a quarter of the cases under the sanitizers
}

TEST_CASE("sharded Expected Attention reads global KV head 0's window positions", "[shard]") {
  // Head h's positions spread (h + 1) times (a shift alone cancels out of the averaged rotation): the window queries'
  // positions are KV head 0's, which a rank holding heads 2-3 does not hold (its own first head's would differ).
  kvevict_test::Rng rng(77);
  const kvevict_test::Ragged r = kvevict_test::random_ragged(rng, 8, 4, 4, 8, 48, 0.7);
  auto stored = kvevict_test::store<float>(r, 48, false, 0.0f);
  for (Index h = 0; h < 4; ++h)
    for (Index j = 0; j < 48; ++j) stored.positions[static_cast<std::size_t>(h * 48 + j)] *= h + 1;
  kvevict::ExpectedAttention::Params p;
  p.window = 4;
  p.future_positions = 8;
  p.sinks = 0;  // the scores decide
  CHECK(compare(kvevict::ExpectedAttention(p), stored.in, Budget::keep_ratio(0.5), 4, 2, 2, "spread heads") == 4);
}

TEST_CASE("sharded selection refuses what it cannot do yet, and bad shards, on every rank", "[shard][errors]") {
  kvevict_test::Rng rng(5);
  const kvevict_test::Ragged r = kvevict_test::random_ragged(rng, 4, 2, 4, 8, 32, 1.0);
  auto stored = kvevict_test::store<float>(r, 32, false, 0.0f);
  // Every rank's message for a run of 2 ranks; `change(rank, inputs, shard)` spoils a rank's part.
  const auto messages = [&](const auto& policy,
                            const std::function<void(int, LayerInputs<float>&, LayerShard&)>& change) {
    std::vector<std::string> out(2);
    std::mutex mutex;
    kvevict_test::run_ranks(2, [&](Communicator& comm) {
      LayerShard shard{&comm, {comm.rank()}, 0};
      LayerInputs<float> part = part_of(stored.in, comm.rank(), 1, 2);
      change(comm.rank(), part, shard);
      try {
        (void)policy.select(part, Budget::keep_ratio(0.5), shard);
      } catch (const kvevict::invalid_argument& e) {
        std::lock_guard<std::mutex> lock(mutex);
        out[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return out;
  };
  const auto none = [](int, LayerInputs<float>&, LayerShard&) {};
  SECTION("a policy that looks across layers") {
    for (const auto& m : messages(with_window<kvevict::LayerDefensiveKV>(4), none))
      CHECK_THAT(m, Catch::Matchers::Contains("sharded selection takes SnapKV, AdaKV, PyramidKV"));
  }
  SECTION("one set for the whole model, from one layer") {
    kvevict::SnapKV::Params p;
    p.share = kvevict::Sharing::per_model;
    for (const auto& m : messages(with_window<kvevict::SnapKV>(4, p), none))
      CHECK_THAT(m, Catch::Matchers::Contains("share = per_model selects every layer at once"));
  }
  SECTION("a KV head held by two ranks") {
    for (const auto& m :
         messages(with_window<kvevict::AdaKV>(4), [](int, LayerInputs<float>&, LayerShard& s) { s.kv_heads = {0}; }))
      CHECK_THAT(m, Catch::Matchers::Contains("KV head 0 is held by two ranks"));
  }
  SECTION("one rank's values are not finite, before DefensiveKV's exchanges") {
    std::vector<float> values(stored.v);
    values[values.size() - 1] = std::nanf("");
    const auto spoil = [&](int rank, LayerInputs<float>& in, LayerShard&) {
      if (rank == 1) in.values = heads_of(kvevict::kv_heads_major<const float>(values.data(), 2, 32, 8), 1, 1);
    };
    for (const auto& m : messages(with_window<kvevict::DefensiveKV>(4), spoil))
      CHECK_THAT(m, Catch::Matchers::Contains("rank 1 of 2: values[0, 31, 7] (token position 31) is not finite"));
  }
  SECTION("one rank's inputs are not finite") {
    std::vector<float> keys(stored.k);
    keys[keys.size() - 1] = std::nanf("");
    const auto spoil = [&](int rank, LayerInputs<float>& in, LayerShard&) {
      if (rank == 1) in.keys = heads_of(kvevict::kv_heads_major<const float>(keys.data(), 2, 32, 8), 1, 1);
    };
    for (const auto& m : messages(with_window<kvevict::SnapKV>(4), spoil))
      CHECK_THAT(m, Catch::Matchers::Contains("rank 1 of 2: keys[0, 31, 7] (token position 31) is not finite"));
  }
}

}  // namespace test_shard_select
