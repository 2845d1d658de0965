#pragma once
/// kvevict's extension API: the building blocks of the pipeline, for writing a new Selector (how a layer is scored
/// and each head's tokens picked) or a new Allocation (how many tokens each KV head keeps), as the built-in ones
/// are written. Everything here is in namespace kvevict::extend; the contracts a Selector and an Allocation must
/// meet are checked at compile time by Policy (policy/contracts.hpp). Guide:
/// docs/extending.md. Engines need only <kvevict/kvevict.hpp>.
///
///   stage                      header                          blocks
///   shapes and budgets         core/inputs.hpp                 LayerShape
///                              allocation/layer_budget.hpp     LayerBudget, layer_budget
///   window-attention           observation/window_attention    WindowObservation, observe, window_attention
///   pooling                    aggregation/pooling.hpp         pool1d
///   aggregation                aggregation/mean.hpp            MeanAggregator, mean_scores
///                              aggregation/defensive.hpp       DefensiveAggregator, defensive_scores
///   value-term                 value/value_norm.hpp            value_norms, validate_value_inputs, output_gram
///   allocation                 ranking/topk.hpp                allocate_layer_global, LocalTopK
///   forcing                    forcing/mass_forcing.hpp        MassStatistics
///   forcing, ties: top-k       ranking/score_map.hpp           ScoreMap, Tier
///                              ranking/topk.hpp                KeepFlags, top_k_of_head, top_k_counts
///   selectors' shared steps    selectors/selector.hpp          scores_with_window, select_top_per_head
///   errors and input checks    core/error.hpp, core/inputs.hpp require, validate_inputs
///   layouts: sharing, blocks   layout/units.hpp                Grouping, group_maps, to_units, unit_budget, expand,
///                                                              forcing_cap, cap_forcing, force_groups
/// (a stage named by an anchor is the section docs/algorithms.md#<anchor>, e.g. docs/algorithms.md#forcing)

#include "kvevict/kvevict.hpp"

#include "kvevict/aggregation/defensive.hpp"
#include "kvevict/aggregation/mean.hpp"
#include "kvevict/aggregation/pooling.hpp"
#include "kvevict/allocation/layer_budget.hpp"
#include "kvevict/allocation/layer_global.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/forcing/mass_forcing.hpp"
#include "kvevict/layout/units.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/ranking/score_map.hpp"
#include "kvevict/ranking/topk.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/value/value_norm.hpp"

namespace kvevict::extend {
/// How a Selector or an Allocation reports bad parameters or inputs: throws kvevict::invalid_argument with the
/// message "kvevict::<where>: <parts...>" unless `ok` (the parts are streamed: text and numbers).
using detail::require;
/// The checks of docs/algorithms.md#setting (and docs/algorithms.md#ragged for ragged layers) on a layer's inputs for
/// an observation window of `window` queries; returns the layer's shape.
using detail::validate_inputs;
}  // namespace kvevict::extend
