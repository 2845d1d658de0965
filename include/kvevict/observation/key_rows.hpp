#pragma once
/// The keys of a layer as arithmetic rows, for scorers that read the keys alone (K-norm, KeyDiff: docs/algorithms.md
/// section 2.8): each KV head's live entries in cache-sized blocks, dequantized or converted exactly as the window
/// attention reads them, so every storage type holding the same values scores alike.

#include <algorithm>

#include "kvevict/core/convert.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/observation/window_attention.hpp"

namespace kvevict::extend {

/// Calls f(h, j0, rows) for every KV head h and every block [j0, j0 + n) of its entries [0, L_h): rows [n, d] in S
/// (n <= 256; reused between calls).
template <class S, class In, class F>
void for_each_key_block(const In& in, const LayerShape& shape, F&& f) {
  RowMatrix<S> rows;
  for (Index h = 0; h < shape.kv_heads; ++h) {
    const detail::RowScale scale = detail::row_scale(in.keys_scale, h);
    for (Index j0 = 0; j0 < shape.length(h); j0 += detail::kKeyBlock) {
      const Index n = std::min(detail::kKeyBlock, shape.length(h) - j0);
      detail::read_rows<S>(in.keys.head(h).middleRows(j0, n), scale.from(j0), rows);
      f(h, j0, static_cast<const RowMatrix<S>&>(rows));
    }
  }
}

}  // namespace kvevict::extend
