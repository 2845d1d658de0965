// shard/mpi.hpp and shard/top_k.hpp under real collectives: run with mpirun at 2 and 4 processes (ctest
// mpi.shard_top_k.np2 / np4; the argument: how many random models, 100 by default). Every rank builds the same seeded
// random models, takes its share of each split (TP x PP for every factorisation of the process count, heads contiguous
// or dealt round-robin), and checks that its counts equal the unsharded top-k's; then that bad shards are refused on
// every rank; then Policy::select over a ModelShard (random models, a stage's group split from the world; every
// catalogue policy, per head and in two layouts) against the one-rank selection; then evict_over_budget on streams
// (chunked prefill, capped decoding) against the one-rank engine after every step. Exit 0 when
// every rank passed (docs/algorithms.md#sharded).
#include <kvevict/kvevict.hpp>
#include <kvevict/shard/mpi.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "support/shard_models.hpp"
#include "support/stream_engine.hpp"

namespace {

using kvevict::Index;
using kvevict::extend::ScoreMap;
using kvevict::shard::ShardMap;
using kvevict_test::shard_sz;

int failures = 0;

void check(bool ok, const std::string& what) {
  if (ok) return;
  if (++failures <= 10) std::fprintf(stderr, "FAILED: %s\n", what.c_str());
}

// One random model split as tp x pp: this rank's counts against allocate_layer_global's.
int compare_splits(kvevict::shard::Communicator& comm, int cases) {
  kvevict_test::ShardRng rng(20261206);
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  int compared = 0;
  for (int c = 0; c < cases; ++c) {
    const Index layers = 1 + pick(rng) % 4, heads = 1 + pick(rng) % 8, tokens = 1 + pick(rng) % 40;
    std::vector<ScoreMap<double>> model;
    for (Index l = 0; l < layers; ++l) model.push_back(kvevict_test::random_map(rng, heads, tokens));
    std::vector<const ScoreMap<double>*> pointers;
    Index available = 0;
    for (const auto& m : model) {
      pointers.push_back(&m);
      for (auto t : m.tier) available += t != kvevict::extend::Tier::absent;
    }
    const Index k = pick(rng) % (available + 1);
    const bool contiguous = pick(rng) % 2 == 0;
    const auto expected = kvevict::extend::allocate_layer_global(pointers, k);
    for (int tp = 1; tp <= comm.size(); ++tp) {
      if (comm.size() % tp != 0) continue;
      const int pp = comm.size() / tp, stage = comm.rank() / tp, part = comm.rank() % tp;
      std::vector<ScoreMap<double>> local;
      std::vector<ShardMap<double>> maps;
      local.reserve(shard_sz(layers));
      for (Index l = 0; l < layers; ++l) {
        if (static_cast<int>(l * pp / layers) != stage) continue;
        std::vector<Index> hs = kvevict_test::part_heads(heads, tp, part, contiguous);
        if (hs.empty()) continue;
        local.push_back(kvevict_test::rows_of(model[shard_sz(l)], hs));
        maps.push_back({&local.back(), l, hs});
      }
      const auto got = kvevict::shard::top_k_counts(comm, maps, k);
      for (std::size_t m = 0; m < maps.size(); ++m)
        for (std::size_t i = 0; i < maps[m].heads.size(); ++i, ++compared)
          check(got[m][i] == expected[shard_sz(maps[m].layer)][shard_sz(maps[m].heads[i])],
                "case " + std::to_string(c) + ", tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + ", rank " +
                    std::to_string(comm.rank()) + ", layer " + std::to_string(maps[m].layer) + ", head " +
                    std::to_string(maps[m].heads[i]));
    }
  }
  return compared;
}

// Policy::select(layers, budget, ModelShard) of random models split as tp x pp (every factorisation with tp <= Hkv):
// this rank's selections against the one-rank selection of the model. A stage's tensor-parallel group is an
// MPI_Comm_split of the world.
template <class P>
int compare_model(kvevict::shard::Communicator& comm, const P& policy, const kvevict_test::Model& m,
                  const kvevict::Budget& budget, const std::string& what) {
  const std::vector<kvevict::Selection> whole = policy.select(m.layers, budget);
  int compared = 0;
  for (int tp = 1; tp <= comm.size() && tp <= m.kv_heads; ++tp) {
    if (comm.size() % tp != 0) continue;
    const int pp = comm.size() / tp;
    if (pp > static_cast<int>(m.layers.size())) continue;
    MPI_Comm stage_comm;
    MPI_Comm_split(MPI_COMM_WORLD, comm.rank() / tp, comm.rank(), &stage_comm);
    {
      kvevict::shard::MpiCommunicator stage(stage_comm);
      const kvevict_test::RankPart p = kvevict_test::rank_part(m, tp, pp, comm, stage);
      const auto [bad, heads] = kvevict_test::mismatches(whole, p, policy.select(p.layers, budget, p.shard));
      compared += heads;
      for (const std::string& b : bad)
        check(false, what + ", tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + ", rank " +
                         std::to_string(comm.rank()) + ": " + b);
    }
    MPI_Comm_free(&stage_comm);
  }
  return compared;
}

// Every catalogue policy, per head and token, and in two layouts (a page table per layer, blocks of 4; one set per
// model), on models of equal-length layers.
int compare_models(kvevict::shard::Communicator& comm, int models) {
  kvevict_test::Rng rng(20261207);
  int compared = 0;
  for (int c = 0; c < models; ++c) {
    const kvevict_test::Model m = kvevict_test::random_model(rng, 2 + c % 3, c % 2 == 0 ? 4 : 2, 1 + c % 2,
                                                             /*dense=*/c % 4 != 3, c % 2 == 1, -1, /*length_step=*/0);
    for (const kvevict::Budget& budget : {kvevict::Budget::keep_ratio(0.3), kvevict::Budget::tokens(12)}) {
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
        const std::string name(entry.name);
        const bool dense = c % 4 != 3;
        if (!dense && name == "tova") return;  // one set per layer needs its heads to hold the same entries
        const std::string what = name + ", model " + std::to_string(c);
        kvevict::Knobs knobs;
        knobs.window = 4;
        compared += compare_model(comm, entry.make(knobs), m, budget, what);
        if (!dense) return;
        knobs.share = kvevict::Sharing::per_layer;
        knobs.block = 4;
        compared += compare_model(comm, entry.make(knobs), m, budget, what + ", per_layer/4");
        knobs.share = kvevict::Sharing::per_model;
        knobs.block = 1;
        compared += compare_model(comm, entry.make(knobs), m, budget, what + ", per_model/1");
      });
    }
  }
  return compared;
}

// evict_over_budget over a ModelShard while the cache grows (chunked prefill, capped decoding): after every step,
// this rank's engine (its stage's layers, its KV heads) holds what the one-rank engine of the model holds. Every
// catalogue policy per head, and a page table per layer (blocks of 4); each factorisation tp x pp of the ranks.
int compare_streams(kvevict::shard::Communicator& comm, int models) {
  kvevict_test::Rng rng(20261210);
  const Index w = 4, T = 56, Hkv = 4;
  int compared = 0;
  for (int c = 0; c < models; ++c) {
    const int G = 1 + c % 2;
    const kvevict_test::Source src = kvevict_test::random_source(rng, 2, Hkv * G, Hkv, 8, T);
    const Index n = 10 + c % 3, kept_whole = c % 3 == 2 ? 0 : -1;
    for (const kvevict_test::Stream& stream : {kvevict_test::chunked(rng, w, T), kvevict_test::capped(w, T)})
      kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
        for (const kvevict::Sharing share : {kvevict::Sharing::per_head, kvevict::Sharing::per_layer}) {
          kvevict::Knobs knobs;
          knobs.window = w;
          knobs.share = share;
          knobs.block = share == kvevict::Sharing::per_head ? 1 : 4;
          const auto policy = entry.make(knobs);
          const kvevict_test::History whole = kvevict_test::one_rank(policy, src, stream, w, n, kept_whole);
          for (int tp = 1; tp <= comm.size() && tp <= Hkv; ++tp) {
            if (comm.size() % tp != 0) continue;
            const int pp = comm.size() / tp, stage_id = comm.rank() / tp;
            if (pp > src.NL) continue;
            MPI_Comm stage_comm;
            MPI_Comm_split(MPI_COMM_WORLD, stage_id, comm.rank(), &stage_comm);
            {
              kvevict::shard::MpiCommunicator stage(stage_comm);
              const Index heads = Hkv / tp, h0 = (comm.rank() % tp) * heads;
              kvevict::shard::ModelShard shard{&comm, &stage, {}, {}};
              for (Index l = src.NL * stage_id / pp; l < src.NL * (stage_id + 1) / pp; ++l) shard.layers.push_back(l);
              for (Index h = h0; h < h0 + heads; ++h) shard.kv_heads.push_back(h);
              kvevict_test::Engine mine(src, T, w, h0, heads, shard.layers, true, kept_whole);
              bool same = true;
              for (std::size_t t = 0; t < stream.steps.size(); ++t) {
                mine.step(stream.steps[t]);
                mine.evict(policy, n, shard);
                for (std::size_t i = 0; i < shard.layers.size(); ++i)
                  for (Index j = 0; j < heads; ++j, ++compared)
                    same = same &&
                           mine.held(static_cast<Index>(i), j) == whole[t][shard_sz(shard.layers[i])][shard_sz(h0 + j)];
              }
              check(same, std::string(entry.name) + " " + kvevict::to_string(share) + ", stream model " +
                              std::to_string(c) + " " + stream.name + ", tp " + std::to_string(tp) + " x pp " +
                              std::to_string(pp) + ", rank " + std::to_string(comm.rank()));
            }
            MPI_Comm_free(&stage_comm);
          }
        }
      });
  }
  return compared;
}

// A KV head held by two ranks is refused on every rank, by name, and nobody hangs.
void refuse_duplicates(kvevict::shard::Communicator& comm) {
  kvevict_test::ShardRng rng(11);
  const ScoreMap<double> layer = kvevict_test::random_map(rng, 4, 16);
  std::vector<Index> hs = kvevict_test::part_heads(4, comm.size(), comm.rank(), true);
  if (comm.rank() == comm.size() - 1) hs = {0};  // the last rank claims head 0 too (its own heads: missing)
  const ScoreMap<double> local = kvevict_test::rows_of(layer, hs);
  std::string message;
  try {
    (void)kvevict::shard::top_k_counts<double>(comm, {{&local, 0, hs}}, 2);
  } catch (const kvevict::invalid_argument& e) {
    message = e.what();
  }
  const std::string want = "layer 0, KV head 0 is held twice (again by rank " + std::to_string(comm.size() - 1) + ")";
  check(message.find(want) != std::string::npos, "rank " + std::to_string(comm.rank()) + " got '" + message + "'");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int total_failures = 0;
  {
    kvevict::shard::MpiCommunicator comm;
    const int compared = compare_splits(comm, argc > 1 ? std::stoi(argv[1]) : 100);
    // Oversubscribed ranks poll: the argument (100 cases at 2 ranks, 25 at 4) also sets how many models.
    const int selected = compare_models(comm, argc > 1 ? std::max(1, std::stoi(argv[1]) / 25) : 4);
    const int streamed = compare_streams(comm, argc > 1 ? std::max(1, std::stoi(argv[1]) / 50) : 2);
    refuse_duplicates(comm);
    MPI_Allreduce(&failures, &total_failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (comm.rank() == 0)
      std::printf(
          "test_shard_mpi: %d ranks, %d counts, %d heads' selections and %d heads' streamed steps compared on rank 0, "
          "%d failures on all ranks\n",
          comm.size(), compared, selected, streamed, total_failures);
  }
  MPI_Finalize();
  return total_failures == 0 ? 0 : 1;
}
