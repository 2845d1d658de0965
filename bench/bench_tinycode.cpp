// The pruned L1 value term on a real model's layers (docs/algorithms.md#pruned-l1): models/tinycode prefilled on
// 8 of its evaluation documents (2,048 tokens each), then CriticalKV (L1 term) on all 10 layers of each, with pruning
// and without, interleaved in one process; BM_PrunedL1LayerGlobal the same under one budget across layers
// (Policy<LayerDefensiveKV, CriticalSelector>: the run loop refines the bounds after the model-wide allocation):
//   computed          fraction of the scored entries whose L1 term was computed
//   x_unpruned        the unpruned selections' time / the pruned ones' (best of the iterations each)
//   same_as_unpruned  1 when every layer keeps the same tokens
//
//   build/release/bench/kvevict_bench --benchmark_filter=BM_PrunedL1 --benchmark_counters_tabular=true
// (BM_PrunedL1 matches both)

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

/// Times `P` (a CriticalSelector policy, L1 term) with and without pruning on every engine's layers: each layer
/// alone, or (model_wide) every layer of an engine under one budget across layers.
template <class P>
void pruned_vs_unpruned(benchmark::State& state, bool model_wide, const char* label) {
  const auto budget = kvevict::Budget::keep_ratio(static_cast<double>(state.range(0)) / 100.0);
  const auto& engines = prefilled();
  kvevict::extend::ValueTermCounter counter;  // counts the pruned policy's work (the unpruned one has none)
  const kvevict::extend::ValueTermCounter::Scope counting(counter);
  typename P::Params p;
  p.value_norm = kvevict::ValueNorm::l1;
  const P pruned(p);
  p.prune = false;
  const P full(p);
  std::vector<kvevict::Selection> a, b;
  const auto run = [&](const P& policy, std::vector<kvevict::Selection>& out) {
    out.clear();
    for (const auto& e : engines) {
      if (model_wide) {
        for (auto& s : policy.select(e.eviction_inputs(), budget)) out.push_back(std::move(s));
      } else {
        for (const auto& in : e.eviction_inputs()) out.push_back(policy.select(in, budget));
      }
    }
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
  state.SetLabel(label);
}

void BM_PrunedL1(benchmark::State& state) {
  pruned_vs_unpruned<kvevict::CriticalKV>(state, false, "tinycode, 8 docs x 2048 tokens, CriticalKV L1");
}
/// The same under one budget across layers: CriticalKV's selector on Layer-DefensiveKV's allocation.
void BM_PrunedL1LayerGlobal(benchmark::State& state) {
  pruned_vs_unpruned<kvevict::Policy<kvevict::LayerDefensiveKV, kvevict::CriticalSelector>>(
      state, true, "tinycode, 8 docs x 2048 tokens, Policy<LayerDefensiveKV, CriticalSelector> L1");
}

BENCHMARK(BM_PrunedL1)->Arg(5)->Arg(10)->Arg(20)->Iterations(5)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PrunedL1LayerGlobal)
    ->Arg(5)
    ->Arg(10)
    ->Arg(20)
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
