// Selection time of every catalogue policy (kvevict::catalogue::entries()) on one layer of real model shapes, with
// the baselines measured in the same process:
//   x_floor    time / the window-attention GEMM alone (Q_win[q] K[q/G]^T for every query head)
//   x_floors   (value-aware policies) time / (window-attention GEMM + the Gram-form value GEMM, V_h G_q for every
//              query head): the sum of the two GEMM floors (the target is <= 1.5)
//   x_naive    (at 32k tokens, policies with a naive implementation in bench/naive.hpp) the naive implementation's
//              time / time (the spec stage by stage, materialised, full sorts); agree = fraction of the naive's kept
//              tokens that the library keeps too
//   extra_MiB  heap peak of one select above the level before it (naive_MiB: the same for the naive)
// and, for single stages, the value term's throughput against a plain Eigen GEMM of the same FLOPs
// (gemm_efficiency) and the mass forcing against the full sort it replaced (x_full_sort).
//
//   build/release/bench/kvevict_bench --benchmark_counters_tabular=true
//   build/release/bench/kvevict_bench --benchmark_filter='Llama.*/4096/' (one context)
//
// Names: BM_<row>/<storage>/<model>/<L>/<keep %>, one row per catalogue entry: "<name>" for the attention-only
// policies; for the value-aware ones (entry.make().reads_values()) "<name>-l2" (value_norm = l2), "<name>-l2-gram"
// (the same with the Gram matrices precomputed once per layer, LayerInputs::w_o_gram, as an engine does at model
// load) and "<name>-l1" (the papers' value term, up to 32k). Storage f32 for every row, plus f16 (Eigen::half) and
// bf16 for snapkv and adakv and bf16 for defensivekv-l2: keys, values, window queries and W_o in that type,
// arithmetic in float; and quantized caches (i8: int8 with per-head-token scales, e4m3 with a tensor scale, e5m2)
// for snapkv, adakv and defensivekv-l2 (not e5m2), queries and W_o in float. Those rows also report x_floor_f32
// (and x_floors_f32): the same ratio to the f32 floors. The "-l1" rows of CriticalSelector policies prune the value
// term (the default): computed = fraction of the scored entries whose term was computed, x_unpruned = the unpruned
// path's time / time and same_as_unpruned = 1 when it keeps the same tokens (both measured in this run); the
// "layer+critical-l1" rows do the same under one budget across layers (the composition Policy<LayerDefensiveKV,
// CriticalSelector>).
// "h2o-carried" is H2O selecting from received attention an engine carries (LayerInputs::accumulated); "rkv" (key
// redundancy, O(L^2 d) per head) runs up to 16k;
// "engine-scores" and "layer-engine-scores" select from scores the engine computed (LayerInputs::scores);
// "<name>-l2-gram-retrieval" names KV head 0 a retrieval head (LayerInputs::retrieval_heads): its cost is the ratio to
// the "<name>-l2-gram" row.
// Built with KVEVICT_OPENMP, the library (and Eigen's floor GEMMs) run on OpenMP threads, and x_threads = one
// thread's time / time.

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(KVEVICT_OPENMP)
#include <omp.h>
#endif

#include "common.hpp"
#include "heap_tracker.hpp"
#include "kvevict/extend.hpp"
#include "naive.hpp"

namespace {

using kvevict::Index;
using namespace kvevict_bench;
using kvevict_ref::Kept;
using clock_type = std::chrono::steady_clock;

/// x_naive is measured at this context only (the target is >= 5x at 32k; the naive L1 value term takes ~15 s per
/// layer there).
constexpr Index kNaiveContext = 32768;

/// Window attention rows [H, w, L] "like real heads" (as BM_MassForcing's peaked rows): each KV group ranks its
/// tokens in a random order and token of rank r gets (r + 1)^-1.5 times a per-row factor in [0.5, 1.5), causal in
/// the window, each row normalised. Random keys and queries give nearly flat rows instead (the mean score of a
/// token then hardly varies, the worst case for pruning the L1 value term).
std::vector<float> peaked_attention(const Model& m, Index L) {
  const Index G = m.H / m.Hkv, P = L - kWindow;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  std::vector<float> a(static_cast<std::size_t>(m.H * kWindow * L));
  std::vector<Index> rank(static_cast<std::size_t>(L));
  for (Index h = 0; h < m.Hkv; ++h) {
    std::iota(rank.begin(), rank.end(), Index{0});
    std::shuffle(rank.begin(), rank.end(), rng);
    for (Index q = h * G; q < (h + 1) * G; ++q)
      for (Index i = 0; i < kWindow; ++i) {
        float* row = a.data() + (q * kWindow + i) * L;
        double sum = 0;
        for (Index j = 0; j < L; ++j) {
          row[j] =
              j > P + i ? 0.f : std::pow(static_cast<float>(rank[static_cast<std::size_t>(j)] + 1), -1.5f) * u(rng);
          sum += row[j];
        }
        for (Index j = 0; j < L; ++j) row[j] = static_cast<float>(row[j] / sum);
      }
  }
  return a;
}

template <class T, class Policy>
void run_policy(benchmark::State& state, const Model& m, const Policy& policy, bool precomputed_gram,
                bool peaked = false, bool carried = false, bool engine_scores = false, bool retrieval = false) {
  const Index L = state.range(0);
  const double keep = static_cast<double>(state.range(1)) / 100.0;
  const auto budget = kvevict::Budget::keep_ratio(keep);
  Layer<T> layer(m, L);
  if (retrieval) layer.in.retrieval_heads = {0};  // KV head 0 forced whole (docs/algorithms.md#retrieval-heads)
  std::vector<float> attention;
  if constexpr (std::is_same_v<T, float>) {
    if (peaked) {
      attention = peaked_attention(m, L);
      layer.in.queries = {};
      layer.in.attention = kvevict::HeadsView<const float>::heads_major(attention.data(), m.H, kWindow, L);
    }
  }
  // H2O's received attention carried across steps by the engine (LayerInputs::accumulated [Hkv, L, 1]).
  std::vector<float> received;
  if (carried) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(0.0f, 4.0f);
    received.resize(static_cast<std::size_t>(m.Hkv * L));
    for (float& x : received) x = u(rng);
    layer.in.accumulated = kvevict::HeadsView<const float>::heads_major(received.data(), m.Hkv, L, 1);
  }
  // Scores the engine computed (LayerInputs::scores [Hkv, L, 1]; EngineScores), f32 only.
  std::vector<float> given;
  if constexpr (std::is_same_v<T, float>) {
    if (engine_scores) {
      std::mt19937 rng(11);
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      given.resize(static_cast<std::size_t>(m.Hkv * L));
      for (float& x : given) x = u(rng);
      layer.in.scores = kvevict::HeadsView<const float>::heads_major(given.data(), m.Hkv, L, 1);
    }
  }
  // The engine's per-layer W_o^T W_o, made once at model load (LayerInputs::w_o_gram), outside the timing.
  const auto gram = kvevict::OutputGram<kvevict::gram_scalar_t<activation_t<T>>>::compute(layer.in.w_o);
  if (precomputed_gram) layer.in.w_o_gram = &gram;
  const auto select_once = [&] { return select_one(policy, layer.in, budget); };
  double total = 0;
  for (auto _ : state) {
    total += seconds([&] { benchmark::DoNotOptimize(select_once().indices().data()); });
  }
  const double per_iter = total / static_cast<double>(state.iterations());
  const Floors floors = measure_floors(m, L);
  state.counters["x_floor"] = per_iter / floors.window;
  if (policy.reads_values()) state.counters["x_floors"] = per_iter / (floors.window + floors.gram);
  if constexpr (!std::is_same_v<T, float>) {
    // The floors are f32 GEMMs on every row: a cache stored otherwise is measured against what f32 storage could
    // do at best (the targets: <= 1.2 attention-only, <= 1.3 value-aware), under a name that says so.
    state.counters["x_floor_f32"] = per_iter / floors.window;
    if (policy.reads_values()) state.counters["x_floors_f32"] = per_iter / (floors.window + floors.gram);
  }
#if defined(KVEVICT_OPENMP)
  // Speed-up of the OpenMP threads over one thread, in this process (best of 2 single-threaded selects).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one_thread = std::min(seconds([&] { select_once(); }), seconds([&] { select_once(); }));
  omp_set_num_threads(threads);
  state.counters["x_threads"] = one_thread / per_iter;
#endif
  // Extra memory: the heap's peak during one select above its level before (the returned Selection included).
  const auto level = heap::mark();
  const kvevict::Selection sel = select_once();
  state.counters["extra_MiB"] = static_cast<double>(heap::peak_since(level)) / 1048576.0;
  // The pruned L1 value term (CriticalSelector, value_norm l1, prune): the fraction of the scored entries whose term
  // was computed, and the unpruned path in this run: its time / time (x_unpruned) and whether it keeps the same
  // (same_as_unpruned, 1 or 0).
  if constexpr (std::is_base_of_v<kvevict::CriticalSelector::Params, typename Policy::Params>) {
    auto p = policy.params();
    if (p.value_norm == kvevict::ValueNorm::l1 && p.prune) {
      kvevict::extend::ValueTermCounter counter;
      {
        const kvevict::extend::ValueTermCounter::Scope counting(counter);
        (void)select_one(policy, layer.in, budget);
      }
      if (counter.scored > 0) {
        state.counters["computed"] = counter.fraction();
        p.prune = false;
        const Policy unpruned(p);
        kvevict::Selection full;
        state.counters["x_unpruned"] = seconds([&] { full = select_one(unpruned, layer.in, budget); }) / per_iter;
        state.counters["same_as_unpruned"] = full.indices() == sel.indices() && full.offsets() == sel.offsets();
      }
    }
  }
  // Policies without a naive implementation (naive::has_select), and quantized caches, skip x_naive, agree and
  // naive_MiB.
  if constexpr (!kvevict::is_quantized_v<T> && naive::has_select_v<Policy, decltype(layer.in)>) {
    if (L == kNaiveContext) {
      const auto n_kept = kvevict_ref::n_kept_from_keep_ratio(L, keep);
      const auto naive_level = heap::mark();
      Kept kept;
      const double naive_time = seconds([&] { kept = naive::select(policy, layer.in, n_kept); });
      state.counters["naive_MiB"] = static_cast<double>(heap::peak_since(naive_level)) / 1048576.0;
      state.counters["x_naive"] = naive_time / per_iter;  // the target is >= 5x at 32k
      state.counters["agree"] = naive::agreement(kept, sel);
    }
  }
  state.SetLabel(std::string(m.name) + " " + storage_name<T>() + (peaked ? " peaked attention" : ""));
}

/// The scaling target, time at 64k / time at 16k <= 4.5: the best of the iterations at each context,
/// interleaved in one process so that the machine's drift hits both alike; the window-attention floor's own
/// ratio alongside (floor_64k_over_16k).
template <class Policy>
void BM_Scaling(benchmark::State& state, const Model& m, const Policy& policy) {
  const auto budget = kvevict::Budget::keep_ratio(0.1);
  const Layer<float> small(m, 16384), large(m, 65536);
  const auto time = [&](const Layer<float>& l) {
    return seconds([&] { benchmark::DoNotOptimize(select_one(policy, l.in, budget).indices().data()); });
  };
  double t16 = 1e30, t64 = 1e30;
  for (auto _ : state) {
    t16 = std::min(t16, time(small));
    t64 = std::min(t64, time(large));
  }
  state.counters["x_64k_over_16k"] = t64 / t16;
  state.counters["floor_64k_over_16k"] = measure_floors(m, 65536).window / measure_floors(m, 16384).window;
  state.SetLabel(std::string(m.name) + " f32, keep 10 %");
}

/// The value term stage alone (N [Hkv, L]) and a plain float GEMM of the same FLOPs ([L, d] x [d, D] per query
/// head for L1: 2 H L d D; [L, d] x [d, d] per query head for L2).
void BM_ValueTerm(benchmark::State& state, const Model& m, kvevict::ValueNorm norm) {
  const Index L = state.range(0);
  const Layer<float> layer(m, L);
  const Index G = m.H / m.Hkv;
  kvevict::OutputGram<float> gram;
  double total = 0;
  for (auto _ : state) {
    total += seconds([&] {
      if (norm == kvevict::ValueNorm::l2) gram = kvevict::OutputGram<float>::compute(layer.in.w_o);
      benchmark::DoNotOptimize(
          kvevict::extend::value_norms<float>(layer.in.values, layer.in.w_o, G, norm, &gram).data());
    });
  }
  const double per_iter = total / static_cast<double>(state.iterations());
  const Index cols = norm == kvevict::ValueNorm::l1 ? m.D : m.d;
  const kvevict::RowMatrix<float> w = kvevict::RowMatrix<float>::Random(m.d, cols);
  kvevict::RowMatrix<float> out(std::min<Index>(L, 4096), cols);
  const double gemm = best_of_3([&] {
    for (Index q = 0; q < m.H; ++q)
      for (Index r0 = 0; r0 < L; r0 += out.rows()) {
        const Index rows = std::min<Index>(out.rows(), L - r0);
        out.topRows(rows).noalias() = layer.in.values.head(q / G).middleRows(r0, rows) * w;
      }
    benchmark::DoNotOptimize(out.data());
  });
  state.counters["gemm_efficiency"] = gemm / per_iter;  // the target is >= 0.6 for L1
  state.counters["GFLOP/s"] = 2.0 * static_cast<double>(m.H * L * m.d * cols) / per_iter / 1e9;
  state.SetLabel(std::string(m.name) + (norm == kvevict::ValueNorm::l1 ? " L1" : " L2 (Gram)"));
}

/// The forcing stage alone (docs/algorithms.md#forcing: MassStatistics::forced_tokens for every KV head, corrected cap
/// at keep 20 %) against what it replaced, a full sort of each head's P tokens. Attention rows: "diffuse" (uniform
/// random, the 90 % mass set is most of P: the worst case) or "peaked" (power-law over a random permutation, like
/// real heads).
void BM_MassForcing(benchmark::State& state, const Model& m, bool peaked) {
  const Index L = state.range(0), P = L - kWindow, G = m.H / m.Hkv;
  const kvevict::extend::LayerShape shape{m.H, m.Hkv, G, L, kWindow, P, m.d, {}, {}};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  kvevict::extend::MassStatistics<float> mass(shape, false);
  kvevict::RowMatrix<float> rows(kWindow, L);
  std::vector<Index> perm(static_cast<std::size_t>(L));
  std::iota(perm.begin(), perm.end(), Index{0});
  for (Index q = 0; q < m.H; ++q) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (Index i = 0; i < kWindow; ++i)
      for (Index j = 0; j < L; ++j)
        rows(i, perm[static_cast<std::size_t>(j)]) =
            peaked ? std::pow(static_cast<float>(j + 1), -1.5f) * (0.5f + u(rng)) : u(rng);
    rows.array().colwise() /= rows.rowwise().sum().array();
    mass.add(q, rows);
  }
  const double tau = 0.9 - mass.window_bias();
  const Index cap = L / 5 - kWindow;
  Index forced = 0;
  double total = 0;
  for (auto _ : state) {
    total += seconds([&] {
      forced = 0;
      for (Index h = 0; h < m.Hkv; ++h) forced += static_cast<Index>(mass.forced_tokens(h, tau, cap).size());
      benchmark::DoNotOptimize(forced);
    });
  }
  std::vector<float> p(static_cast<std::size_t>(P));
  std::vector<Index> order(static_cast<std::size_t>(P));
  for (float& x : p) x = u(rng);
  const double full_sort = best_of_3([&] {
    for (Index h = 0; h < m.Hkv; ++h) {
      std::iota(order.begin(), order.end(), Index{0});
      std::sort(order.begin(), order.end(), [&](Index a, Index b) {
        const float pa = p[static_cast<std::size_t>(a)], pb = p[static_cast<std::size_t>(b)];
        return pa != pb ? pa > pb : a > b;
      });
    }
    benchmark::DoNotOptimize(order.data());
  });
  state.counters["forced_share"] = static_cast<double>(forced) / static_cast<double>(m.Hkv * P);
  state.counters["x_full_sort"] = total / static_cast<double>(state.iterations()) / full_sort;  // < 1: faster
  state.SetLabel(std::string(m.name) + (peaked ? " peaked" : " diffuse"));
}

void BM_WindowAttentionFloor(benchmark::State& state, const Model& m) {
  for (auto _ : state) benchmark::DoNotOptimize(measure_floors(m, state.range(0)).window);
  state.SetLabel(std::string(m.name) + " best of 3 inside");
}

const std::vector<Index> kContexts = {4096, 16384, 32768, 65536};

/// Runs `b` at every context up to max_L, keep 10 % and 20 %.
void policy_args(benchmark::internal::Benchmark* b, Index max_L) {
  for (Index L : kContexts)
    if (L <= max_L)
      for (Index keep : {10, 20}) b->Args({L, keep});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

/// BM_<row>/<storage>/<model>: `policy` on storage T.
template <class T, class Policy>
void register_policy(const std::string& row, const Model& m, const Policy& policy, Index max_L,
                     bool precomputed_gram = false, bool peaked = false, bool carried = false,
                     bool engine_scores = false, bool retrieval = false) {
  const std::string name = "BM_" + row + "/" + storage_name<T>() + "/" + m.name;
  policy_args(benchmark::RegisterBenchmark(
                  name.c_str(),
                  [m, policy, precomputed_gram, peaked, carried, engine_scores, retrieval](benchmark::State& s) {
                    run_policy<T>(s, m, policy, precomputed_gram, peaked, carried, engine_scores, retrieval);
                  }),
              max_L);
}

/// Calls f(entry) for the named catalogue entry; a name the catalogue no longer has is an error, not a silently
/// missing row.
template <class F>
void visit_entry(std::string_view name, F&& f) {
  if (!kvevict::catalogue::visit(name, f))
    throw std::logic_error("kvevict_bench: no catalogue entry \"" + std::string(name) +
                           "\" (catalogue: " + kvevict::catalogue::names(kvevict::catalogue::entries()) + ")");
}

void register_all() {
  using kvevict::ValueNorm;
  const kvevict::Knobs l1 = with_value_norm(ValueNorm::l1), l2 = with_value_norm(ValueNorm::l2);
  for (const Model* m : {&kLlama8B, &kQwen32B}) {
    const std::string model = m->name;
    const Model mm = *m;
    // Every catalogue policy on f32. Value-aware ones with a value_norm: the Gram (L2) form at every context, with and
    // without the engine's precomputed Gram, and the papers' L1 form up to 32k (O(H L d D): ~10 s per layer at 32k).
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
      const std::string name(entry.name);
      const std::vector<std::string> knobs = entry.knobs();
      if (!entry.make().reads_values() || std::find(knobs.begin(), knobs.end(), "value_norm") == knobs.end()) {
        // Expected Attention's ||v||_2 has no L1/L2 form; the engine-score policies read LayerInputs::scores.
        // R-KV's key redundancy is O(L^2 d) per head (docs/algorithms.md#redundancy): up to 16k.
        register_policy<float>(name, mm, entry.make(), entry.make().params().redundancy > 0.0 ? 16384 : 65536, false,
                               false, false, /*engine_scores=*/entry.make().reads_scores());
        return;
      }
      register_policy<float>(name + "-l2", mm, entry.make(l2), 65536);
      register_policy<float>(name + "-l2-gram", mm, entry.make(l2), 65536, /*precomputed_gram=*/true);
      register_policy<float>(name + "-l1", mm, entry.make(l1), 32768);
      // The pruned L1 term on window attention like real heads' (peaked_attention; CriticalSelector policies).
      if constexpr (std::is_base_of_v<kvevict::CriticalSelector::Params,
                                      typename std::decay_t<decltype(entry.make())>::Params>)
        register_policy<float>(name + "-l1-peaked", mm, entry.make(l1), 32768, false, /*peaked=*/true);
    });
    // The pruned L1 term under one budget across layers (CriticalKV's selector on Layer-DefensiveKV's allocation:
    // the same run loop refines the bounds after the model-wide allocation).
    kvevict::catalogue::compose("layer", "critical", [&](const auto& entry) {
      register_policy<float>("layer+critical-l1", mm, entry.make(l1), 32768);
      register_policy<float>("layer+critical-l1-peaked", mm, entry.make(l1), 32768, false, /*peaked=*/true);
    });
    // A retrieval head named (KV head 0 forced whole): against the catalogue rows layer-defensivekv-l2-gram and
    // open-defensivekv-l2-gram of the same run, what the forced tier costs.
    for (std::string_view row : {"layer-defensivekv", "open-defensivekv"})
      visit_entry(row, [&](const auto& entry) {
        register_policy<float>(std::string(row) + "-l2-gram-retrieval", mm, entry.make(l2), 65536,
                               /*precomputed_gram=*/true, false, false, false, /*retrieval=*/true);
      });
    // H2O from the scores an engine carries across steps (the catalogue row scores the window's attention).
    visit_entry("h2o", [&](const auto& entry) {
      register_policy<float>("h2o-carried", mm, entry.make(), 65536, false, false, /*carried=*/true);
    });
    // Other storage types: the attention-only paths (snapkv, adakv) and a value-aware one (defensivekv-l2).
    for (std::string_view row : {"snapkv", "adakv"})
      visit_entry(row, [&](const auto& entry) {
        register_policy<Eigen::half>(std::string(row), mm, entry.make(), 65536);
        register_policy<Eigen::bfloat16>(std::string(row), mm, entry.make(), 65536);
      });
    visit_entry("defensivekv", [&](const auto& entry) {
      register_policy<Eigen::bfloat16>("defensivekv-l2", mm, entry.make(l2), 65536);
    });
    // Quantized caches (int8 with per-head-token scales, fp8 e4m3 with a tensor scale, fp8 e5m2), queries and W_o
    // in float.
    for (std::string_view row : {"snapkv", "adakv"})
      visit_entry(row, [&](const auto& entry) {
        register_policy<std::int8_t>(std::string(row), mm, entry.make(), 65536);
        register_policy<kvevict::float8_e4m3>(std::string(row), mm, entry.make(), 65536);
        register_policy<kvevict::float8_e5m2>(std::string(row), mm, entry.make(), 65536);
      });
    visit_entry("defensivekv", [&](const auto& entry) {
      register_policy<std::int8_t>("defensivekv-l2", mm, entry.make(l2), 65536);
      register_policy<kvevict::float8_e4m3>("defensivekv-l2", mm, entry.make(l2), 65536);
    });
    // Stages.
    for (auto norm : {ValueNorm::l1, ValueNorm::l2}) {
      auto* b =
          benchmark::RegisterBenchmark(("BM_value_term_" + std::string(kvevict::to_string(norm)) + "/" + model).c_str(),
                                       [mm, norm](benchmark::State& s) { BM_ValueTerm(s, mm, norm); });
      for (Index L : kContexts)
        if (norm == ValueNorm::l2 || L <= 16384) b->Arg(L);
      b->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    const auto scaling = [&](const std::string& row, std::string_view policy, const kvevict::Knobs& knobs) {
      visit_entry(policy, [&](const auto& entry) {
        benchmark::RegisterBenchmark(("BM_scaling/" + row + "/" + model).c_str(),
                                     [mm, p = entry.make(knobs)](benchmark::State& s) { BM_Scaling(s, mm, p); })
            ->Iterations(3)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      });
    };
    scaling("snapkv", "snapkv", {});
    scaling("adakv", "adakv", {});
    scaling("criticalkv-l2", "criticalkv", l2);
    scaling("defensivekv-l2", "defensivekv", l2);
    for (bool peaked : {false, true}) {
      auto* b = benchmark::RegisterBenchmark(
          ("BM_mass_forcing/" + std::string(peaked ? "peaked/" : "diffuse/") + model).c_str(),
          [mm, peaked](benchmark::State& s) { BM_MassForcing(s, mm, peaked); });
      for (Index L : kContexts) b->Arg(L);
      b->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    auto* f = benchmark::RegisterBenchmark(("BM_window_attention_floor/" + model).c_str(),
                                           [mm](benchmark::State& s) { BM_WindowAttentionFloor(s, mm); });
    for (Index L : kContexts) f->Arg(L);
    f->Unit(benchmark::kMillisecond)->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    register_all();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
