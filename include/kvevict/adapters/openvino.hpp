#pragma once
/// OpenVINO GenAI (docs/engines.md#openvino): a Selection as the per-layer logical block sets its continuous
/// batching pipeline frees and the rotation data of the blocks that moved. OpenVINO GenAI evicts whole blocks of
/// block_size tokens, a set per decoder layer (CacheEvictionAlgorithm::evict_logical_blocks ->
/// Scheduler::free_blocks_from_sequence), the same number in every layer (the sequence has one length), and, with
/// cache rotation on, turns the keys of every kept block that moved back by the tokens evicted before it
/// (CacheRotationCalculator::get_rotation_data). So a selection fits when each layer keeps one set for its KV heads
/// in whole blocks (share = per_layer, block = block_size) and every layer keeps as many; any other is refused.
///
///   const auto plan = kvevict::adapters::openvino_plan(kvevict::select_layers(policy, layers, budget), block_size);
///   scheduler->free_blocks_from_sequence(seq_id, plan.evicted_blocks);  // one std::set per layer
///   sequence_group->register_token_eviction(plan.evicted_tokens);
///   for each layer l, plan.rotations[l]: rotate block logical_block_idx's keys back by rotation_delta positions

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "kvevict/adapters/shared_set.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// One sequence's eviction in OpenVINO GenAI's terms.
struct OpenVinoPlan {
  /// As CacheRotationCalculator::BlockRotationData: after the eviction, the block at logical_block_idx (counted
  /// among the kept blocks) holds keys rotation_delta positions ahead of their new places: turn them back by it.
  struct BlockRotation {
    std::size_t logical_block_idx, rotation_delta;
  };
  std::vector<std::set<std::size_t>> evicted_blocks;  ///< [layer] logical block ids to free, as evict_logical_blocks
  std::vector<std::vector<BlockRotation>> rotations;  ///< [layer] Positions::renumbered only, ascending by block
  std::size_t evicted_tokens = 0;                     ///< evicted blocks per layer * block_size
  Index num_tokens = 0;                               ///< tokens the sequence keeps in every layer
};

/// The plan that makes a sequence's per-layer block tables hold what `layers` keep (each layer [Hkv] heads over the
/// sequence's L tokens, one set for its KV heads, in whole blocks of `block_size` rows: every block kept whole or
/// evicted, the last, partial block kept; every layer the same number). OpenVINO's positions are the tokens' places
/// in the logical cache, so renumbering moves each kept block back by the tokens evicted before it
/// (Positions::renumbered: cache rotation on); Positions::kept gives no rotations (rotation off). Throws
/// kvevict::invalid_argument when a layer's heads keep different sets, a block is kept in part, or two layers keep
/// different numbers of blocks.
inline OpenVinoPlan openvino_plan(const std::vector<Selection>& layers, Index block_size,
                                  Positions positions = Positions::renumbered) {
  const char* where = "adapters::openvino_plan";
  detail::require_shared_set(layers, false, where);
  detail::require(block_size >= 1, where, "block_size must be >= 1, got ", block_size);
  const Index B = block_size;
  OpenVinoPlan plan;
  plan.evicted_blocks.resize(layers.size());
  plan.rotations.resize(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const Selection& sel = layers[l];
    const Selection::HeadIndices rows = sel.head(0);
    const Index L = sel.context_length(), blocks = (L + B - 1) / B;
    detail::require(L == layers[0].context_length(), where, "layer ", l, " holds ", L, " tokens, but layer 0 holds ",
                    layers[0].context_length(), " (one sequence has one length)");
    if (positions == Positions::renumbered) {
      const Selection::HeadIndices p = sel.head_positions(0);
      for (Index j = 0; j < rows.size(); ++j)
        detail::require(p[j] == rows[j], where,
                        "renumbering moves OpenVINO GenAI's blocks by their logical places, so "
                        "the positions must be the rows, but layer ",
                        l, " row ", rows[j], " is at position ", p[j], " (positions kept: Positions::kept)");
    }
    // Kept rows per block: a block is kept whole (B rows, or the last block's rows) or not at all.
    std::vector<Index> kept(static_cast<std::size_t>(blocks), 0);
    for (Index j = 0; j < rows.size(); ++j) ++kept[static_cast<std::size_t>(rows[j] / B)];
    Index evicted_before = 0;
    for (Index u = 0; u < blocks; ++u) {
      const Index size = std::min(B, L - u * B), k = kept[static_cast<std::size_t>(u)];
      detail::require(k == 0 || k == size, where, "OpenVINO GenAI evicts whole blocks of ", B, " tokens, but layer ", l,
                      " keeps ", k, " of the ", size, " tokens of block ", u,
                      " (select with block = block_size and share = per_layer)");
      if (k == 0) {
        plan.evicted_blocks[l].insert(static_cast<std::size_t>(u));
        ++evicted_before;
      } else if (positions == Positions::renumbered && evicted_before > 0) {
        plan.rotations[l].push_back(
            {static_cast<std::size_t>(u - evicted_before), static_cast<std::size_t>(evicted_before * B)});
      }
    }
    detail::require(blocks == 0 || L % B == 0 || kept[static_cast<std::size_t>(blocks) - 1] > 0, where, "layer ", l,
                    " evicts its last, partial block ", blocks - 1,
                    ": OpenVINO GenAI frees whole blocks, and the sequence's next tokens fill its last one");
    detail::require(plan.evicted_blocks[l].size() == plan.evicted_blocks[0].size(), where,
                    "OpenVINO GenAI evicts as many blocks from every layer (the sequence has one length), but layer ",
                    l, " evicts ", plan.evicted_blocks[l].size(), " and layer 0 ", plan.evicted_blocks[0].size(),
                    " (select with a per-layer budget: a uniform or head-adaptive allocation)");
  }
  plan.evicted_tokens = plan.evicted_blocks[0].size() * static_cast<std::size_t>(B);
  plan.num_tokens = layers[0].length(0);
  return plan;
}

}  // namespace adapters
}  // namespace kvevict
