#pragma once
// The bindings' runtime, the run: the catalogue policy the options name over a model's layers (layer-global
// policies see them all at once). Instantiated for float and double caches in run_policy.cpp, compiled once for
// every front end; the raw-tensor entry (select_tensors.hpp) instantiates it once per other storage type.

#include <optional>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "options.hpp"

namespace kvevict::runtime {

/// Calls f(entry) with the catalogue entry (kvevict/policy/catalogue.hpp) the options name (checked by finish()).
template <class F>
void visit_policy(const Options& o, F&& f) {
  const bool found = o.composed ? catalogue::compose(o.base, o.selector, f) : catalogue::visit(o.policy, f);
  KVEVICT_ASSERT(found);
  (void)found;
}

/// The selections of the options' policy over every layer, at arithmetic precision S, with the window the data
/// gives unless the options set one (none: the policy reads no observation; its own default).
template <class S, class KV, class Q, class W>
std::vector<Selection> run_policy(const Options& o, const std::vector<LayerInputs<KV, Q, W>>& layers,
                                  std::optional<Index> window) {
  Knobs knobs = o.knobs;
  if (window) knobs.window = window;
  std::vector<Selection> out;
  if (o.shard) {  // this rank's part of a sharded model: float and double caches (any cache at precision f64)
    if constexpr (std::is_same_v<KV, float> || std::is_same_v<KV, double>) {
      visit_policy(o,
                   [&](const auto& entry) { out = entry.make(knobs).template select<S>(layers, *o.budget, *o.shard); });
      return out;
    } else {
      throw invalid_argument(
          "sharded selection reads float32 or float64 caches at precision f32, any cache at precision f64");
    }
  }
  visit_policy(o, [&](const auto& entry) { out = select_layers<S>(entry.make(knobs), layers, *o.budget); });
  return out;
}

extern template std::vector<Selection> run_policy<float>(const Options&, const std::vector<LayerInputs<float>>&,
                                                         std::optional<Index>);
extern template std::vector<Selection> run_policy<double>(const Options&, const std::vector<LayerInputs<double>>&,
                                                          std::optional<Index>);

}  // namespace kvevict::runtime
