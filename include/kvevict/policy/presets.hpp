#pragma once
/// The named policies of ALGORITHMS.md section 3, as thin presets over Policy.

#include "kvevict/allocation/head_adaptive.hpp"
#include "kvevict/allocation/streaming.hpp"
#include "kvevict/allocation/uniform.hpp"
#include "kvevict/policy/policy.hpp"
#include "kvevict/selectors/attention_selector.hpp"

namespace kvevict {

/// SnapKV (arXiv 2404.14469): mean window attention, pooled; every KV head keeps the window and its top
/// (n_kept - w) prefix tokens.
using SnapKV = Policy<UniformAllocation, AttentionSelector>;

/// AdaKV (arXiv 2407.11550), as kvpress AdaKVPress: SnapKV's scores, one top-k of Hkv * n_kept over the whole
/// layer with a per-head safeguard of int(n_kept * alpha) tokens (alpha 0.2).
using AdaKV = Policy<HeadAdaptiveAllocation, AttentionSelector>;

}  // namespace kvevict
