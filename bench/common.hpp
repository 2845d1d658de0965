#pragma once
// What the benchmarks share: real model shapes, one layer of random tensors in an engine's layout, timing helpers
// and the GEMM floors every ratio is taken against.

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <utility>
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

/// One layer's random f32 tensors at context L, drawn from `rng` in this order (normal, W_o scaled by 0.02): window
/// queries [H, w, d], keys and values tokens-major [L, Hkv, d] (an engine's cache), W_o [D, H d], the engine's scores
/// [Hkv, L]; and the LayerInputs viewing them (so it is neither copied nor moved).
struct RandomLayer {
  std::vector<float> q, k, v, w_o, scores;
  kvevict::LayerInputs<float> in;
  RandomLayer(const Model& m, Index L, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.f, 1.f);
    const auto fill = [&](std::vector<float>& x, Index size, float scale) {
      x.resize(static_cast<std::size_t>(size));
      for (float& e : x) e = scale * normal(rng);
    };
    fill(q, m.H * kWindow * m.d, 1.f);
    fill(k, L * m.Hkv * m.d, 1.f);
    fill(v, L * m.Hkv * m.d, 1.f);
    fill(w_o, m.D * m.H * m.d, 0.02f);
    fill(scores, m.Hkv * L, 1.f);
    in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), m.H, kWindow, m.d);
    in.keys = kvevict::kv_tokens_major<const float>(k.data(), L, m.Hkv, m.d);
    in.values = kvevict::kv_tokens_major<const float>(v.data(), L, m.Hkv, m.d);
    in.w_o = kvevict::output_projection<const float>(w_o.data(), m.D, m.H, m.d);
    in.scores = kvevict::HeadsView<const float>::heads_major(scores.data(), m.Hkv, L, 1);
  }
  RandomLayer(const RandomLayer&) = delete;
  RandomLayer& operator=(const RandomLayer&) = delete;
};

template <class T>
const char* storage_name() {
  if constexpr (std::is_same_v<T, float>)
    return "f32";
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return "f16";
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>)
    return "bf16";
  else if constexpr (std::is_same_v<T, std::int8_t>)
    return "i8";
  else if constexpr (std::is_same_v<T, kvevict::float8_e4m3>)
    return "e4m3";
  else
    return "e5m2";
}

/// The type of window queries and W_o next to a cache stored as T: T itself, float for quantized caches (an
/// engine's activations are not quantized).
template <class T>
using activation_t = std::conditional_t<kvevict::is_quantized_v<T>, float, T>;

/// The fp8 code nearest to x (ties to the even code), from the format's exact values: what a cast to fp8 stores.
template <class F8>
F8 nearest_fp8(float x) {
  static const std::vector<std::pair<float, std::uint8_t>> codes = [] {
    std::vector<std::pair<float, std::uint8_t>> c;
    for (int b = 0; b < 0x80; ++b) {
      const float v = static_cast<float>(F8::from_bits(static_cast<std::uint8_t>(b)));
      if (std::isfinite(v)) c.emplace_back(v, static_cast<std::uint8_t>(b));
    }
    return c;  // increasing with the code
  }();
  const float a = std::min(std::fabs(x), codes.back().first);
  auto hi = std::lower_bound(codes.begin(), codes.end(), std::make_pair(a, std::uint8_t{0}));
  if (hi == codes.end()) hi = codes.end() - 1;
  auto best = hi;
  if (hi != codes.begin()) {
    const auto lo = hi - 1;
    const float dl = a - lo->first, dh = hi->first - a;
    if (dl < dh || (dl == dh && (lo->second & 1) == 0)) best = lo;
  }
  return F8::from_bits(static_cast<std::uint8_t>(best->second | (std::signbit(x) ? 0x80 : 0)));
}

/// One layer in storage T: window queries [H, w, d], keys and values tokens-major [L, Hkv, d] (an engine's
/// cache), W_o [D, H * d]; queries and W_o in activation_t<T>. Quantized caches as engines store them: int8 with a
/// per-head-and-token absmax scale (tokens-major [L, Hkv], scale = absmax / 127), fp8 e4m3 with vLLM's per-tensor
/// scale (absmax / 448), fp8 e5m2 unscaled.
template <class T>
struct Layer {
  using A = activation_t<T>;
  Model m;
  std::vector<A> q, w_o;
  std::vector<T> k, v;
  std::vector<float> k_scale, v_scale;  // int8: [L, Hkv]
  kvevict::LayerInputs<T, A, A> in;
  Layer(const Model& model, Index L) : m(model) {
    std::mt19937 rng(42);
    std::normal_distribution<float> n(0.f, 1.f);
    const auto fill = [&](auto& x, std::size_t size, float scale) {
      using E = typename std::decay_t<decltype(x)>::value_type;
      x.resize(size);
      for (E& e : x) e = static_cast<E>(scale * n(rng));
    };
    fill(q, static_cast<std::size_t>(m.H * kWindow * m.d), 1.f);
    if constexpr (kvevict::is_quantized_v<T>) {
      std::vector<float> kf, vf;
      fill(kf, static_cast<std::size_t>(m.Hkv * L * m.d), 1.f);
      fill(vf, kf.size(), 1.f);
      quantize(kf, k, k_scale, in.keys_scale, L);
      quantize(vf, v, v_scale, in.values_scale, L);
    } else {
      fill(k, static_cast<std::size_t>(m.Hkv * L * m.d), 1.f);
      fill(v, k.size(), 1.f);
    }
    fill(w_o, static_cast<std::size_t>(m.D * m.H * m.d), 0.02f);
    in.queries = kvevict::HeadsView<const A>::heads_major(q.data(), m.H, kWindow, m.d);
    in.keys = kvevict::kv_tokens_major<const T>(k.data(), L, m.Hkv, m.d);
    in.values = kvevict::kv_tokens_major<const T>(v.data(), L, m.Hkv, m.d);
    in.w_o = kvevict::output_projection<const A>(w_o.data(), m.D, m.H, m.d);
  }

 private:
  /// x tokens-major [L, Hkv, d] to codes and scales (see the struct's comment).
  void quantize(const std::vector<float>& x, std::vector<T>& codes, std::vector<float>& scales, kvevict::KVScale& out,
                Index L) {
    codes.resize(x.size());
    if constexpr (std::is_same_v<T, std::int8_t>) {
      scales.resize(static_cast<std::size_t>(L * m.Hkv));
      for (std::size_t row = 0; row < scales.size(); ++row) {
        const auto first = x.begin() + static_cast<std::ptrdiff_t>(row) * m.d;
        float absmax = 0;
        for (auto it = first; it != first + m.d; ++it) absmax = std::max(absmax, std::fabs(*it));
        scales[row] = absmax > 0 ? absmax / 127.0f : 1.0f;
        for (Index c = 0; c < m.d; ++c)
          codes[row * static_cast<std::size_t>(m.d) + static_cast<std::size_t>(c)] =
              static_cast<std::int8_t>(std::lrint(first[c] / scales[row]));
      }
      out.token = kvevict::per_head_token_scales_tokens_major(scales.data(), L, m.Hkv);
    } else {
      float absmax = 0;
      for (float e : x) absmax = std::max(absmax, std::fabs(e));
      out.tensor = std::is_same_v<T, kvevict::float8_e4m3> ? absmax / 448.0f : 1.0f;
      for (std::size_t i = 0; i < x.size(); ++i) codes[i] = nearest_fp8<T>(x[i] / out.tensor);
    }
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

template <class P, class = void>
struct has_window : std::false_type {};
template <class P>
struct has_window<P, std::void_t<decltype(std::declval<const P&>().params().window)>> : std::true_type {};

/// `in` as `policy` observes it: the last params().window of its kWindow query (or attention) rows, as an engine
/// that keeps kWindow recent queries gives a policy with a shorter window (TOVA: 1); `in` itself otherwise.
template <class Policy, class In>
In observed_by(const Policy& policy, In in) {
  if constexpr (has_window<Policy>::value) {
    const Index w = policy.params().window;
    if (in.queries.rows() > w) in.queries = kvevict::last_rows(in.queries, w);
    if (in.attention.rows() > w) in.attention = kvevict::last_rows(in.attention, w);
  }
  return in;
}
template <class Policy, class In>
std::vector<In> observed_by(const Policy& policy, const std::vector<In>& layers) {
  std::vector<In> out;
  for (const In& in : layers) out.push_back(observed_by(policy, in));
  return out;
}

/// One layer's selection with any policy: a layer-global one selects a model of that single layer (through
/// kvevict::select_layers, as an engine would), a per-layer one calls select(); each observes its own window.
template <class Policy, class KV, class Q, class W>
kvevict::Selection select_one(const Policy& policy, const kvevict::LayerInputs<KV, Q, W>& in,
                              const kvevict::Budget& budget) {
  if constexpr (kvevict::budget_scope<Policy>() == kvevict::BudgetScope::model)
    return std::move(kvevict::select_layers(
        policy, std::vector<kvevict::LayerInputs<KV, Q, W>>{observed_by(policy, in)}, budget)[0]);
  else
    return policy.select(observed_by(policy, in), budget);
}

}  // namespace kvevict_bench
