#pragma once
/// vLLM (docs/engines.md#vllm): a Selection as one request's block-table edit. vLLM's paged cache holds, per layer,
/// [num_blocks, block_size, Hkv, d] keys and values; a request's token i lives in physical block
/// block_table[i / block_size], offset i % block_size (slot = block * block_size + offset), and every layer of a KV
/// cache group shares the request's one block table. So a selection fits when every KV head of the group's layers
/// keeps one set (share = per_model over the group; per_layer where each layer is its own group); any other is
/// refused.
///
///   const auto plan = kvevict::adapters::vllm_plan(kvevict::select_layers(policy, layers, budget), block_table, 16);
///   for (const auto& c : plan.copies) copy c.count slots from c.src_slot to c.dst_slot, every layer, K and V
///   for (const auto& r : plan.rotations) rotate the keys of slots [r.slot, r.slot + r.count) by r.delta positions
///   request.block_table = plan.block_table; release plan.freed_blocks; request length = plan.num_tokens

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/adapters/shared_set.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// One request's block-table edit.
struct VllmPlan {
  /// count consecutive slots from src_slot to dst_slot, every layer, keys and values; each run lies in one block, and
  /// where it overlaps itself (dst_slot < src_slot) it copies in ascending order, as memmove does
  struct Copy {
    std::int64_t src_slot, dst_slot, count;
  };
  struct Rotation {  ///< the keys in slots [slot, slot + count) (one block) turn by delta positions (renumbered)
    std::int64_t slot, count, delta;
  };
  std::vector<std::int64_t> block_table;   ///< the request's new table: ceil(num_tokens / block_size) physical ids
  std::vector<std::int64_t> freed_blocks;  ///< the old table's ids the request no longer uses (release them)
  std::vector<Copy> copies;                ///< in this order (safe in place: no copy reads a slot an earlier wrote)
  std::vector<Rotation> rotations;         ///< Positions::renumbered only; after the copies, on the new slots
  Index num_tokens = 0;                    ///< tokens the request keeps: new token j is at table[j / B], j % B
  /// The position of the request's next token: first + num_tokens when renumbered, else the last kept position + 1
  /// (its positions then run ahead of its token count by next_position - num_tokens).
  std::int64_t next_position = 0;
  bool table_only = false;  ///< the kept rows were whole blocks: no copies, the table only drops and reorders ids
};

/// The edit that makes a request's paged cache hold what `layers` keep (the selections of the layers of one KV cache
/// group, each [Hkv] heads over the request's L tokens in order, one set for the whole group), given the request's
/// `block_table` (physical ids, ceil(L / block_size) of them) and the engine's `block_size`.
/// - When the kept rows are whole blocks of the engine's (every group of kept rows in one block starts at its offset
///   0 and fills it, except the last group: select with block = block_size), the new table lists those blocks in
///   order and nothing moves (table_only).
/// - Otherwise the kept rows are compacted in place into the request's first ceil(num_tokens / block_size) blocks:
///   new token j moves from its old slot to slot j of the old table (copies in ascending j, runs split at block
///   boundaries, rows already in place omitted), and the old table's later blocks are freed.
/// With Positions::renumbered, new token j takes position first + j, and `rotations` turn each moved key by
/// first + j - its original position (the selection's positions: LayerInputs::positions).
/// `shared_blocks`: the table's first blocks other requests also use (prefix caching); they are never written nor
/// freed, so each of their rows must be kept (Budget::protect_prefix(shared_blocks * block_size)).
/// Throws kvevict::invalid_argument when the heads or layers keep different sets, the table does not cover the
/// request's tokens, or a shared block loses a row.
inline VllmPlan vllm_plan(const std::vector<Selection>& layers, const std::vector<std::int64_t>& block_table,
                          Index block_size, Positions positions = Positions::renumbered, std::int64_t first = 0,
                          Index shared_blocks = 0) {
  const char* where = "adapters::vllm_plan";
  const Selection& sel = detail::require_shared_set(layers, true, where);
  const std::vector<std::int64_t> p = detail::kept_positions(sel, where);
  const Selection::HeadIndices rows = sel.head(0);
  const Index L = sel.context_length(), B = block_size;
  detail::require(B >= 1, where, "block_size must be >= 1, got ", B);
  const Index blocks = (L + B - 1) / B;
  detail::require(static_cast<Index>(block_table.size()) == blocks, where, "block_table holds ", block_table.size(),
                  " blocks, but the request's ", L, " tokens in blocks of ", B, " need ", blocks);
  for (std::size_t i = 0; i < block_table.size(); ++i)
    detail::require(block_table[i] >= 0, where, "block_table[", i, "] must be >= 0, got ", block_table[i]);
  const auto [first_of, repeat] = detail::first_repeat(block_table);
  detail::require(repeat == block_table.size(), where, "block_table[", first_of, "] and [", repeat,
                  "] are the same block (", repeat < block_table.size() ? block_table[repeat] : 0, ")");
  detail::require(shared_blocks >= 0 && shared_blocks <= blocks, where, "shared_blocks must be in [0, ", blocks,
                  "], got ", shared_blocks);
  const Index n = rows.size();
  const Index shared_rows = std::min(shared_blocks * B, L);
  for (Index j = 0; j < shared_rows; ++j)
    detail::require(j < n && rows[j] == j, where, "row ", j, " of shared block ", j / B, " (physical ",
                    block_table[static_cast<std::size_t>(j / B)],
                    ", used by other requests) is evicted: protect the shared prefix (Budget::protect_prefix(",
                    shared_rows, "))");
  detail::require(first >= 0, where, "first must be >= 0, got ", first);
  if (positions == Positions::renumbered)
    for (Index j = 0; j < shared_rows; ++j)
      detail::require(first + j == p[static_cast<std::size_t>(j)], where, "renumbering from first = ", first,
                      " would turn the keys of shared block ", j / B, " (row ", j, " at position ",
                      p[static_cast<std::size_t>(j)], " -> ", first + j,
                      "), which other requests read: renumber from the shared prefix's own positions");

  VllmPlan plan;
  plan.num_tokens = n;
  plan.next_position = positions == Positions::renumbered ? first + n : n == 0 ? first : p.back() + 1;
  const Index kept_blocks = (n + B - 1) / B;
  // Whole blocks: kept row j's group (its old block) starts at offset 0 and runs on without a gap; every group but
  // the last fills its block.
  bool whole = true;
  for (Index j = 0; j < n && whole; ++j) {
    const Index offset = j % B;  // the row's place in its new block, and in its old one when whole
    whole = rows[j] % B == offset && (offset == 0 || rows[j] == rows[j - 1] + 1);
  }
  plan.table_only = whole;
  std::vector<char> used(block_table.size(), 0);
  if (whole) {
    for (Index k = 0; k < kept_blocks; ++k) {
      const auto u = static_cast<std::size_t>(rows[k * B] / B);
      plan.block_table.push_back(block_table[u]);
      used[u] = 1;
    }
  } else {
    for (Index k = 0; k < kept_blocks; ++k) {
      plan.block_table.push_back(block_table[static_cast<std::size_t>(k)]);
      used[static_cast<std::size_t>(k)] = 1;
    }
  }
  for (std::size_t u = 0; u < block_table.size(); ++u)
    if (!used[u]) plan.freed_blocks.push_back(block_table[u]);

  const auto slot = [&](const std::vector<std::int64_t>& table, Index row) {
    return table[static_cast<std::size_t>(row / B)] * B + row % B;
  };
  // Copies: new token j from old row rows[j], as runs of consecutive rows inside one old and one new block.
  if (!whole) {
    for (Index j = 0; j < n;) {
      if (rows[j] == j) {
        ++j;
        continue;
      }
      Index end = j + 1;
      while (end < n && rows[end] == rows[end - 1] + 1 && end % B != 0 && rows[end] % B != 0) ++end;
      plan.copies.push_back({slot(block_table, rows[j]), slot(plan.block_table, j), end - j});
      j = end;
    }
  }
  // Rotations: runs of one delta inside one new block.
  if (positions == Positions::renumbered) {
    for (Index j = 0; j < n;) {
      const std::int64_t delta = first + j - p[static_cast<std::size_t>(j)];
      Index end = j + 1;
      while (end < n && end % B != 0 && first + end - p[static_cast<std::size_t>(end)] == delta) ++end;
      if (delta != 0) plan.rotations.push_back({slot(plan.block_table, j), end - j, delta});
      j = end;
    }
  }
  return plan;
}

}  // namespace adapters
}  // namespace kvevict
