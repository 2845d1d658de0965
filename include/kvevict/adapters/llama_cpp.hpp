#pragma once
/// llama.cpp (docs/engines.md#llamacpp): a Selection as the memory calls of one sequence. llama.cpp's cells hold every
/// layer and KV head of one token and are addressed by (sequence, position) through llama.h:
///   llama_memory_seq_rm (mem, seq, p0, p1)         removes the sequence's cells at positions [p0, p1) (p1 < 0: to
///                                                   the end)
///   llama_memory_seq_add(mem, seq, p0, p1, delta)  adds delta to the positions in [p0, p1); a RoPE model's keys are
///                                                   re-rotated by each cell's accumulated delta at the next decode
///                                                   (the K-shift)
/// so only a selection with one set for every layer and KV head (share = per_model) fits; any other is refused.
/// A cell holds one position for every sequence that uses it (llama_memory_seq_cp shares a prefix's cells), so
/// shifting one sequence moves the others' too: renumber a sequence that shares cells only where its shared prefix
/// is kept whole and stays in place (Budget::protect_prefix with first = 0), or keep positions.
///
///   const auto plan = kvevict::adapters::llama_cpp_plan(kvevict::select_layers(policy, layers, budget));
///   for (const auto& r : plan.removes) llama_memory_seq_rm(mem, seq, r.p0, r.p1);
///   for (const auto& s : plan.shifts) llama_memory_seq_add(mem, seq, s.p0, s.p1, s.delta);
///   // the sequence's next token is at plan.next_position

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvevict/adapters/shared_set.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// The calls that turn one sequence's cells into a selection's (llama_pos is int32_t).
struct LlamaCppPlan {
  struct Remove {  ///< llama_memory_seq_rm(mem, seq, p0, p1)
    std::int32_t p0, p1;
  };
  struct Shift {  ///< llama_memory_seq_add(mem, seq, p0, p1, delta)
    std::int32_t p0, p1, delta;
  };
  std::vector<Remove> removes;  ///< disjoint, ascending; p1 == -1: every later position; call them first
  std::vector<Shift> shifts;    ///< Positions::renumbered only; call them after the removes, in this order
  Index kept = 0;               ///< cells the sequence keeps
  /// The position of the sequence's next token: first + kept when renumbered, else the last kept position + 1
  /// (llama.cpp requires a sequence's batch positions to continue from its largest position + 1).
  std::int32_t next_position = 0;
};

/// The plan that makes one sequence's cells hold what `layers` (the selections of the sequence's evicted layers, each
/// [Hkv] heads over the sequence's L cells, from select_layers with share = per_model) keep: removals of the ranges
/// of positions evicted (only where rows were evicted), then, when `positions` is renumbered, shifts that move the
/// kept cells to first, first + 1, ... (first >= 0). The positions are the selection's (LayerInputs::positions: the
/// cells' llama.cpp positions, ascending with the rows). Throws kvevict::invalid_argument when the heads or layers
/// keep different sets, or on positions outside [0, INT32_MAX].
inline LlamaCppPlan llama_cpp_plan(const std::vector<Selection>& layers, Positions positions = Positions::renumbered,
                                   std::int64_t first = 0) {
  const char* where = "adapters::llama_cpp_plan";
  const Selection& sel = detail::require_shared_set(layers, true, where);
  const std::vector<std::int64_t> p = detail::kept_positions(sel, where);
  const Selection::HeadIndices rows = sel.head(0);
  const std::int64_t max_pos = std::numeric_limits<std::int32_t>::max();
  const auto n = static_cast<std::int64_t>(p.size());
  detail::require(first >= 0 && first <= max_pos - n, where, "first (", first,
                  ") must be >= 0 and leave room for the kept cells below INT32_MAX (llama_pos)");
  detail::require(p.empty() || (p.front() >= 0 && p.back() < max_pos), where,
                  "positions must be in [0, INT32_MAX) (llama_pos), got ", p.empty() ? 0 : p.front(), " .. ",
                  p.empty() ? 0 : p.back());
  const auto pos = [](std::int64_t v) { return static_cast<std::int32_t>(v); };
  LlamaCppPlan plan;
  plan.kept = static_cast<Index>(n);
  // Removals: the positions between kept cells whose rows were evicted, before the first and after the last.
  if (n == 0) {
    if (sel.context_length() > 0) plan.removes.push_back({0, -1});
  } else {
    if (rows[0] > 0) plan.removes.push_back({0, pos(p[0])});
    for (Index i = 0; i + 1 < rows.size(); ++i)
      if (rows[i + 1] > rows[i] + 1)
        plan.removes.push_back({pos(p[static_cast<std::size_t>(i)] + 1), pos(p[static_cast<std::size_t>(i) + 1])});
    if (rows[rows.size() - 1] + 1 < sel.context_length()) plan.removes.push_back({pos(p.back() + 1), -1});
  }
  if (positions == Positions::kept) {
    plan.next_position = n == 0 ? pos(first) : pos(p.back() + 1);
    return plan;
  }
  // Shifts: each run of cells with one delta first + i - p[i] (consecutive positions) moves as one call. Deltas do not
  // increase along the cells; moving the runs that go down left to right, then those that go up right to left, no
  // call's range [p0, p1) ever holds another run's cells.
  std::vector<LlamaCppPlan::Shift> down, up;
  for (std::int64_t i = 0; i < n;) {
    const std::int64_t delta = first + i - p[static_cast<std::size_t>(i)];
    std::int64_t end = i + 1;
    while (end < n && first + end - p[static_cast<std::size_t>(end)] == delta) ++end;
    const LlamaCppPlan::Shift s{pos(p[static_cast<std::size_t>(i)]), pos(p[static_cast<std::size_t>(end) - 1] + 1),
                                pos(delta)};
    if (delta < 0) down.push_back(s);
    if (delta > 0) up.push_back(s);
    i = end;
  }
  plan.shifts = down;
  plan.shifts.insert(plan.shifts.end(), up.rbegin(), up.rend());
  plan.next_position = pos(first + n);
  return plan;
}

}  // namespace adapters
}  // namespace kvevict
