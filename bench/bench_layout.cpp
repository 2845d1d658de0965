// Selection time in the engine layouts of docs/algorithms.md#layouts (LayoutParams: `share`, `block`; `reduce`
// stays max): every catalogue policy selects one whole model of kLayers Llama-3.1-8B layers (distinct random
// tensors, f32, keep 10 %) through kvevict::select_layers, as an engine does (per_model needs every layer at once;
// every row selects the same kLayers layers so that the ratios compare), in five layouts:
//   per_head/1    the papers' per-head token selection (the defaults; the x_tokens baseline)
//   per_layer/1   one kept set per layer for all its KV heads
//   per_head/16   each KV head keeps or evicts whole blocks of B = 16 rows (pages)
//   per_layer/16  pages holding every KV head of a token (vLLM, TensorRT-LLM)
//   per_model/16  one set for every head of every layer, in blocks (llama.cpp's cells, paged)
//   per_layer/16/prefix  pages as per_layer/16, with a shared prompt prefix of L / 16 positions protected and kept on
//                 top of the budget (docs/algorithms.md#protected-prefix; x_tokens: against per_head/1 without it)
//   per_head/1/threshold  a threshold budget (docs/algorithms.md#threshold-budgets): tau 0, at most n_kept per head
//                 (attention-based scores are nonnegative: all pass and the cap binds, the count of per_head/1, so
//                 x_tokens is the cost of counting the passing entries in place of the allocation; KNorm's and
//                 KeyDiff's scores can be negative, so they keep fewer)
//   per_head/1/hybrid  a hybrid model (docs/algorithms.md#hybrid-models): layer 0 kept whole (LayerInputs::evict
//                 false, a sliding-window or full layer the engine keeps), the budget over the other kLayers - 1
//                 (x_tokens against per_head/1 on all kLayers: about (kLayers - 1) / kLayers when a whole layer
//                 costs nothing; kept counts the evicted layers)
// Value-aware policies run in the engine's form, "<name>-l2-gram" (value_norm = l2, the Gram matrices precomputed
// once per layer, LayerInputs::w_o_gram). Counters, measured in the same process:
//   x_floor    time / (kLayers * the window-attention GEMM of one layer): the floor of bench_policies.cpp
//              (measure_floors, Q_win[q] K[q/G]^T for every query head), once per context
//   x_floors   (value-aware) time / (kLayers * (window-attention + Gram-form value GEMMs))
//   x_tokens   time / the same policy's time in per_head/1 on the same layers, timed alternately in every iteration
//              (the cost of the layout itself; 1 in the per_head/1 rows)
//   kept       kept entries of the model / its budget (kLayers * Hkv * n_kept): whole blocks and shared sets keep
//              at most the budget
//   extra_MiB  the heap's peak during one select_layers above its level before (the Selections included)
// The Time column is one select_layers over the kLayers layers (manual time; the CPU column also counts the
// interleaved per_head/1 runs). About 2 min for the whole family (most of it the value-aware rows at 32k); the
// 4096 rows alone, a smoke run, take about 15 s.
//
//   build/release/bench/kvevict_bench --benchmark_filter='BM_layout/' --benchmark_counters_tabular=true
//   build/release/bench/kvevict_bench --benchmark_filter='BM_layout/.*/4096/' (the short context alone)
//
// Names: BM_layout/<row>/<share>/<block>/<model>/<L>. One model of kLayers layers is held at a time (about 1.3 GB
// at 32k), made on the first row of its context.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
#include "heap_tracker.hpp"
#include "kvevict/kvevict.hpp"

namespace {

using namespace kvevict_bench;

constexpr Index kLayers = 4;
constexpr double kKeep = 0.1;

/// One model of kLayers layers of the same shape, each its own random tensors (window queries [H, w, d], keys and
/// values tokens-major [L, Hkv, d], W_o [D, H d], the engine's scores [Hkv, L]) and its precomputed Gram matrices,
/// with the floors of one layer.
struct Stack {
  Model m;
  Index L;
  std::vector<std::unique_ptr<RandomLayer>> tensors;
  std::vector<kvevict::OutputGram<float>> grams;
  std::vector<kvevict::LayerInputs<float>> plain, with_gram;
  Floors floors;

  Stack(const Model& model, Index context) : m(model), L(context) {
    const auto n = static_cast<std::size_t>(kLayers);
    grams.resize(n);
    for (std::size_t l = 0; l < n; ++l) {
      std::mt19937 rng(static_cast<std::uint32_t>(42 + l));
      tensors.push_back(std::make_unique<RandomLayer>(m, L, rng));
      kvevict::LayerInputs<float> in = tensors.back()->in;
      grams[l] = kvevict::OutputGram<float>::compute(in.w_o);  // once per layer, at model load
      plain.push_back(in);
      in.w_o_gram = &grams[l];
      with_gram.push_back(in);
    }
    floors = measure_floors(m, L);
  }
};

/// The model at this context: made on first use, replaced when a row asks for another context (rows are
/// registered context by context, so each is made once).
const Stack& stack(const Model& m, Index L) {
  static std::unique_ptr<Stack> held;
  if (!held || held->L != L || std::string_view(held->m.name) != m.name) {
    held.reset();
    held = std::make_unique<Stack>(m, L);
  }
  return *held;
}

/// What a row changes beyond the layout: the budget, or which layers are evicted.
enum class Variant { plain, prefix, threshold, hybrid };

template <class Policy>
void BM_Layout(benchmark::State& state, const Model& m, Index L, const Policy& policy, const Policy& tokens,
               bool baseline, Variant variant) {
  const Stack& s = stack(m, L);
  const std::vector<kvevict::LayerInputs<float>> all =
      observed_by(policy, policy.reads_values() ? s.with_gram : s.plain);
  std::vector<kvevict::LayerInputs<float>> layers = all;
  if (variant == Variant::hybrid) layers[0].evict = false;
  const Index evicted = variant == Variant::hybrid ? kLayers - 1 : kLayers;
  const auto plain = kvevict::Budget::keep_ratio(kKeep);
  const auto budget = variant == Variant::prefix ? plain.protect_prefix(L / 16, kvevict::Budget::PrefixBudget::extra)
                      : variant == Variant::threshold ? kvevict::Budget::threshold(0.0).count_bounds(
                                                            0, plain.n_kept(L), kvevict::Budget::Scope::head)
                                                      : plain;
  const auto n_kept = static_cast<Index>(budget.n_kept(L));
  double total = 0, total_tokens = 0, extra_bytes = 0;
  Index kept = 0;
  for (auto _ : state) {
    const auto level = heap::mark();
    const double t = seconds([&] {
      const std::vector<kvevict::Selection> sels = kvevict::select_layers(policy, layers, budget);
      kept = 0;
      for (std::size_t l = 0; l < sels.size(); ++l)
        if (layers[l].evict) kept += sels[l].total();
      benchmark::DoNotOptimize(sels.data());
    });
    extra_bytes = std::max(extra_bytes, static_cast<double>(heap::peak_since(level)));
    state.SetIterationTime(t);
    total += t;
    if (!baseline)
      total_tokens += seconds([&] { benchmark::DoNotOptimize(kvevict::select_layers(tokens, all, plain).data()); });
  }
  const double per_iter = total / static_cast<double>(state.iterations());
  state.counters["x_floor"] = per_iter / (static_cast<double>(kLayers) * s.floors.window);
  if (policy.reads_values())
    state.counters["x_floors"] = per_iter / (static_cast<double>(kLayers) * (s.floors.window + s.floors.gram));
  state.counters["x_tokens"] = baseline ? 1.0 : total / total_tokens;
  state.counters["kept"] = static_cast<double>(kept) / static_cast<double>(evicted * m.Hkv * n_kept);
  state.counters["extra_MiB"] = extra_bytes / 1048576.0;
  state.SetLabel(std::string(m.name) + " f32, " + std::to_string(kLayers) + " layers, n " + std::to_string(n_kept));
}

struct Layout {
  kvevict::Sharing share;
  Index block;
  Variant variant = Variant::plain;
  const char* suffix = "/";  // the name's part after <block>
};
constexpr Layout kLayouts[] = {{kvevict::Sharing::per_head, 1},
                               {kvevict::Sharing::per_layer, 1},
                               {kvevict::Sharing::per_head, 16},
                               {kvevict::Sharing::per_layer, 16},
                               {kvevict::Sharing::per_model, 16},
                               {kvevict::Sharing::per_layer, 16, Variant::prefix, "/prefix/"},
                               {kvevict::Sharing::per_head, 1, Variant::threshold, "/threshold/"},
                               {kvevict::Sharing::per_head, 1, Variant::hybrid, "/hybrid/"}};

void register_layout() {
  const Model m = kLlama8B;
  for (Index L : {Index{32768}, Index{4096}}) {
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
      const bool value_aware = entry.make().reads_values();
      const std::string row = std::string(entry.name) + (value_aware ? "-l2-gram" : "");
      kvevict::Knobs knobs;
      if (value_aware) knobs.value_norm = kvevict::ValueNorm::l2;
      const auto tokens = entry.make(knobs);
      for (const Layout& layout : kLayouts) {
        kvevict::Knobs k = knobs;
        k.share = layout.share;
        k.block = layout.block;
        const bool baseline =
            layout.share == kvevict::Sharing::per_head && layout.block == 1 && layout.variant == Variant::plain;
        if (layout.variant == Variant::threshold && entry.name == std::string_view("pyramidkv"))
          continue;  // a scheduled count: refused
        const std::string name = "BM_layout/" + row + "/" + kvevict::to_string(layout.share) + "/" +
                                 std::to_string(layout.block) + layout.suffix + m.name + "/" + std::to_string(L);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [m, L, policy = entry.make(k), tokens, baseline, layout](benchmark::State& s) {
                                       BM_Layout(s, m, L, policy, tokens, baseline, layout.variant);
                                     })
            ->Unit(benchmark::kMillisecond)
            ->UseManualTime();
      }
    });
  }
}

[[maybe_unused]] const bool registered = (register_layout(), true);

}  // namespace
