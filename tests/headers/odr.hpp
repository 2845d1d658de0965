#pragma once
// Shared by odr_a.cpp and odr_b.cpp: each includes the umbrella header and instantiates the same presets, so the
// linker sees every kvevict template instantiation (and any non-inline definition) twice.

#include <cstdint>
#include <string>
#include <vector>

#include <kvevict/kvevict.hpp>

namespace kvevict_odr {

/// Indices and offsets of each selection, in a fixed order (SnapKV, AdaKV, StreamingLLM, SnapKV in double,
/// SnapKV on double storage).
struct Result {
  std::vector<std::vector<std::int64_t>> indices;
  std::vector<std::vector<std::int64_t>> offsets;
  std::string threading_mode;  // kvevict::detail::threading_mode() as this unit sees it
};

Result run_a();
Result run_b();

/// Deterministic values in [-1, 1) (a small LCG; no <random>, so both units agree on every platform).
template <class T>
std::vector<T> filled(std::size_t n, std::uint32_t seed) {
  std::vector<T> v(n);
  std::uint32_t s = seed;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<T>(static_cast<double>(s >> 8) / 8388608.0 - 1.0);
  }
  return v;
}

// Tag makes the driver a distinct instantiation per unit; the kvevict templates it calls are the shared ones.
template <int Tag>
Result run_presets() {
  constexpr kvevict::Index H = 4, Hkv = 2, w = 32, L = 96, d = 8;
  const std::vector<float> q = filled<float>(static_cast<std::size_t>(H * w * d), 1u);
  const std::vector<float> k = filled<float>(static_cast<std::size_t>(Hkv * L * d), 2u);
  const std::vector<double> qd(q.begin(), q.end());
  const std::vector<double> kd(k.begin(), k.end());

  kvevict::LayerInputs<float> in;
  in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), H, w, d);
  in.keys = kvevict::kv_heads_major(k.data(), Hkv, L, d);
  kvevict::LayerInputs<double> ind;
  ind.queries = kvevict::HeadsView<const double>::heads_major(qd.data(), H, w, d);
  ind.keys = kvevict::kv_heads_major(kd.data(), Hkv, L, d);

  const kvevict::Budget budget = kvevict::Budget::tokens(48);
  std::vector<kvevict::Selection> selections;
  selections.push_back(kvevict::SnapKV{}.select(in, budget));
  selections.push_back(kvevict::AdaKV{}.select(in, budget));
  selections.push_back(kvevict::StreamingLLM{}.select(in, budget));
  selections.push_back(kvevict::SnapKV{}.select<double>(in, budget));
  selections.push_back(kvevict::SnapKV{}.select<double>(ind, budget));

  Result r;
  for (const kvevict::Selection& s : selections) {
    r.indices.push_back(s.indices());
    r.offsets.push_back(s.offsets());
  }
  r.threading_mode = kvevict::detail::threading_mode();
  return r;
}

}  // namespace kvevict_odr
