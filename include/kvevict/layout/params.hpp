#pragma once
/// The layout of a selection (docs/algorithms.md#layouts): which KV heads share one kept set, how their
/// scores are reduced to one, and whether whole blocks of rows are kept or evicted. Parameters of every policy.

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// Which KV heads keep one common set of tokens.
enum class Sharing {
  per_head,   ///< every KV head its own (the papers' setting, the default)
  per_layer,  ///< one set per layer for all its KV heads (paged engines: a page holds every head of a token)
  per_model   ///< one set for every head of every layer (one list of cells per sequence, as llama.cpp)
};

/// How the scores of the shared heads (and of a block's tokens) become one.
enum class Reduce {
  max,  ///< the worst case (DefensiveKV's argument), the default
  mean
};

/// The layout parameters (part of ScoringParams and of StreamingLLM::Params). The defaults give the per-head
/// selection of docs/algorithms.md#stages, docs/algorithms.md#ragged and docs/algorithms.md#streaming.
struct LayoutParams {
  Sharing share = Sharing::per_head;
  Reduce reduce = Reduce::max;
  Index block = 1;  ///< B, tokens per block: entries are kept or evicted in whole blocks of B rows (1: tokens)

  /// Whether this is the papers' layout (per-head token selection): nothing of docs/algorithms.md#layouts applies.
  bool per_head_tokens() const { return share == Sharing::per_head && block == 1; }
  void validate(const char* where) const {
    detail::require(block >= 1, where, "block must be >= 1 (tokens per block), got ", block);
  }
};

inline const char* to_string(Sharing s) {
  return s == Sharing::per_head ? "per_head" : s == Sharing::per_layer ? "per_layer" : "per_model";
}
inline const char* to_string(Reduce r) { return r == Reduce::max ? "max" : "mean"; }

}  // namespace kvevict
