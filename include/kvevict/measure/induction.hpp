#pragma once
/// Stage "measure": which KV heads retrieve, from one calibration prefill (RazorAttention's induction score, arXiv
/// 2407.15891; docs/algorithms.md#retrieval-heads). The engine prefills a block of P random tokens repeated, then
/// names the heads that score highest in LayerInputs::retrieval_heads.

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict {

/// Induction scores [Hkv] of one layer prefilled with a block of `period` = P tokens repeated: the window's queries
/// (rows i = 0 .. w - 1 at positions t = L - w + i, all past the first copy: L - w >= P) attend, in an induction
/// head, to the token after the previous occurrence of their own token, position t - P + 1. For query head q,
///   s_q = (1 / w) sum over i of A[q][i, t - P + 1]        (A: the window's causal softmax rows over the L keys)
/// and KV head h scores the maximum of its G query heads' s_q (a KV head serves a retrieving query head if any of
/// its query heads retrieves). A fresh prefill only: every head holds the L entries at positions 0 .. L - 1 (lengths
/// and positions may be given, saying so). Either form of the observation (queries or attention rows). S: the
/// arithmetic type.
template <class S = float, class KV, class Q, class W>
std::vector<double> induction_scores(const LayerInputs<KV, Q, W>& in, Index period) {
  const char* where = "induction_scores";
  const bool has_q = in.queries.heads() * in.queries.rows() * in.queries.cols() > 0;
  const Index w = has_q ? in.queries.rows() : in.attention.rows();
  const extend::LayerShape shape = detail::validate_inputs(in, std::max<Index>(w, 1), where);
  for (Index h = 0; h < shape.kv_heads; ++h) {
    bool fresh = shape.length(h) == shape.tokens;
    for (Index j = 0; fresh && shape.positions.heads() > 0 && j < shape.tokens; ++j) fresh = shape.position(h, j) == j;
    detail::require(fresh, where, "the calibration reads a fresh prefill: every KV head holding the entries at ",
                    "positions 0 .. L - 1, got KV head ", h, " otherwise");
  }
  detail::require(period >= 1 && shape.tokens - w >= period, where, "period must be in [1, L - w] = [1, ",
                  shape.tokens - w, "] (the window inside a later copy of the block), got ", period);
  std::vector<double> per_query(static_cast<std::size_t>(shape.query_heads), 0.0);
  extend::WindowObservation<S, KV, Q> observation(in, shape, where);
  observation.for_each_head([&](Index q, const RowMatrix<S>& rows) {
    double sum = 0;
    for (Index i = 0; i < w; ++i) sum += static_cast<double>(rows(i, shape.tokens - w + i - period + 1));
    per_query[static_cast<std::size_t>(q)] = sum / static_cast<double>(w);
  });
  std::vector<double> out(static_cast<std::size_t>(shape.kv_heads), 0.0);
  for (Index q = 0; q < shape.query_heads; ++q) {
    double& h = out[static_cast<std::size_t>(q / shape.group)];
    h = std::max(h, per_query[static_cast<std::size_t>(q)]);
  }
  return out;
}

/// The `count` KV heads of the model with the highest scores (`scores[l]`: layer l's, [Hkv_l]; ties: the earlier
/// layer, then the lower head), as each layer's ascending list, the form of LayerInputs::retrieval_heads.
inline std::vector<std::vector<Index>> top_heads(const std::vector<std::vector<double>>& scores, Index count) {
  struct Head {
    double score;
    Index layer, head;
  };
  std::vector<Head> all;
  for (std::size_t l = 0; l < scores.size(); ++l)
    for (std::size_t h = 0; h < scores[l].size(); ++h) {
      detail::require(std::isfinite(scores[l][h]), "top_heads", "the score of layer ", l, ", KV head ", h,
                      " is not finite (", scores[l][h], ")");
      all.push_back({scores[l][h], static_cast<Index>(l), static_cast<Index>(h)});
    }
  detail::require(count >= 0 && count <= static_cast<Index>(all.size()), "top_heads", "count must be in [0, ",
                  all.size(), "] (the model's KV heads), got ", count);
  std::stable_sort(all.begin(), all.end(), [](const Head& a, const Head& b) { return a.score > b.score; });
  std::vector<std::vector<Index>> out(scores.size());
  for (Index i = 0; i < count; ++i)
    out[static_cast<std::size_t>(all[static_cast<std::size_t>(i)].layer)].push_back(
        all[static_cast<std::size_t>(i)].head);
  for (auto& heads : out) std::sort(heads.begin(), heads.end());
  return out;
}

}  // namespace kvevict
