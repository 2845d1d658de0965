#pragma once
/// Stage "window attention" (docs/algorithms.md#window-attention) over many queries: the attention each entry has
/// received (H2O's heavy-hitter score, docs/algorithms.md#h2o), from one observation, or added step by step into scores
/// an engine keeps.

#include <string>

#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {
inline namespace KVEVICT_ABI_NAMESPACE {

/// received [Hkv, L]: received(h, j) = (1 / G) sum over the G query heads g of group h and the observation's rows i
/// of A[hG + g][i, j], the attention entry j of KV head h received from the observed queries, averaged over the
/// group (entries beyond a ragged head's L_h: 0). Sums in row order, query heads in order: deterministic.
template <class S, class KV, class Q>
RowMatrix<S> attention_received(const WindowObservation<S, KV, Q>& obs) {
  const LayerShape& shape = obs.shape();
  RowMatrix<S> received = RowMatrix<S>::Zero(shape.kv_heads, shape.tokens);
  obs.for_each_head([&](Index q, const RowMatrix<S>& rows) {  // writes row q / G only (heads run concurrently)
    received.row(q / shape.group).head(rows.cols()) += rows.colwise().sum();
  });
  return received / static_cast<S>(shape.group);
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::extend

namespace kvevict {
inline namespace KVEVICT_ABI_NAMESPACE {

/// Adds to `scores` [Hkv, >= L_h, 1] (entry j of KV head h at scores.row(h, j)) the attention received from the
/// c queries of one step (extend::attention_received), so that scores carried across steps hold everything every
/// query paid each entry (H2O). `step` describes the layer as any select() input (keys, lengths, positions; values
/// and w_o are not read) with either
///   queries   [H, c, head_dim] the post-RoPE queries of each head's last c entries (the step's tokens), or
///   attention [H, c, >= L_h]   their softmax rows,
/// 1 <= c <= L_h: on the first step (an empty cache) c may be every entry. Each query sees the entries before it
/// and itself (causal inside the step). S is the arithmetic type; the sums are rounded to float once, when added.
/// Throws kvevict::invalid_argument, changing nothing, on a bad shape or NaN / Inf inputs.
template <class S = float, class KV, class Q, class W>
void accumulate_attention(const LayerInputs<KV, Q, W>& step, const HeadsView<float>& scores,
                          const char* where = "accumulate_attention") {
  const bool has_q = step.queries.heads() * step.queries.rows() * step.queries.cols() > 0;
  const bool has_a = step.attention.heads() * step.attention.rows() * step.attention.cols() > 0;
  detail::require(has_q != has_a, where,
                  "exactly one of queries [H, c, head_dim] and attention [H, c, L] must be given, got ",
                  has_q ? "both" : "neither");
  extend::LayerShape shape = detail::read_entries(step, where);
  shape.window = has_q ? step.queries.rows() : step.attention.rows();
  for (Index h = 0; h < shape.kv_heads; ++h)
    detail::require(shape.window <= shape.length(h), where, "the step's ", shape.window,
                    " queries must be the last entries of every KV head, but KV head ", h, " holds ", shape.length(h));
  shape.prefix = shape.tokens - shape.window;
  detail::validate_observation(step, has_q, shape, where);
  detail::require_scale(step.keys_scale, is_quantized_v<KV>, shape, "keys", where);
  detail::require(scores.heads() == shape.kv_heads && scores.rows() >= shape.tokens && scores.cols() == 1, where,
                  "scores [", scores.heads(), ", ", scores.rows(), ", ", scores.cols(),
                  "] must be [kv_heads = ", shape.kv_heads, ", >= ", shape.tokens, " entries, 1]");
  const RowMatrix<S> received = extend::attention_received(extend::observe<S>(step, shape, where));
  for (Index h = 0; h < shape.kv_heads; ++h)
    for (Index j = 0; j < shape.length(h); ++j) *scores.row(h, j) += static_cast<float>(received(h, j));
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict
