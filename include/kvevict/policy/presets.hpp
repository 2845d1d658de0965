#pragma once
/// The named policies (docs/algorithms.md#presets), as thin presets over Policy. Each is a
/// class so that its name appears in error messages and its defaults carry over when it serves as a base.

#include "kvevict/allocation/head_adaptive.hpp"
#include "kvevict/allocation/pyramid.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/policy/policy.hpp"
#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/critical_selector.hpp"
#include "kvevict/selectors/defensive_selector.hpp"
#include "kvevict/selectors/engine_score_selector.hpp"
#include "kvevict/selectors/expected_attention_selector.hpp"
#include "kvevict/selectors/h2o_selector.hpp"
#include "kvevict/selectors/key_diff_selector.hpp"
#include "kvevict/selectors/key_norm_selector.hpp"
#include "kvevict/selectors/recency_selector.hpp"

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {  // core/config.hpp: code that depends on KVEVICT_OPENMP

/// StreamingLLM (arXiv 2309.17453), the positional baseline: every KV head keeps its first min(sinks, n_kept)
/// entries (4 attention sinks) and its most recent ones, n_kept in all (min(n_kept, L_h) on a ragged layer). Reads
/// only the keys' shape, lengths and positions; no observation window (window 0).
class StreamingLLM : public Policy<UniformAllocation, RecencySelector> {
 public:
  static constexpr const char* type_name = "StreamingLLM";
  explicit StreamingLLM(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// SnapKV (arXiv 2404.14469): mean window attention, pooled; every KV head keeps the window and its top
/// (n_kept - w) prefix tokens.
class SnapKV : public Policy<UniformAllocation, AttentionSelector> {
 public:
  static constexpr const char* type_name = "SnapKV";
  explicit SnapKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// AdaKV (arXiv 2407.11550), as kvpress AdaKVPress: SnapKV's scores, one top-k of Hkv * n_kept over the whole
/// layer with a per-head safeguard of int(n_kept * alpha) tokens (alpha 0.2).
class AdaKV : public Policy<HeadAdaptiveAllocation, AttentionSelector> {
 public:
  static constexpr const char* type_name = "AdaKV";
  explicit AdaKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// PyramidKV (arXiv 2406.02069): SnapKV's scores and window; layer l of N keeps a share of the model budget on a
/// line that decreases with depth (beta = 20: the last layer's prefix share is 1/20 of the mean), the same number in
/// every KV head of a layer. Needs each layer's place: select(in, budget, layer, layers), select_layers or plan.
class PyramidKV : public Policy<PyramidAllocation, AttentionSelector> {
 public:
  static constexpr const char* type_name = "PyramidKV";
  explicit PyramidKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// CriticalKV (arXiv 2502.03805, ICML 2026), the published configuration (kvpress CriticalAdaKVPress): AdaKV's
/// allocation, then per head half the budget by attention and half by attention x ||V W_o^T||_1.
class CriticalKV : public Policy<AdaKV, CriticalSelector> {
 public:
  static constexpr const char* type_name = "CriticalKV";
  explicit CriticalKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// CriticalKV plugged into SnapKV's uniform allocation (kvpress CriticalKVPress(SnapKVPress)).
class CriticalSnapKV : public Policy<SnapKV, CriticalSelector> {
 public:
  static constexpr const char* type_name = "CriticalSnapKV";
  explicit CriticalSnapKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// DefensiveKV (arXiv 2510.13334, ICLR 2026): defensive aggregation x normalised value term, cumulative-mass
/// forcing, one flat top-k over the layer (head-adaptive without the safeguard: its Params default alpha to 0).
class DefensiveKV : public Policy<HeadAdaptiveAllocation, DefensiveSelector> {
 public:
  static constexpr const char* type_name = "DefensiveKV";
  struct Params : Policy::Params {
    Params() { alpha = 0.0; }
  };
  explicit DefensiveKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// Layer-DefensiveKV (arXiv 2510.13334): DefensiveKV's scores with one budget shared by all layers.
class LayerDefensiveKV : public LayerGlobalPolicy<DefensiveSelector> {
 public:
  static constexpr const char* type_name = "LayerDefensiveKV";
  explicit LayerDefensiveKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// The DefensiveKV paper's ablation: AdaKV with the defensive aggregation alone (no value term, no mass forcing).
class AdaKVDefensive : public Policy<AdaKV, DefensiveSelector> {
 public:
  static constexpr const char* type_name = "AdaKVDefensive";
  struct Params : Policy::Params {
    Params() {
      value_term = false;
      mass_forcing = false;
    }
  };
  explicit AdaKVDefensive(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// TOVA (arXiv 2401.06104), as kvpress TOVAPress: the attention of the last query alone (window 1, no pooling),
/// averaged over every query head of the layer, so all KV heads keep one set (share = per_layer, reduce = mean);
/// n_kept per KV head. SnapKV's parts with other defaults.
class TOVA : public Policy<UniformAllocation, AttentionSelector> {
 public:
  static constexpr const char* type_name = "TOVA";
  struct Params : Policy::Params {
    Params() {
      window = 1;
      kernel = 1;
      share = Sharing::per_layer;
      reduce = Reduce::mean;
    }
  };
  explicit TOVA(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// K-norm (arXiv 2406.11430), as kvpress KnormPress: the keys of lowest L2 norm, n_kept per KV head. Reads the
/// keys alone (no queries or attention needed). Window 1: only the last token is kept whatever its score (kvpress
/// scores it as any other).
class KNorm : public Policy<UniformAllocation, KeyNormSelector> {
 public:
  static constexpr const char* type_name = "KNorm";
  struct Params : Policy::Params {
    Params() { window = 1; }
  };
  explicit KNorm(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// KeyDiff (arXiv 2504.18838), as kvpress KeyDiffPress: the keys least similar (cosine) to the head's mean key
/// direction, n_kept per KV head. Reads the keys alone. Window 1, as KNorm.
class KeyDiff : public Policy<UniformAllocation, KeyDiffSelector> {
 public:
  static constexpr const char* type_name = "KeyDiff";
  struct Params : Policy::Params {
    Params() { window = 1; }
  };
  explicit KeyDiff(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// Expected Attention (kvpress ExpectedAttentionPress): the attention the next 512 positions' queries are expected
/// to pay each key (window query statistics, RoPE averaged over those positions), times ||v||_2; the first 4
/// entries kept; n_kept per KV head. The statistics come from the window queries (default 32, kept as SnapKV's).
class ExpectedAttention : public Policy<UniformAllocation, ExpectedAttentionSelector> {
 public:
  static constexpr const char* type_name = "ExpectedAttention";
  explicit ExpectedAttention(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// H2O (arXiv 2306.14048): each KV head keeps its heavy hitters, the entries that received the most attention from
/// every query so far (LayerInputs::accumulated, carried by LayerBook::accumulate; the window's alone without it),
/// and its most recent entries, half of the budget each (recent_share 0.5); window 1 (the last token), no pooling.
class H2O : public Policy<UniformAllocation, H2OSelector> {
 public:
  static constexpr const char* type_name = "H2O";
  struct Params : Policy::Params {
    Params() {
      window = 1;
      kernel = 1;
    }
  };
  explicit H2O(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// R-KV (arXiv 2505.24133, a decoding-time method): SnapKV's window attention (window 8, max pooling, kernel 7) minus
/// the key redundancy, (1 - rho) s - rho R with rho = 0.93 (the reference code's mix_lambda 0.07,
/// docs/algorithms.md#redundancy); n_kept per KV head. The same `redundancy` knob weighs any other policy.
class RKV : public Policy<UniformAllocation, AttentionSelector> {
 public:
  static constexpr const char* type_name = "RKV";
  struct Params : Policy::Params {
    Params() {
      window = 8;
      kernel = 7;
      pooling = Pooling::max;
      redundancy = 0.93;
    }
  };
  explicit RKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// OpenDefensiveKV (ours, docs/algorithms.md#open-window): Layer-DefensiveKV (one budget across layers, worst-case
/// aggregation with the prior floor, L1 value term, mass forcing) with two changes: no pooling (kernel 1), and an
/// open window: the 32 window queries are observed as before, but the window's own tokens compete by the same score
/// instead of being kept, and only each head's newest entry is kept unconditionally.
class OpenDefensiveKV : public LayerGlobalPolicy<DefensiveSelector> {
 public:
  static constexpr const char* type_name = "OpenDefensiveKV";
  struct Params : Policy::Params {
    Params() {
      kernel = 1;
      open_window = true;
    }
  };
  explicit OpenDefensiveKV(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// Scores from the engine (docs/algorithms.md#engine-scores): LayerInputs::scores as they are (kernel 1), no window
/// (window 0, as KVzip: the engine scored every entry, the newest included), one flat top-k over the layer
/// (head-adaptive without the safeguard, as DefensiveKV).
class EngineScores : public Policy<HeadAdaptiveAllocation, EngineScoreSelector> {
 public:
  static constexpr const char* type_name = "EngineScores";
  struct Params : Policy::Params {
    Params() {
      alpha = 0.0;
      kernel = 1;
      window = 0;
    }
  };
  explicit EngineScores(const Params& p = Params{}) : Policy(p, type_name) {}
};

/// The engine's scores with one budget across layers (KVzip's default: one top-k over every head of every layer),
/// kernel 1, window 0.
class LayerEngineScores : public LayerGlobalPolicy<EngineScoreSelector> {
 public:
  static constexpr const char* type_name = "LayerEngineScores";
  struct Params : Policy::Params {
    Params() {
      kernel = 1;
      window = 0;
    }
  };
  explicit LayerEngineScores(const Params& p = Params{}) : Policy(p, type_name) {}
};

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
