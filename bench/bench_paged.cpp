// Selection through a page table (docs/algorithms.md#paged) against the same layer stored contiguously, in one run:
//   x_contiguous  time through the pages / time on the contiguous [L, Hkv, d] cache (best of 3 each, this process)
//   same          1 when both keep the same tokens (they must: the tests compare them bit for bit)
// The pages are vLLM's [page_rows, Hkv, d] (16 tokens) and SGLang's token slots (1), drawn at random from a pool
// twice the request's size.
//
//   build/release/bench/kvevict_bench --benchmark_filter='BM_paged/' --benchmark_counters_tabular=true
//
// Names: BM_paged/<row>/<page_rows>/<model>/<L>: rows snapkv (the window attention alone) and defensivekv-l2 (with
// the value term), keep 10 %.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common.hpp"

namespace {

using kvevict::Index;
using namespace kvevict_bench;

/// A tokens-major [L, Hkv, d] tensor copied into a pool of 2 * ceil(L / page_rows) pages through a random table.
struct Pages {
  std::vector<std::int32_t> table;
  std::vector<float> pool;
  kvevict::KVView<const float> view;
  Pages(const std::vector<float>& tokens_major, Index L, Index Hkv, Index d, Index page_rows) {
    const Index used = (L + page_rows - 1) / page_rows, pool_pages = 2 * used;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(pool_pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
    table.assign(ids.begin(), ids.begin() + used);
    pool.assign(static_cast<std::size_t>(pool_pages * page_rows * Hkv * d), 0.0f);
    const auto writable =
        kvevict::kv_paged_tokens_major<float>(pool.data(), pool_pages, table.data(), L, page_rows, Hkv, d);
    for (Index j = 0; j < L; ++j)
      for (Index h = 0; h < Hkv; ++h) std::copy_n(tokens_major.begin() + (j * Hkv + h) * d, d, writable.row(h, j));
    view = writable;
  }
};

template <class Policy>
void BM_Paged(benchmark::State& state, const Model& m, const Policy& policy, Index page_rows) {
  const Index L = state.range(0);
  const auto budget = kvevict::Budget::keep_ratio(0.1);
  Layer<float> layer(m, L);
  const Pages keys(layer.k, L, m.Hkv, m.d, page_rows), values(layer.v, L, m.Hkv, m.d, page_rows);
  kvevict::LayerInputs<float> paged = layer.in;
  paged.keys = keys.view;
  paged.values = values.view;
  double total = 0;
  kvevict::Selection through_pages;
  for (auto _ : state) total += seconds([&] { through_pages = select_one(policy, paged, budget); });
  const double contiguous = best_of_3([&] { benchmark::DoNotOptimize(select_one(policy, layer.in, budget)); });
  const double paged_best = best_of_3([&] { benchmark::DoNotOptimize(select_one(policy, paged, budget)); });
  const kvevict::Selection flat = select_one(policy, layer.in, budget);
  state.counters["x_contiguous"] = paged_best / contiguous;
  state.counters["same"] = flat.indices() == through_pages.indices() && flat.offsets() == through_pages.offsets();
  state.SetLabel(std::string(m.name) + " f32, pages of " + std::to_string(page_rows));
  benchmark::DoNotOptimize(total);
}

void register_paged() {
  for (const Index page_rows : {Index{16}, Index{1}}) {
    kvevict::catalogue::visit("snapkv", [&](const auto& entry) {
      benchmark::RegisterBenchmark(
          ("BM_paged/snapkv/" + std::to_string(page_rows) + "/" + kLlama8B.name).c_str(),
          [p = entry.make(), page_rows](benchmark::State& s) { BM_Paged(s, kLlama8B, p, page_rows); })
          ->Arg(4096)
          ->Arg(32768)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    });
    kvevict::catalogue::visit("defensivekv", [&](const auto& entry) {
      benchmark::RegisterBenchmark(
          ("BM_paged/defensivekv-l2/" + std::to_string(page_rows) + "/" + kLlama8B.name).c_str(),
          [p = entry.make(with_value_norm(kvevict::ValueNorm::l2)), page_rows](benchmark::State& s) {
            BM_Paged(s, kLlama8B, p, page_rows);
          })
          ->Arg(4096)
          ->Arg(32768)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    });
  }
}

[[maybe_unused]] const bool registered = (register_paged(), true);

}  // namespace
