#pragma once
/// Stage "forcing", retrieval heads (docs/algorithms.md#retrieval-heads): the KV heads an engine names in
/// LayerInputs::retrieval_heads (RazorAttention, arXiv 2407.15891; DuoAttention, arXiv 2410.10819) are kept whole
/// where the budget allows: every entry of each enters the forced tier, before any scored entry of any head.

#include <vector>

#include "kvevict/ranking/score_map.hpp"

namespace kvevict::detail {

/// Promotes every entry of the KV heads `heads` of `map` [Hkv, L] to Tier::forced (entries in a higher tier, the
/// window or the protected prefix, stay there). A forced entry keeps its score: forced entries rank among
/// themselves by it when the budget cannot hold them all.
template <class S>
void force_retrieval_heads(extend::ScoreMap<S>& map, const std::vector<Index>& heads) {
  for (Index h : heads)
    for (Index j = 0; j < map.length(h); ++j) map.promote(h, j, extend::Tier::forced);
}

}  // namespace kvevict::detail
