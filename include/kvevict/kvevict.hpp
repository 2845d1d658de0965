#pragma once
/// kvevict: KV-cache eviction policies for LLM inference, header-only, C++17, over Eigen.
/// Pipeline (ALGORITHMS.md section 2): observation -> aggregation -> value term -> allocation -> forcing + top-k
/// -> Selection.

#include "kvevict/core/budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/version.hpp"

#include "kvevict/observation/window_attention.hpp"

#include "kvevict/aggregation/defensive.hpp"
#include "kvevict/aggregation/mean.hpp"
#include "kvevict/aggregation/pooling.hpp"

#include "kvevict/allocation/head_adaptive.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/allocation/streaming.hpp"
#include "kvevict/allocation/uniform.hpp"

#include "kvevict/value/value_norm.hpp"

#include "kvevict/forcing/mass_forcing.hpp"

#include "kvevict/measure/perturbation.hpp"

#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"

#include "kvevict/selectors/attention_selector.hpp"
#include "kvevict/selectors/critical_selector.hpp"
#include "kvevict/selectors/defensive_selector.hpp"
#include "kvevict/selectors/selector.hpp"

#include "kvevict/policy/layer_global_policy.hpp"
#include "kvevict/policy/policy.hpp"
#include "kvevict/policy/presets.hpp"
