#pragma once
/// The rule of docs/algorithms.md#streaming, "evict now": after each step, every layer holding more than its budget
/// is evicted to it (a layer-global policy: all layers, when the model holds more than its budget).

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/core/budget.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/policy/contracts.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/stream/cache_book.hpp"

namespace kvevict {

namespace detail {
/// Whether P selects every layer at once: a layer-global policy, a scheduled allocation (PyramidKV: each layer's
/// share of the model budget), or any policy with share = per_model.
template <class P>
bool selects_model(const P& policy) {
  if constexpr (is_layer_global<P>::value)
    return true;
  else if constexpr (is_scheduled<P>::value)
    return true;
  else
    return policy.params().share == Sharing::per_model;
}
}  // namespace detail

/// The most entries per KV head on average a layer holds while the cache grows in steps of `step` tokens under a
/// budget of `n` tokens per KV head (n + p with a protected prefix kept on top), for a policy whose window is
/// `window` (docs/algorithms.md#streaming): n + step * ceil(window / step), n + step when step >= window (n + w when
/// decoding one token at a time). An average over the layer's KV heads (a layer-global policy: the model's); one
/// head of a head-adaptive or layer-global allocation can hold more.
inline Index stream_capacity(Index n, Index step, Index window) {
  detail::require(n >= 1 && step >= 1 && window >= 0, "stream_capacity",
                  "needs n >= 1, step >= 1 and window >= 0, got n ", n, ", step ", step, ", window ", window);
  return n + step * std::max<Index>(1, (window + step - 1) / step);
}

/// Ends the current step of `book` (the tokens appended since the last call) under a budget of `n` tokens per KV
/// head on average: every layer holding more than Hkv * n entries is evicted to Budget::tokens(n) with `policy`
/// (for a layer-global policy or share = per_model: every layer, when the model holds more than the sum of
/// Hkv * n). Returns how many layers were evicted. Not yet: while a layer is over budget but the step holds fewer
/// tokens than the policy's window, nothing is evicted and the step goes on (0 is returned, book.step() keeps
/// counting): an engine may call it after every decoded token, and evicts every w tokens
/// (stream_capacity(n, 1, w) entries per KV head on average at most; one head of a head-adaptive or layer-global
/// allocation can hold more, so size the book's capacity for the fullest head).
///   inputs_of(l) -> LayerInputs of layer l: keys and values viewing the engine's capacity rows, the step's last w
///                   queries (or attention rows over each head's entries), w_o; the book adds lengths and positions.
///   apply(l, selection) compacts the engine's storage, normally book.layer(l).apply(selection, keys, values).
/// Every selection is made before any is applied: on an error (kvevict::invalid_argument, e.g. queries that are not
/// the window's) nothing is evicted. S is the arithmetic type. The engine keeps the queries of the step's tokens
/// until the step holds w of them (the window is the step's last w queries).
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, Index n, Inputs&& inputs_of, Apply&& apply) {
  return evict_over_budget<S>(policy, book, Budget::tokens(n), std::forward<Inputs>(inputs_of),
                              std::forward<Apply>(apply));
}

/// The same under a token budget with a protected prefix (Budget::tokens(n).protect_prefix(p, counting),
/// docs/algorithms.md#protected-prefix): the prefix is never evicted; a layer is over budget when it holds more than
/// Hkv * n entries, or Hkv * (n + p) when the prefix is kept on top (PrefixBudget::extra).
template <class S = float, class P, class Inputs, class Apply>
Index evict_over_budget(const P& policy, CacheBook& book, const Budget& budget, Inputs&& inputs_of, Apply&& apply) {
  const std::string where = policy.name() + "::evict_over_budget";
  detail::require(budget.kind() == Budget::Kind::tokens, where.c_str(),
                  "a cache that grows is evicted to a token budget (Budget::tokens), got a ratio or a threshold");
  const auto n = static_cast<Index>(budget.value()) + static_cast<Index>(budget.extra());
  const bool model_wide = detail::selects_model(policy);
  std::vector<Index> due;
  for (Index l = 0; l < book.layers(); ++l)  // a layer kept whole is never due (docs/algorithms.md#hybrid-models)
    if (book.evicts(l) && (model_wide ? book.over_budget(n) : book.layer(l).over_budget(n)))
      due.push_back(l);  // model: every evicted layer or none
  if (due.empty()) {
    book.end_step();
    return 0;
  }
  const Index window = policy.params().window;  // 0 for a positional policy (StreamingLLM)
  if (book.step() < window) return 0;           // not yet: the window is the step's last w queries
  std::vector<Selection> selections;
  if (model_wide) {
    auto plan = policy.template plan<S>(budget, book.evicted_layers());  // every evicted layer is due, in order
    for (Index l : due) plan.add(book.layer(l).describe(inputs_of(l)));
    selections = plan.apply();
  } else {
    for (Index l : due)
      selections.push_back(policy.template select<S>(book.layer(l).describe(inputs_of(l)), budget, l));
  }
  for (std::size_t i = 0; i < due.size(); ++i) apply(due[i], selections[i]);
  book.end_step(static_cast<Index>(due.size()));
  return static_cast<Index>(due.size());
}

}  // namespace kvevict
