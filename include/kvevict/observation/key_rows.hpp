#pragma once
/// The keys (or values) of a layer as arithmetic rows, for scorers that read the cache without a window attention
/// (K-norm, KeyDiff, Expected Attention: docs/algorithms.md#key-only and docs/algorithms.md#expected-attention): each
/// KV head's live entries in cache-sized blocks, dequantized or converted exactly as the window attention reads them,
/// so every storage type holding the same values scores alike.

#include <algorithm>

#include "kvevict/core/convert.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {

/// Calls f(j0, rows) for every block [j0, j0 + n) of rows [0, length) of head h of `view` (keys or values, read
/// through `scale` when quantized): rows [n, d] in S (n <= 256; reused between calls).
template <class S, class T, class F>
void for_each_block_of_head(const KVView<const T>& view, const KVScale& scale, Index h, Index length, F&& f) {
  RowMatrix<S> rows;
  const detail::HeadRows<T> head = detail::head_rows(view, h, length, scale);
  for (Index j0 = 0; j0 < length; j0 += detail::kKeyBlock) {
    const Index n = std::min(detail::kKeyBlock, length - j0);
    detail::read_block<S>(head, j0, n, rows);
    f(j0, static_cast<const RowMatrix<S>&>(rows));
  }
}

/// Calls f(h, j0, rows) for every KV head h and every block [j0, j0 + n) of its entries [0, L_h) of `view`.
template <class S, class T, class F>
void for_each_entry_block(const KVView<const T>& view, const KVScale& scale, const LayerShape& shape, F&& f) {
  for (Index h = 0; h < shape.kv_heads; ++h)
    for_each_block_of_head<S>(view, scale, h, shape.length(h),
                              [&](Index j0, const RowMatrix<S>& rows) { f(h, j0, rows); });
}

/// The keys of the layer: for_each_entry_block over in.keys.
template <class S, class In, class F>
void for_each_key_block(const In& in, const LayerShape& shape, F&& f) {
  for_each_entry_block<S>(in.keys, in.keys_scale, shape, f);
}

}  // namespace kvevict::extend
