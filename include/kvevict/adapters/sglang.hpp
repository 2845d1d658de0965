#pragma once
/// SGLang (docs/engines.md#sglang): a Selection as one request's token map edit. SGLang's token pool holds, per
/// layer, keys and values [pool size, Hkv, d], one slot per token (page size 1); a request's token i lives in slot
/// req_to_token[req, i], and every layer reads the same map. So a selection fits when every layer and KV head keeps
/// one set (share = per_model); any other is refused. Nothing moves: the map keeps the kept tokens' slots in order,
/// and the evicted tokens' slots go back to the allocator.
///
///   const auto plan = kvevict::adapters::sglang_plan(kvevict::select_layers(policy, layers, budget), slots);
///   req_to_token[req, :plan.num_tokens] = plan.slots; token_to_kv_pool_allocator.free(plan.freed_slots)
///   for (const auto& r : plan.rotations) rotate the keys of slots [r.slot, r.slot + r.count) by r.delta positions

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/adapters/shared_set.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// One request's token map edit.
struct SGLangPlan {
  struct Rotation {  ///< the keys in slots [slot, slot + count) turn by delta positions (renumbered)
    std::int64_t slot, count, delta;
  };
  std::vector<std::int64_t> slots;        ///< the request's new map: the kept tokens' slots, in order [num_tokens]
  std::vector<std::int64_t> freed_slots;  ///< the evicted tokens' slots the request owns (free them)
  std::vector<Rotation> rotations;        ///< Positions::renumbered only
  Index num_tokens = 0;                   ///< tokens the request keeps
  /// The position of the request's next token: first + num_tokens when renumbered, else the last kept position + 1
  /// (its positions then run ahead of its token count by next_position - num_tokens).
  std::int64_t next_position = 0;
};

/// The edit that makes a request's token map hold what `layers` keep (the selections of every layer, each [Hkv] heads
/// over the request's L tokens in order, one set for all), given `slots` = req_to_token[req, :L], the request's
/// slots. `shared_tokens`: the map's first tokens the radix cache holds (a cached prefix other requests may read);
/// their slots are never freed (an evicted one only leaves the request's map) and never rotated (renumbering must
/// leave the kept ones at their positions). With Positions::renumbered the kept tokens take positions first,
/// first + 1, ... and `rotations` turn each key by its new minus its original position (the selection's positions:
/// LayerInputs::positions). Throws kvevict::invalid_argument when the heads or layers keep different sets, the slots
/// do not match the request's tokens, or a shared slot would turn.
inline SGLangPlan sglang_plan(const std::vector<Selection>& layers, const std::vector<std::int64_t>& slots,
                              Positions positions = Positions::renumbered, std::int64_t first = 0,
                              Index shared_tokens = 0) {
  const char* where = "adapters::sglang_plan";
  const Selection& sel = detail::require_shared_set(layers, true, where);
  const std::vector<std::int64_t> p = detail::kept_positions(sel, where);
  const Selection::HeadIndices rows = sel.head(0);
  const Index L = sel.context_length();
  detail::require(static_cast<Index>(slots.size()) == L, where, "slots holds ", slots.size(),
                  " entries, but the request has ", L, " tokens (req_to_token[req, :L])");
  for (std::size_t i = 0; i < slots.size(); ++i)
    detail::require(slots[i] >= 0, where, "slots[", i, "] must be >= 0, got ", slots[i]);
  const std::size_t repeat = detail::first_repeat(slots).second;
  detail::require(repeat == slots.size(), where, "slot ", repeat < slots.size() ? slots[repeat] : 0,
                  " appears twice in slots (each token has its own slot)");
  detail::require(shared_tokens >= 0 && shared_tokens <= L, where, "shared_tokens must be in [0, ", L, "], got ",
                  shared_tokens);
  detail::require(first >= 0, where, "first must be >= 0, got ", first);
  const Index n = rows.size();
  SGLangPlan plan;
  plan.num_tokens = n;
  plan.next_position = positions == Positions::renumbered ? first + n : n == 0 ? first : p.back() + 1;
  std::vector<char> kept(slots.size(), 0);
  for (Index j = 0; j < n; ++j) {
    const auto r = static_cast<std::size_t>(rows[j]);
    kept[r] = 1;
    plan.slots.push_back(slots[r]);
  }
  for (std::size_t r = static_cast<std::size_t>(shared_tokens); r < slots.size(); ++r)
    if (!kept[r]) plan.freed_slots.push_back(slots[r]);
  if (positions == Positions::kept) return plan;
  // Rotations: runs of consecutive slots with one delta.
  for (Index j = 0; j < n;) {
    const std::int64_t delta = first + j - p[static_cast<std::size_t>(j)];
    detail::require(
        delta == 0 || rows[j] >= shared_tokens, where, "renumbering from first = ", first,
        " would turn the key of shared token ", rows[j], " (slot ", plan.slots[static_cast<std::size_t>(j)],
        ", position ", p[static_cast<std::size_t>(j)], " -> ", first + j,
        "), which the radix cache holds for other requests: keep the shared prefix (Budget::protect_prefix(",
        shared_tokens, ")) or keep positions (Positions::kept)");
    Index end = j + 1;
    while (end < n && first + end - p[static_cast<std::size_t>(end)] == delta &&
           plan.slots[static_cast<std::size_t>(end)] == plan.slots[static_cast<std::size_t>(end) - 1] + 1 &&
           rows[end] >= shared_tokens)
      ++end;
    if (delta != 0) plan.rotations.push_back({plan.slots[static_cast<std::size_t>(j)], end - j, delta});
    j = end;
  }
  return plan;
}

}  // namespace adapters
}  // namespace kvevict
