// The pruned L1 value term on a real model's layers (docs/algorithms.md section 2.4.1): models/tinycode prefilled on
// 8 of its evaluation documents (2,048 tokens each), then CriticalKV (L1 term) on all 10 layers of each, with pruning
// and without, interleaved in one process:
//   computed          fraction of the scored entries whose L1 term was computed
//   x_unpruned        the unpruned selections' time / the pruned ones' (best of the iterations each)
//   same_as_unpruned  1 when every layer keeps the same tokens
//
//   build/release/bench/kvevict_bench --benchmark_filter=BM_PrunedL1 --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "common.hpp"
#include "engine.hpp"
#include "eval.hpp"
#include "model.hpp"

namespace {

using kvevict_bench::seconds;

const std::filesystem::path kModelDir = KVEVICT_SOURCE_DIR "/models/tinycode";  // the vendored model

/// The prefilled engines, made once per process.
const std::vector<tinycode::Engine>& prefilled() {
  static const tinycode::Model model = tinycode::Model::load(kModelDir);
  static const std::vector<tinycode::Engine> engines = [] {
    const auto docs = tinycode::eval::load_docs(kModelDir / "eval" / "docs.bin");
    std::vector<tinycode::Engine> out;
    for (std::size_t d = 0; d < 8 && d < docs.size(); ++d) {
      out.emplace_back(model);
      const std::size_t n = std::min<std::size_t>(2048, docs[d].size());
      out.back().extend(tinycode::eval::Tokens(docs[d].begin(), docs[d].begin() + static_cast<std::ptrdiff_t>(n)));
    }
    return out;
  }();
  return engines;
}

void BM_PrunedL1(benchmark::State& state) {
  const auto budget = kvevict::Budget::keep_ratio(static_cast<double>(state.range(0)) / 100.0);
  const auto& engines = prefilled();
  kvevict::extend::ValueTermCounter counter;  // counts the pruned policy's work (the unpruned one has none)
  const kvevict::extend::ValueTermCounter::Scope counting(counter);
  kvevict::CriticalKV::Params p;
  const kvevict::CriticalKV pruned(p);
  p.prune = false;
  const kvevict::CriticalKV full(p);
  std::vector<kvevict::Selection> a, b;
  const auto run = [&](const kvevict::CriticalKV& policy, std::vector<kvevict::Selection>& out) {
    out.clear();
    for (const auto& e : engines)
      for (const auto& in : e.eviction_inputs()) out.push_back(policy.select(in, budget));
  };
  double t_pruned = 1e30, t_full = 1e30;
  for (auto _ : state) {
    t_pruned = std::min(t_pruned, seconds([&] { run(pruned, a); }));
    t_full = std::min(t_full, seconds([&] { run(full, b); }));
  }
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i)
    same = a[i].indices() == b[i].indices() && a[i].offsets() == b[i].offsets();
  state.counters["computed"] = counter.fraction();
  state.counters["x_unpruned"] = t_full / t_pruned;
  state.counters["same_as_unpruned"] = same;
  state.counters["layers"] = static_cast<double>(a.size());
  state.SetLabel("tinycode, 8 docs x 2048 tokens, CriticalKV L1");
}

BENCHMARK(BM_PrunedL1)->Arg(5)->Arg(10)->Arg(20)->Iterations(5)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
