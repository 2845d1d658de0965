#pragma once
/// What every engine adapter (docs/engines.md) starts from: the one set of entries a sequence keeps when the engine
/// stores every KV head of a token together (llama.cpp's cells, vLLM's and SGLang's pages and slots), and whether
/// the engine renumbers the kept positions.

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// What happens to the RoPE positions of the kept entries.
enum class Positions {
  kept,       ///< each entry keeps its position; the next token continues at the engine's own next position
  renumbered  ///< kept entries are renumbered first, first + 1, ... in order and their keys re-rotated by the delta
};

inline const char* to_string(Positions p) { return p == Positions::kept ? "kept" : "renumbered"; }

namespace detail {

using kvevict::detail::require;

/// The sets of `a` head ha and `b` head hb (kept rows and their positions) are the same.
inline bool same_set(const Selection& a, Index ha, const Selection& b, Index hb) {
  const Selection::HeadIndices ra = a.head(ha), rb = b.head(hb);
  const Selection::HeadIndices pa = a.head_positions(ha), pb = b.head_positions(hb);
  if (ra.size() != rb.size()) return false;
  for (Index i = 0; i < ra.size(); ++i)
    if (ra[i] != rb[i] || pa[i] != pb[i]) return false;
  return true;
}

/// Checks that every KV head of `layer` keeps the same rows at the same positions, the form of an engine whose
/// storage unit (a cell, a page, a slot) holds every KV head of a token; `sharing` names the layout that selects it.
inline void require_one_set_per_layer(const Selection& layer, std::size_t l, const char* where, const char* sharing) {
  require(layer.heads() >= 1, where, "layer ", l, " has no KV heads");
  for (Index h = 1; h < layer.heads(); ++h)
    require(same_set(layer, h, layer, 0), where, "the engine stores every KV head of a token together, but layer ", l,
            " KV head ", h, " keeps other entries than its KV head 0 (select with share = ", sharing, ")");
}

/// Checks that every layer of `layers` keeps one set for all its KV heads and, when `across_layers`, that every
/// layer keeps layer 0's set (the engine's unit is shared by every layer too). Returns layer 0's selection.
inline const Selection& require_shared_set(const std::vector<Selection>& layers, bool across_layers,
                                           const char* where) {
  require(!layers.empty(), where, "needs the selections of the sequence's layers, got none");
  const char* sharing = across_layers ? "per_model" : "per_layer";
  for (std::size_t l = 0; l < layers.size(); ++l) {
    require(layers[l].context_length() == layers[0].context_length(), where, "layer ", l, " holds ",
            layers[l].context_length(), " entries, but layer 0 holds ", layers[0].context_length(),
            " (one sequence has one length in every layer)");
    require_one_set_per_layer(layers[l], l, where, sharing);
    if (across_layers && l > 0)
      require(same_set(layers[l], 0, layers[0], 0), where,
              "the engine stores every layer of a token together, but layer ", l,
              " keeps other entries than layer 0 (select with share = per_model)");
  }
  return layers.front();
}

/// The first repeat in `ids` (an engine's block or slot ids): {i, j} with i < j, ids[i] == ids[j] and j the
/// smallest such (i the first index of that id); {n, n} when every id is distinct. O(n log n).
inline std::pair<std::size_t, std::size_t> first_repeat(const std::vector<std::int64_t>& ids) {
  std::unordered_map<std::int64_t, std::size_t> seen;
  seen.reserve(ids.size());
  for (std::size_t j = 0; j < ids.size(); ++j) {
    const auto [at, inserted] = seen.emplace(ids[j], j);
    if (!inserted) return {at->second, j};
  }
  return {ids.size(), ids.size()};
}

/// Head 0's kept positions of `sel`, checked ascending and distinct (what an engine that addresses entries by
/// position needs).
inline std::vector<std::int64_t> kept_positions(const Selection& sel, const char* where) {
  const Selection::HeadIndices p = sel.head_positions(0);
  std::vector<std::int64_t> out(p.begin(), p.end());
  for (std::size_t i = 1; i < out.size(); ++i)
    require(out[i] > out[i - 1], where, "positions must be distinct and ascending with the rows, got ", out[i - 1],
            " then ", out[i], " (LayerInputs::positions)");
  return out;
}

}  // namespace detail
}  // namespace adapters
}  // namespace kvevict
