#pragma once
/// TensorRT-LLM (docs/engines.md#tensorrt-llm): selections as the sparse KV prediction its PyTorch attention backend
/// takes after a context phase (RocketKV's prompt eviction: TrtllmAttention::sparse_kv_predict returns
/// sparse_kv_indices [num_kv_heads, total kept] and sparse_kv_offsets [num_contexts + 1], and the attention op
/// gathers each KV head's listed tokens to the front of the request's cache). Every KV head of a request keeps as many
/// tokens (the indices are one rectangular tensor), each head its own; positions stay as they were (keys are not
/// re-rotated). So a selection fits when its KV heads keep equal counts (uniform allocations, or any shared layout);
/// head-adaptive counts are refused.
///
///   std::vector<kvevict::Selection> batch;  // this layer's selection of every context request, in batch order
///   const auto kv = kvevict::adapters::tensorrt_llm_sparse_kv(batch);
///   return torch::from_blob(kv.indices.data(), {kv.kv_heads, kv.total}, int32), torch::from_blob(kv.offsets...)

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvevict/adapters/shared_set.hpp"
#include "kvevict/core/selection.hpp"

namespace kvevict {
namespace adapters {

/// One layer's sparse KV prediction for a batch of context requests (int32, as the attention op reads it).
struct TensorRtLlmSparseKv {
  std::vector<std::int32_t> indices;  ///< [kv_heads, total] row-major: head h's kept rows of request r at
                                      ///< [h * total + offsets[r], h * total + offsets[r + 1]), ascending
  std::vector<std::int32_t> offsets;  ///< [requests + 1]: request r's kept tokens per KV head start at offsets[r]
  Index kv_heads = 0;
  Index total = 0;  ///< kept tokens per KV head over the batch (offsets.back())
};

/// The sparse KV prediction that makes each request's cache of one layer hold what `requests` keep (one Selection
/// per context request of the batch, in batch order, each [Hkv] heads over that request's tokens). Throws
/// kvevict::invalid_argument when the requests' KV head counts differ, a request's KV heads keep different counts,
/// or an index does not fit int32.
inline TensorRtLlmSparseKv tensorrt_llm_sparse_kv(const std::vector<Selection>& requests) {
  const char* where = "adapters::tensorrt_llm_sparse_kv";
  detail::require(!requests.empty(), where, "needs the selections of the batch's context requests, got none");
  TensorRtLlmSparseKv out;
  out.kv_heads = requests[0].heads();
  out.offsets.push_back(0);
  std::int64_t total = 0;
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Selection& sel = requests[r];
    detail::require(sel.heads() == out.kv_heads, where, "request ", r, " has ", sel.heads(),
                    " KV heads, but request 0 has ", out.kv_heads);
    detail::require(sel.context_length() <= std::numeric_limits<std::int32_t>::max(), where, "request ", r, " holds ",
                    sel.context_length(), " tokens: more than int32 indices address");
    for (Index h = 1; h < sel.heads(); ++h)
      detail::require(sel.length(h) == sel.length(0), where,
                      "TensorRT-LLM keeps as many tokens in every KV head of a request (sparse_kv_indices is "
                      "[num_kv_heads, total]), but request ",
                      r, " KV head ", h, " keeps ", sel.length(h), " and KV head 0 keeps ", sel.length(0),
                      " (select with a uniform allocation, or share = per_layer)");
    total += sel.length(0);
    detail::require(total <= std::numeric_limits<std::int32_t>::max(), where,
                    "the batch keeps more tokens per KV head than int32 offsets address");
    out.offsets.push_back(static_cast<std::int32_t>(total));
  }
  out.total = static_cast<Index>(total);
  out.indices.reserve(static_cast<std::size_t>(out.kv_heads * out.total));
  for (Index h = 0; h < out.kv_heads; ++h)
    for (const Selection& sel : requests)
      for (const auto row : sel.head(h)) out.indices.push_back(static_cast<std::int32_t>(row));
  return out;
}

}  // namespace adapters
}  // namespace kvevict
