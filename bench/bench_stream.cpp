// Eviction while the cache grows (docs/algorithms.md#streaming): one Llama-3.1-8B layer streams a 32k prompt in steps
// of C tokens under a 10 % budget (n = 3276 tokens per KV head), evicting with kvevict::evict_over_budget after every
// step that leaves it over the budget. Every catalogue policy (value-aware ones in the L2 Gram form with the Gram
// precomputed, as an engine does at load). Counters, all measured in the same process:
//   evictions   how many steps ended with an eviction
//   x_oneshot   total eviction time of the stream (selection and compaction) / one select over the whole 32k
//               prompt (dense)
//   x_floor     total selection time / the sum over evictions of the window-attention GEMM over the entries each
//               eviction saw (Q_win[q] K_h^T for every query head, each head's own length); target <= 1.5
//   x_floors    (value-aware) the same against window + Gram-form value GEMMs
//   compact_share  the share of the eviction time spent compacting K, V and positions in place (LayerBook::apply:
//               a memory move of up to Hkv * n rows, the engine's cost of a contiguous per-head cache)
//   extra_MiB   the heap's peak above its level during one eviction (the worst eviction of the stream)
//   x_step_mem  extra_MiB / the K and V bytes of the budget plus one step (Hkv * (n + C) * d * 2 floats): the
//               extra memory stays O(budget + step)
//
//   build/release/bench/kvevict_bench --benchmark_filter='BM_stream/' --benchmark_counters_tabular=true
//
// Names: BM_stream/<row>/<model>/<prompt>/<C>.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common.hpp"
#include "heap_tracker.hpp"
#include "kvevict/kvevict.hpp"

namespace {

using namespace kvevict_bench;

constexpr Index kPrompt = 32768;
constexpr double kKeep = 0.1;

/// The stream's "forward pass", fixed in advance: keys and values of every position [T, Hkv, d] (tokens-major, as
/// they come out of a K/V projection).
struct Source {
  Model m;
  std::vector<float> k, v;
  explicit Source(const Model& model) : m(model) {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.f, 1.f);
    k.resize(static_cast<std::size_t>(kPrompt * m.Hkv * m.d));
    v.resize(k.size());
    for (float& x : k) x = n(rng);
    for (float& x : v) x = n(rng);
  }
  const float* key(Index t, Index h) const { return &k[static_cast<std::size_t>((t * m.Hkv + h) * m.d)]; }
  const float* value(Index t, Index h) const { return &v[static_cast<std::size_t>((t * m.Hkv + h) * m.d)]; }
};

const Source& source(const Model& m) {
  static const Source s(m);
  return s;
}

/// The floors of one eviction, over the entries each head holds: window GEMM and Gram-form value GEMM.
Floors ragged_floors(const kvevict::LayerInputs<float>& in, const kvevict::LayerBook& book) {
  const Index H = in.queries.heads(), G = H / book.kv_heads(), d = in.keys.cols();
  kvevict::RowMatrix<float> logits, projected;
  const kvevict::RowMatrix<float> gram = kvevict::RowMatrix<float>::Random(d, d);
  Floors out;
  out.window = best_of_3([&] {
    for (Index q = 0; q < H; ++q)
      logits.noalias() = in.queries.head(q) * in.keys.head(q / G).topRows(book.length(q / G)).transpose();
    benchmark::DoNotOptimize(logits.data());
  });
  out.gram = best_of_3([&] {
    for (Index q = 0; q < H; ++q) projected.noalias() = in.values.head(q / G).topRows(book.length(q / G)) * gram;
    benchmark::DoNotOptimize(projected.data());
  });
  return out;
}

template <class Policy>
void BM_Stream(benchmark::State& state, const Model& m, const Policy& policy) {
  const Index chunk = state.range(0), w = kWindow;
  const auto n = static_cast<Index>(kvevict::Budget::keep_ratio(kKeep).n_kept(kPrompt));
  const Source& src = source(m);
  // The engine's cache, heads-major [Hkv, capacity, d], and its per-step window queries [H, w, d].
  const Index capacity = kPrompt;
  std::vector<float> keys(static_cast<std::size_t>(m.Hkv * capacity * m.d)), values(keys.size());
  std::vector<float> queries(static_cast<std::size_t>(m.H * w * m.d)), w_o(static_cast<std::size_t>(m.D * m.H * m.d));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& x : w_o) x = 0.02f * normal(rng);
  kvevict::LayerInputs<float> in;
  in.queries = kvevict::HeadsView<const float>::heads_major(queries.data(), m.H, w, m.d);
  in.keys = kvevict::kv_heads_major<const float>(keys.data(), m.Hkv, capacity, m.d);
  in.values = kvevict::kv_heads_major<const float>(values.data(), m.Hkv, capacity, m.d);
  in.w_o = kvevict::output_projection<const float>(w_o.data(), m.D, m.H, m.d);
  const auto gram = kvevict::OutputGram<float>::compute(in.w_o);  // once per layer, at model load
  in.w_o_gram = &gram;

  double total = 0, compaction = 0, floor_window = 0, floor_both = 0, extra_bytes = 0;
  Index evictions = 0;
  for (auto _ : state) {
    kvevict::CacheBook book(1, m.Hkv, capacity);
    for (Index at = 0; at < kPrompt; at += chunk) {
      // The step's forward pass (not timed): append its keys and values, draw its last w queries.
      const Index c = std::min(chunk, kPrompt - at);
      book.append(c);
      for (Index h = 0; h < m.Hkv; ++h)
        for (Index i = 0; i < c; ++i) {
          const Index row = book.layer(0).length(h) - c + i;
          std::copy(src.key(at + i, h), src.key(at + i, h) + m.d,
                    &keys[static_cast<std::size_t>((h * capacity + row) * m.d)]);
          std::copy(src.value(at + i, h), src.value(at + i, h) + m.d,
                    &values[static_cast<std::size_t>((h * capacity + row) * m.d)]);
        }
      for (float& x : queries) x = normal(rng);
      const bool due = kvevict::budget_scope<Policy>() == kvevict::BudgetScope::model ? book.over_budget(n)
                                                                                      : book.layer(0).over_budget(n);
      if (due) {
        const Floors f = ragged_floors(book.layer(0).describe(in), book.layer(0));
        floor_window += f.window;
        floor_both += f.window + f.gram;
      }
      const auto level = heap::mark();
      total += seconds([&] {
        evictions += kvevict::evict_over_budget(
            policy, book, n, [&](Index) { return observed_by(policy, in); },
            [&](Index, const kvevict::Selection& s) {
              compaction += seconds([&] {
                book.layer(0).apply(s, kvevict::kv_heads_major<float>(keys.data(), m.Hkv, capacity, m.d),
                                    kvevict::kv_heads_major<float>(values.data(), m.Hkv, capacity, m.d));
              });
            });
      });
      extra_bytes = std::max(extra_bytes, static_cast<double>(heap::peak_since(level)));
    }
  }
  const auto iterations = static_cast<double>(state.iterations());
  // One select over the whole prompt, dense, the same keys and values (tokens-major views over the source).
  kvevict::LayerInputs<float> whole = in;
  whole.keys = kvevict::kv_tokens_major<const float>(src.k.data(), kPrompt, m.Hkv, m.d);
  whole.values = kvevict::kv_tokens_major<const float>(src.v.data(), kPrompt, m.Hkv, m.d);
  const double oneshot = best_of_3(
      [&] { benchmark::DoNotOptimize(select_one(policy, whole, kvevict::Budget::tokens(n)).indices().data()); });
  state.counters["evictions"] = static_cast<double>(evictions) / iterations;
  state.counters["x_oneshot"] = total / iterations / oneshot;
  state.counters["x_floor"] = (total - compaction) / floor_window;
  if (policy.reads_values()) state.counters["x_floors"] = (total - compaction) / floor_both;
  state.counters["compact_share"] = compaction / total;
  state.counters["extra_MiB"] = extra_bytes / 1048576.0;
  state.counters["x_step_mem"] = extra_bytes / (static_cast<double>(m.Hkv * (n + chunk) * m.d) * 2.0 * sizeof(float));
  state.SetLabel(std::string(m.name) + " f32, n " + std::to_string(n));
}

void register_stream() {
  const kvevict::Knobs l2 = with_value_norm(kvevict::ValueNorm::l2);
  const Model m = kLlama8B;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
    // The engine-score policies rank scores this synthetic engine does not compute (their selection time:
    // bench_policies's engine-scores rows).
    if constexpr (!std::decay_t<decltype(entry)>::policy_type::reads_scores()) {
      const bool value_aware = entry.make().reads_values();
      const std::string row = std::string(entry.name) + (value_aware ? "-l2-gram" : "");
      const auto policy = entry.make(value_aware ? l2 : kvevict::Knobs{});
      benchmark::RegisterBenchmark(("BM_stream/" + row + "/" + m.name + "/" + std::to_string(kPrompt)).c_str(),
                                   [m, policy](benchmark::State& s) { BM_Stream(s, m, policy); })
          ->Arg(256)
          ->Arg(1024)
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  });
}

[[maybe_unused]] const bool registered = (register_stream(), true);

}  // namespace
