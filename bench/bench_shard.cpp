// Traffic of sharded selection (docs/algorithms.md#sharded): a model of kLayers Llama-3.1-8B layers (distinct random
// tensors, f32, keep 10 %) split over TP tensor-parallel ranks x PP pipeline stages, ranks as threads of this
// process (tests/support/thread_communicator.hpp), each calling Policy::select(its layers, budget, ModelShard) through
// kvevict::CountingCommunicator. Counters, per rank and eviction (the largest over the ranks):
//   model_KiB   bytes a rank sends over ModelShard::comm (every rank): the agreed checks, the shard's (layer, head)
//               ids, the layer totals, the top-k's candidates (layer-global policies: O(budget))
//   group_KiB   bytes over ModelShard::layer_group (its tensor-parallel group; none at TP 1): each layer's lengths,
//               its top-k (per-layer policies), DefensiveKV's window bias and value sums (24 bytes an entry: O(Hkv L))
//   rounds      all_gathers a rank takes part in (both communicators; a group of one rank not counted)
//   KV_MiB      the keys and values the rank holds (f32): what the traffic governs
//   B_per_kept  (model + group bytes) / the entries the rank keeps
// The Time column is the slowest rank's select (the ranks share this machine's cores, so it is no engine's time).
//
//   build/release/bench/kvevict_bench --benchmark_filter='BM_shard/' --benchmark_counters_tabular=true
//
// Names: BM_shard/<policy>/<TP>x<PP>/<model>/<L>; BM_shard_stream/... the same eviction through evict_over_budget
// over a ModelShard (a CacheBook per rank holding its L tokens): the book's exchange on top (40 bytes a (layer, head)).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.hpp"
#include "kvevict/kvevict.hpp"
#include "support/shard_models.hpp"
#include "support/thread_communicator.hpp"

namespace {

using namespace kvevict_bench;

constexpr Index kLayers = 4;
constexpr double kKeep = 0.1;

/// kLayers layers of one shape, tokens-major keys and values [L, Hkv, d], window queries [H, w, d], W_o [D, H d]
/// (the value-aware rows run value_norm l2; each rank forms its heads' Gram matrices per call).
struct ShardStack {
  Index L;
  std::vector<std::unique_ptr<RandomLayer>> tensors;
  std::vector<kvevict::LayerInputs<float>> layers;
  ShardStack(const Model& m, Index context) : L(context) {
    for (Index l = 0; l < kLayers; ++l) {
      std::mt19937 rng(static_cast<std::uint32_t>(7 + l));
      tensors.push_back(std::make_unique<RandomLayer>(m, L, rng));
      layers.push_back(tensors.back()->in);
    }
  }
};

const ShardStack& shard_stack(const Model& m, Index L) {
  static std::unique_ptr<ShardStack> held;
  if (!held || held->L != L) {
    held.reset();
    held = std::make_unique<ShardStack>(m, L);
  }
  return *held;
}

/// What one rank sent and holds in one eviction.
struct Traffic {
  std::uint64_t model = 0, group = 0;
  int rounds = 0;
  Index kept = 0, held = 0;
};

/// Runs evict(p) -> entries kept on every rank of tp x pp (each through CountingCommunicators), timing the slowest
/// rank, and reports the counters (the largest over the ranks).
template <class Evict>
void run_counted(benchmark::State& state, const Model& m, Index L, int tp, int pp, const std::string& what,
                 Evict&& evict) {
  const ShardStack& s = shard_stack(m, L);
  const kvevict_test::Model model{{}, s.layers, m.Hkv, m.H / m.Hkv};
  std::vector<Traffic> traffic(static_cast<std::size_t>(tp * pp));
  for (auto _ : state) {
    std::mutex mutex;
    double slowest = 0;
    kvevict_test::run_split_ranks(tp, pp, [&](kvevict::shard::Communicator& all, kvevict::shard::Communicator& stage) {
      kvevict::shard::CountingCommunicator counted_all(all), counted_stage(stage);
      kvevict_test::RankPart p = kvevict_test::rank_part(model, tp, pp, counted_all, counted_stage);
      Traffic t;
      const double seconds_taken = seconds([&] { t.kept = evict(p); });
      t.model = counted_all.bytes_sent();
      if (tp > 1) {  // a group of one rank sends nothing
        t.group = counted_stage.bytes_sent();
        t.rounds = counted_stage.rounds();
      }
      t.rounds += counted_all.rounds();
      t.held = static_cast<Index>(p.layers.size() * p.shard.kv_heads.size()) * L * m.d * 2;
      std::lock_guard<std::mutex> lock(mutex);
      traffic[static_cast<std::size_t>(all.rank())] = t;
      slowest = std::max(slowest, seconds_taken);
    });
    state.SetIterationTime(slowest);
  }
  Traffic most;
  double per_kept = 0;
  for (const Traffic& t : traffic) {
    most.model = std::max(most.model, t.model);
    most.group = std::max(most.group, t.group);
    most.rounds = std::max(most.rounds, t.rounds);
    most.held = std::max(most.held, t.held);
    per_kept =
        std::max(per_kept, static_cast<double>(t.model + t.group) / static_cast<double>(std::max<Index>(1, t.kept)));
  }
  state.counters["model_KiB"] = static_cast<double>(most.model) / 1024.0;
  state.counters["group_KiB"] = static_cast<double>(most.group) / 1024.0;
  state.counters["rounds"] = most.rounds;
  state.counters["KV_MiB"] = static_cast<double>(most.held) * 4.0 / 1048576.0;
  state.counters["B_per_kept"] = per_kept;
  state.SetLabel(std::string(m.name) + " f32, " + std::to_string(kLayers) + " layers, " + std::to_string(tp * pp) +
                 " ranks" + what);
}

/// Policy::select(its layers, keep 10 %, ModelShard) on every rank.
template <class Policy>
void BM_Shard(benchmark::State& state, const Model& m, Index L, const Policy& policy, int tp, int pp) {
  run_counted(state, m, L, tp, pp, "", [&](const kvevict_test::RankPart& p) {
    Index kept = 0;
    for (const kvevict::Selection& sel : policy.select(p.layers, kvevict::Budget::keep_ratio(kKeep), p.shard))
      kept += sel.total();
    return kept;
  });
}

/// evict_over_budget(policy, book, L / 10, ModelShard, ...) on every rank, its CacheBook holding the L tokens of its
/// layers and heads (one step of the whole prompt): the selection above plus the book's exchange (the due layers).
template <class Policy>
void BM_ShardStream(benchmark::State& state, const Model& m, Index L, const Policy& policy, int tp, int pp) {
  run_counted(state, m, L, tp, pp, ", a CacheBook's step", [&](const kvevict_test::RankPart& p) {
    kvevict::CacheBook book(static_cast<Index>(p.layers.size()), static_cast<Index>(p.shard.kv_heads.size()), L);
    book.append(L);
    Index kept = 0;
    kvevict::evict_over_budget(
        policy, book, static_cast<Index>(static_cast<double>(L) * kKeep), p.shard,
        [&](Index i) { return p.layers[static_cast<std::size_t>(i)]; },
        [&](Index, const kvevict::Selection& sel) { kept += sel.total(); });  // the shared tensors stay as they are
    return kept;
  });
}

void register_shard() {
  const Model m = kLlama8B;
  for (Index L : {Index{4096}, Index{16384}}) {
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
      const std::string name(entry.name);
      if (name != "snapkv" && name != "adakv" && name != "criticalkv" && name != "defensivekv" &&
          name != "layer-defensivekv" && name != "open-defensivekv")
        return;
      kvevict::Knobs knobs;
      const bool value_aware = entry.make().reads_values();
      if (value_aware) knobs.value_norm = kvevict::ValueNorm::l2;
      const auto policy = entry.make(knobs);
      for (const auto& [tp, pp] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
        const std::string row = "BM_shard/" + name + (value_aware ? "-l2-gram" : "") + "/" + std::to_string(tp) + "x" +
                                std::to_string(pp) + "/" + m.name + "/" + std::to_string(L);
        benchmark::RegisterBenchmark(
            row.c_str(), [m, L, policy, tp = tp, pp = pp](benchmark::State& st) { BM_Shard(st, m, L, policy, tp, pp); })
            ->Unit(benchmark::kMillisecond)
            ->UseManualTime()
            ->Iterations(2);
        if (L != 4096 || (tp != 2 || pp != 2)) continue;  // a stream row per policy: TP 2 x PP 2 at 4k
        const std::string stream = "BM_shard_stream/" + row.substr(std::string("BM_shard/").size());
        benchmark::RegisterBenchmark(
            stream.c_str(),
            [m, L, policy, tp = tp, pp = pp](benchmark::State& st) { BM_ShardStream(st, m, L, policy, tp, pp); })
            ->Unit(benchmark::kMillisecond)
            ->UseManualTime()
            ->Iterations(2);
      }
    });
  }
}

[[maybe_unused]] const bool registered = (register_shard(), true);

}  // namespace
