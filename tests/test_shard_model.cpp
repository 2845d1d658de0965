// Policy::select(layers, budget, shard::ModelShard): a model's layers split across pipeline stages and its KV heads
// across tensor-parallel ranks (threads here) keep, on every rank, exactly what the one-rank selection of the model
// keeps for those layers and heads (docs/algorithms.md#sharded), layer-global policies included.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/ragged_inputs.hpp"
#include "support/shard_models.hpp"
#include "support/thread_communicator.hpp"

namespace test_shard_model {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::LayerInputs;
using kvevict::Selection;
using kvevict::shard::Communicator;
using kvevict::shard::ModelShard;
using kvevict_test::Model;
using kvevict_test::part_of;
using kvevict_test::RankPart;
using kvevict_test::with_window;

namespace {

// Every rank's selections, against the one-rank selection of the model. Returns the heads compared.
template <class P>
int compare(const P& policy, const Model& m, const Budget& budget, int tp, int pp, const std::string& what) {
  const std::vector<Selection> whole = policy.select(m.layers, budget);
  std::vector<std::pair<std::vector<std::string>, int>> found(static_cast<std::size_t>(tp * pp));
  kvevict_test::run_split_ranks(tp, pp, [&](Communicator& model, Communicator& stage) {
    const RankPart p = kvevict_test::rank_part(m, tp, pp, model, stage);
    found[static_cast<std::size_t>(model.rank())] =
        kvevict_test::mismatches(whole, p, policy.select(p.layers, budget, p.shard));
  });
  int compared = 0;
  for (std::size_t r = 0; r < found.size(); ++r) {
    INFO(what << ", TP " << tp << " x PP " << pp << ", rank " << r);
    CHECK(found[r].first == std::vector<std::string>{});
    compared += found[r].second;
  }
  return compared;
}

// A preset in a layout: `share` sets of `block` rows (docs/algorithms.md#layouts).
template <class P>
P in_layout(kvevict::Sharing share, Index block, typename P::Params p = {}) {
  p.share = share;
  p.block = block;
  return with_window<P>(4, p);
}

}  // namespace

TEST_CASE("a sharded model in a layout (shared sets, blocks) keeps what one rank keeps", "[shard][layout]") {
  using kvevict::Sharing;
  kvevict_test::Rng rng(4242);
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(6); ++c) {
    const int layers = 2 + c % 3, Hkv = c % 2 == 0 ? 4 : 2, G = 1 + c % 2;
    const bool dense = c % 3 != 2;  // a shared set needs its heads to hold the same entries
    const Model m = kvevict_test::random_model(rng, layers, Hkv, G, dense, c % 4 == 1, c == 4 ? 0 : -1, 0);
    for (const Budget& budget : {Budget::keep_ratio(0.3), Budget::tokens(12)})
      for (int tp = 1; tp <= Hkv; tp *= 2)
        for (int pp = 1; pp <= 2; ++pp) {
          const std::string what = "case " + std::to_string(c) + (dense ? ", dense" : ", ragged") + ", budget " +
                                   std::to_string(budget.value());
          compared += compare(in_layout<kvevict::LayerDefensiveKV>(Sharing::per_head, 4), m, budget, tp, pp,
                              "LayerDefensiveKV per_head/4, " + what);
          compared +=
              compare(in_layout<kvevict::AdaKV>(Sharing::per_head, 4), m, budget, tp, pp, "AdaKV per_head/4, " + what);
          if (!dense) continue;
          compared += compare(in_layout<kvevict::LayerDefensiveKV>(Sharing::per_layer, 4), m, budget, tp, pp,
                              "LayerDefensiveKV per_layer/4, " + what);
          compared += compare(in_layout<kvevict::SnapKV>(Sharing::per_layer, 1), m, budget, tp, pp,
                              "SnapKV per_layer/1, " + what);
          compared += compare(in_layout<kvevict::DefensiveKV>(Sharing::per_model, 4), m, budget, tp, pp,
                              "DefensiveKV per_model/4, " + what);
          compared += compare(in_layout<kvevict::OpenDefensiveKV>(Sharing::per_model, 1), m, budget, tp, pp,
                              "OpenDefensiveKV per_model/1, " + what);
          compared += compare(with_window<kvevict::TOVA>(4), m, budget, tp, pp, "TOVA, " + what);
          compared += compare(in_layout<kvevict::PyramidKV>(Sharing::per_layer, 4), m, budget, tp, pp,
                              "PyramidKV per_layer/4, " + what);
        }
  }
  CHECK(compared > kvevict_test::cases(1500));
}

TEST_CASE("a model split across pipeline stages and tensor-parallel ranks keeps what one rank keeps", "[shard]") {
  kvevict_test::Rng rng(20261207);
  kvevict::LayerDefensiveKV::Params no_mass;
  no_mass.mass_forcing = false;  // the scores decide across layers (forcing alone can fill these small budgets)
  kvevict::OpenDefensiveKV::Params open_l2;
  open_l2.value_norm = kvevict::ValueNorm::l2;
  int compared = 0;
  for (int c = 0; c < kvevict_test::cases(8); ++c) {
    const int layers = 2 + c % 3, Hkv = c % 2 == 0 ? 4 : 2, G = 1 + c % 2;
    const bool dense = c % 3 == 0;
    const Model m = kvevict_test::random_model(rng, layers, Hkv, G, dense, c % 4 == 1, c == 3 ? 1 : -1);
    const std::vector<std::pair<Budget, std::string>> budgets{{Budget::keep_ratio(0.3), "keep 0.3"},
                                                              {Budget::tokens(10), "10 tokens"}};
    for (const auto& [budget, label] : budgets)
      for (int tp = 1; tp <= Hkv; tp *= 2)
        for (int pp = 1; pp <= 2; ++pp) {
          const std::string what = "case " + std::to_string(c) + ", " + std::to_string(layers) + " layers, Hkv " +
                                   std::to_string(Hkv) + ", G " + std::to_string(G) + (dense ? ", dense" : ", ragged") +
                                   ", " + label;
          compared +=
              compare(with_window<kvevict::LayerDefensiveKV>(4), m, budget, tp, pp, "LayerDefensiveKV, " + what);
          compared += compare(with_window<kvevict::LayerDefensiveKV>(4, no_mass), m, budget, tp, pp,
                              "LayerDefensiveKV without mass forcing, " + what);
          compared += compare(with_window<kvevict::OpenDefensiveKV>(4), m, budget, tp, pp, "OpenDefensiveKV, " + what);
          compared += compare(with_window<kvevict::OpenDefensiveKV>(4, open_l2), m, budget, tp, pp,
                              "OpenDefensiveKV L2, " + what);
          compared +=
              compare(with_window<kvevict::LayerEngineScores>(4), m, budget, tp, pp, "LayerEngineScores, " + what);
          compared += compare(with_window<kvevict::LayerGlobalPolicy<kvevict::AttentionSelector>>(4), m, budget, tp, pp,
                              "LayerGlobalPolicy<AttentionSelector>, " + what);
          compared += compare(with_window<kvevict::AdaKV>(4), m, budget, tp, pp, "AdaKV, " + what);
          compared += compare(with_window<kvevict::PyramidKV>(4), m, budget, tp, pp, "PyramidKV, " + what);
          compared +=
              compare(with_window<kvevict::ExpectedAttention>(4), m, budget, tp, pp, "ExpectedAttention, " + what);
          compared += compare(with_window<kvevict::DefensiveKV>(4), m, budget, tp, pp, "DefensiveKV, " + what);
        }
  }
  CHECK(compared > kvevict_test::cases(2000));  // a quarter of the cases under the sanitizers
}

TEST_CASE("a sharded model refuses bad shards and policies it cannot split, on every rank", "[shard][errors]") {
  kvevict_test::Rng rng(11);
  const Model m = kvevict_test::random_model(rng, 2, 2, 2, true, false, -1);
  // Every rank's message for TP 2 x PP 2 (ranks 0-1 hold layer 0, ranks 2-3 layer 1); `change(rank, layers, shard)`
  // spoils a rank's part.
  using Change = std::function<void(int, std::vector<LayerInputs<float>>&, ModelShard&)>;
  const auto messages = [&](const auto& policy, const Change& change) {
    std::vector<std::string> out(4);
    std::mutex mutex;
    kvevict_test::run_split_ranks(2, 2, [&](Communicator& model, Communicator& stage) {
      const Index layer = model.rank() / 2, head = stage.rank();
      ModelShard shard{&model, &stage, {layer}, {head}};
      std::vector<LayerInputs<float>> mine{part_of(m.layers[static_cast<std::size_t>(layer)], head, 1, 2)};
      change(model.rank(), mine, shard);
      try {
        (void)policy.select(mine, Budget::keep_ratio(0.5), shard);
      } catch (const kvevict::invalid_argument& e) {
        std::lock_guard<std::mutex> lock(mutex);
        out[static_cast<std::size_t>(model.rank())] = e.what();
      }
    });
    return out;
  };
  const auto defensive = with_window<kvevict::LayerDefensiveKV>(4);
  const auto none = [](int, std::vector<LayerInputs<float>>&, ModelShard&) {};
  SECTION("the model's selection matches on this split") {
    for (const auto& msg : messages(defensive, none)) CHECK(msg.empty());
  }
  SECTION("the reference code's quirks") {
    kvevict::LayerDefensiveKV::Params quirks;
    quirks.reference_quirks = true;
    for (const auto& msg : messages(with_window<kvevict::LayerDefensiveKV>(4, quirks), none))
      CHECK_THAT(msg, Catch::Matchers::Contains("sharded selection runs without reference_quirks"));
  }
  SECTION("a layer held by no rank") {
    const Change gap = [](int rank, std::vector<LayerInputs<float>>&, ModelShard& s) {
      if (rank >= 2) s.layers = {2};
    };
    for (const auto& msg : messages(defensive, gap))
      CHECK_THAT(msg, Catch::Matchers::Contains("layer 1 is held by no rank"));
  }
  SECTION("a KV head held twice") {
    const Change twice = [](int rank, std::vector<LayerInputs<float>>&, ModelShard& s) {
      if (rank == 1) s.kv_heads = {0};
    };
    for (const auto& msg : messages(defensive, twice))
      CHECK_THAT(msg, Catch::Matchers::Contains("layer 0, KV head 0 is held twice"));
  }
  SECTION("one layer's heads over two groups") {
    const Change split = [](int rank, std::vector<LayerInputs<float>>&, ModelShard& s) {
      if (rank >= 2) s.layer_group = nullptr;  // ranks 2 and 3 each alone, with one KV head of layer 1 each
    };
    for (const auto& msg : messages(defensive, split))
      CHECK_THAT(msg, Catch::Matchers::Contains("layer 1 is held by two layer groups"));
  }
  SECTION("ranks of a group that hold different layers") {
    const Change other = [&](int rank, std::vector<LayerInputs<float>>& layers, ModelShard& s) {
      if (rank == 1) {
        s.layers = {0, 1};
        layers.push_back(part_of(m.layers[1], 1, 1, 2));
      }
    };
    for (const auto& msg : messages(defensive, other))
      CHECK_THAT(msg,
                 Catch::Matchers::Contains("rank 1 of the layer group (ModelShard::layer_group) holds other layers"));
  }
  SECTION("one rank's keys are not finite in its layer") {
    std::vector<float> keys(m.stored[1].k);
    const std::size_t capacity = keys.size() / 16;  // [2 KV heads, capacity, d 8], dense: head 1 holds 41 rows
    keys[((capacity + 40) * 8) + 7] = std::nanf("");
    const Change spoil = [&](int rank, std::vector<LayerInputs<float>>& layers, ModelShard&) {
      if (rank == 3) {
        LayerInputs<float> bad = m.layers[1];
        bad.keys = kvevict::kv_heads_major<const float>(keys.data(), 2, static_cast<Index>(capacity), 8);
        layers.front() = part_of(bad, 1, 1, 2);
      }
    };
    for (const auto& msg : messages(defensive, spoil))
      CHECK_THAT(msg,
                 Catch::Matchers::Contains("rank 3 of 4: layer 1: keys[0, 40, 7] (token position 40) is not finite"));
  }
}

}  // namespace test_shard_model
