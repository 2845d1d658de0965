#pragma once
/// kvevict: KV-cache eviction policies for LLM inference, header-only, C++17, over Eigen.
///
/// The engine API: inputs and views (LayerInputs, HeadsView, KVView, output_projection, OutputGram), budgets
/// (Budget), the presets (SnapKV, AdaKV, PyramidKV, CriticalKV, CriticalSnapKV, DefensiveKV, LayerDefensiveKV,
/// AdaKVDefensive, TOVA, KNorm, KeyDiff, StreamingLLM), compositions (Policy<Base, Selector>,
/// LayerGlobalPolicy<Selector>), the catalogue (catalogue::visit, Knobs, select_layers), the result (Selection) and
/// errors (invalid_argument); ragged caches with original positions (LayerInputs::lengths/positions) and eviction while
/// the cache grows (CacheBook, evict_over_budget); selections shared across heads or layers and made of blocks
/// (LayoutParams: share, reduce, block; Selection::blocks, compaction_plan) and RoPE re-rotation of kept keys
/// (rerotate); int8 and fp8 caches with their scales (float8_e4m3, float8_e5m2, KVScale); the collectives of a
/// sharded model (shard::Communicator, shard::top_k_counts: docs/algorithms.md#sharded). Writing a new selector or
/// allocation: <kvevict/extend.hpp> and docs/extending.md. Semantics of every stage: docs/algorithms.md.

#include "kvevict/core/budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/quantized.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/version.hpp"

#include "kvevict/value/value_norm.hpp"

#include "kvevict/measure/induction.hpp"
#include "kvevict/measure/perturbation.hpp"

#include "kvevict/policy/catalogue.hpp"
#include "kvevict/policy/policy.hpp"
#include "kvevict/policy/presets.hpp"

#include "kvevict/layout/params.hpp"
#include "kvevict/rope/rerotate.hpp"

#include "kvevict/shard/communicator.hpp"
#include "kvevict/shard/top_k.hpp"

#include "kvevict/stream/cache_book.hpp"
#include "kvevict/stream/evict.hpp"
