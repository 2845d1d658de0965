// Selection time of each policy on one layer of a real model shape, and its ratio to the floor: the
// window-attention GEMM alone (Q_win[q] K[q/G]^T for every query head), timed in the same process.
//
//   build/release/bench/kvevict_bench --benchmark_counters_tabular=true

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace {

using kvevict::Index;

struct Shape {
  const char* model;
  Index H, Hkv, d;
};
constexpr Shape kLlama8B{"Llama-3.1-8B", 32, 8, 128};
constexpr Index kWindow = 32;

struct Layer {
  std::vector<float> q, k, v;
  kvevict::LayerInputs<float> in;
  Layer(const Shape& s, Index L) {
    std::mt19937 rng(42);
    std::normal_distribution<float> n(0.f, 1.f);
    q.resize(static_cast<std::size_t>(s.H * kWindow * s.d));
    k.resize(static_cast<std::size_t>(s.Hkv * L * s.d));
    v.resize(k.size());
    for (auto* buf : {&q, &k, &v})
      for (float& x : *buf) x = n(rng);
    in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), s.H, kWindow, s.d);
    in.keys = kvevict::kv_tokens_major<const float>(k.data(), L, s.Hkv, s.d);
    in.values = kvevict::kv_tokens_major<const float>(v.data(), L, s.Hkv, s.d);
  }
};

/// The unavoidable part: the window logits GEMM of every query head, in seconds (best of 3).
double floor_seconds(const Layer& layer, const Shape& s) {
  kvevict::RowMatrix<float> logits(kWindow, layer.in.keys.rows());
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (Index q = 0; q < s.H; ++q)
      logits.noalias() = layer.in.queries.head(q) * layer.in.keys.head(q / (s.H / s.Hkv)).transpose();
    benchmark::DoNotOptimize(logits.data());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <class PolicyT>
void BM_Policy_Select(benchmark::State& state) {
  const Shape s = kLlama8B;
  const Index L = state.range(0);
  const double keep = static_cast<double>(state.range(1)) / 100.0;
  const Layer layer(s, L);
  const PolicyT policy;
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    kvevict::Selection sel = policy.select(layer.in, kvevict::Budget::keep_ratio(keep));
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(sel.indices().data());
  }
  const double per_iter = total / static_cast<double>(state.iterations());
  state.counters["x_floor"] = per_iter / floor_seconds(layer, s);
  state.SetLabel(s.model);
}

void Args(benchmark::internal::Benchmark* b) {
  for (Index L : {4096, 16384, 32768})
    for (Index keep : {10, 20}) b->Args({L, keep});
  b->Unit(benchmark::kMillisecond);
}

void BM_WindowAttention_Floor(benchmark::State& state) {
  const Layer layer(kLlama8B, state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(floor_seconds(layer, kLlama8B));
  state.SetLabel("best of 3 inside");
}

}  // namespace

BENCHMARK_TEMPLATE(BM_Policy_Select, kvevict::SnapKV)->Apply(Args);
BENCHMARK_TEMPLATE(BM_Policy_Select, kvevict::AdaKV)->Apply(Args);
BENCHMARK_TEMPLATE(BM_Policy_Select, kvevict::StreamingLLM)->Apply(Args);
BENCHMARK(BM_WindowAttention_Floor)->Arg(32768)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
