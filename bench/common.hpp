#pragma once
// What the benchmarks share: real model shapes, one layer of random tensors in an engine's layout, timing helpers
// and the GEMM floors every ratio is taken against.

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <random>
#include <type_traits>
#include <vector>

#include "kvevict/extend.hpp"

namespace kvevict_bench {

using kvevict::Index;
using clock_type = std::chrono::steady_clock;

struct Model {
  const char* name;
  Index H, Hkv, d, D;
};
inline constexpr Model kLlama8B{"Llama-3.1-8B", 32, 8, 128, 4096};
inline constexpr Model kQwen32B{"Qwen2.5-32B", 40, 8, 128, 5120};
inline constexpr Index kWindow = 32;

template <class T>
const char* storage_name() {
  if constexpr (std::is_same_v<T, float>)
    return "f32";
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return "f16";
  else
    return "bf16";
}

/// One layer in storage T: window queries [H, w, d], keys and values tokens-major [L, Hkv, d] (an engine's
/// cache), W_o [D, H * d].
template <class T>
struct Layer {
  Model m;
  std::vector<T> q, k, v, w_o;
  kvevict::LayerInputs<T> in;
  Layer(const Model& model, Index L) : m(model) {
    std::mt19937 rng(42);
    std::normal_distribution<float> n(0.f, 1.f);
    const auto fill = [&](std::vector<T>& x, std::size_t size, float scale) {
      x.resize(size);
      for (T& e : x) e = static_cast<T>(scale * n(rng));
    };
    fill(q, static_cast<std::size_t>(m.H * kWindow * m.d), 1.f);
    fill(k, static_cast<std::size_t>(m.Hkv * L * m.d), 1.f);
    fill(v, k.size(), 1.f);
    fill(w_o, static_cast<std::size_t>(m.D * m.H * m.d), 0.02f);
    in.queries = kvevict::HeadsView<const T>::heads_major(q.data(), m.H, kWindow, m.d);
    in.keys = kvevict::kv_tokens_major<const T>(k.data(), L, m.Hkv, m.d);
    in.values = kvevict::kv_tokens_major<const T>(v.data(), L, m.Hkv, m.d);
    in.w_o = kvevict::output_projection<const T>(w_o.data(), m.D, m.H, m.d);
  }
};

/// Seconds `f()` takes, once.
template <class F>
double seconds(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Best of 3 of `f()` in seconds.
template <class F>
double best_of_3(F&& f) {
  return std::min({seconds(f), seconds(f), seconds(f)});
}

/// Float GEMM floors on float copies of the layer (the floors do not pay for conversions).
struct Floors {
  double window = 0;  // Q_win[q] K[q/G]^T, every query head: 2 H w L d FLOPs
  double gram = 0;    // V_h G_q, every query head: 2 H L d^2 FLOPs
};

inline Floors measure_floors(const Model& m, Index L) {
  const Layer<float> f(m, L);
  const Index G = m.H / m.Hkv;
  Floors out;
  kvevict::RowMatrix<float> logits(kWindow, L), projected(L, m.d);
  const kvevict::RowMatrix<float> gram = kvevict::RowMatrix<float>::Random(m.d, m.d);
  out.window = best_of_3([&] {
    for (Index q = 0; q < m.H; ++q) logits.noalias() = f.in.queries.head(q) * f.in.keys.head(q / G).transpose();
    benchmark::DoNotOptimize(logits.data());
  });
  out.gram = best_of_3([&] {
    for (Index q = 0; q < m.H; ++q) projected.noalias() = f.in.values.head(q / G) * gram;
    benchmark::DoNotOptimize(projected.data());
  });
  return out;
}

/// The knobs of a value-aware row: the catalogue default with this value norm.
inline kvevict::Knobs with_value_norm(kvevict::ValueNorm norm) {
  kvevict::Knobs k;
  k.value_norm = norm;
  return k;
}

/// One layer's selection with any policy: a layer-global one selects a model of that single layer (through
/// kvevict::select_layers, as an engine would), a per-layer one calls select().
template <class Policy, class KV, class Q, class W>
kvevict::Selection select_one(const Policy& policy, const kvevict::LayerInputs<KV, Q, W>& in,
                              const kvevict::Budget& budget) {
  if constexpr (kvevict::budget_scope<Policy>() == kvevict::BudgetScope::model)
    return std::move(kvevict::select_layers(policy, std::vector<kvevict::LayerInputs<KV, Q, W>>{in}, budget)[0]);
  else
    return policy.select(in, budget);
}

}  // namespace kvevict_bench
