#pragma once
/// The named policies of ALGORITHMS.md section 3, as thin presets over Policy and LayerGlobalPolicy.

#include "kvevict/allocation/head_adaptive.hpp"
#include "kvevict/allocation/streaming.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/policy/layer_global_policy.hpp"
#include "kvevict/policy/policy.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/critical_selector.hpp"
#include "kvevict/selectors/defensive_selector.hpp"

namespace kvevict {

/// SnapKV (arXiv 2404.14469): mean window attention, pooled; every KV head keeps the window and its top
/// (n_kept - w) prefix tokens.
using SnapKV = Policy<UniformAllocation, AttentionSelector>;

/// AdaKV (arXiv 2407.11550), as kvpress AdaKVPress: SnapKV's scores, one top-k of Hkv * n_kept over the whole
/// layer with a per-head safeguard of int(n_kept * alpha) tokens (alpha 0.2).
using AdaKV = Policy<HeadAdaptiveAllocation, AttentionSelector>;

/// CriticalKV (arXiv 2502.03805, ICML 2026), the published configuration (kvpress CriticalAdaKVPress): AdaKV's
/// allocation, then per head half the budget by attention and half by attention x ||V W_o^T||_1.
using CriticalKV = Policy<AdaKV, CriticalSelector>;

/// CriticalKV plugged into SnapKV's uniform allocation (kvpress CriticalKVPress(SnapKVPress)).
using CriticalSnapKV = Policy<SnapKV, CriticalSelector>;

/// DefensiveKV (arXiv 2510.13334, ICLR 2026): defensive aggregation x normalised value term, cumulative-mass
/// forcing, one flat top-k over the layer (head-adaptive with no safeguard: construct with alpha = 0, which
/// DefensiveKV::Params does by default).
class DefensiveKV : public Policy<HeadAdaptiveAllocation, DefensiveSelector> {
 public:
  struct Params : Policy<HeadAdaptiveAllocation, DefensiveSelector>::Params {
    Params() { alpha = 0.0; }
  };
  DefensiveKV() : DefensiveKV(Params{}) {}
  explicit DefensiveKV(const Params& p) : Policy<HeadAdaptiveAllocation, DefensiveSelector>(p) {}
};

/// Layer-DefensiveKV (arXiv 2510.13334): DefensiveKV's scores with one budget shared by all layers.
using LayerDefensiveKV = LayerGlobalPolicy<DefensiveSelector>;

/// The DefensiveKV paper's ablation: AdaKV with the defensive aggregation alone (no value term, no mass forcing).
class AdaKVDefensive : public Policy<AdaKV, DefensiveSelector> {
 public:
  struct Params : Policy<AdaKV, DefensiveSelector>::Params {
    Params() {
      value_term = false;
      mass_forcing = false;
    }
  };
  AdaKVDefensive() : AdaKVDefensive(Params{}) {}
  explicit AdaKVDefensive(const Params& p) : Policy<AdaKV, DefensiveSelector>(p) {}
};

}  // namespace kvevict
