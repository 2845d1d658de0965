#pragma once
/// The value term's engine-facing types: ValueNorm, the W_o view per query head (output_projection) and the
/// per-head Gram matrices an engine can precompute once per model layer (OutputGram, LayerInputs::w_o_gram).

#include <cstddef>
#include <type_traits>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

enum class ValueNorm {
  l1,  ///< || v W^T ||_1, the papers' code: a blocked [L, d] x [d, D] product with a fused |.|-sum, O(L d D)
  l2   ///< || v W^T ||_2 = sqrt(v (W^T W) v^T) through the per-head Gram matrix W^T W [d, d], O(L d^2)
};

inline const char* to_string(ValueNorm n) { return n == ValueNorm::l1 ? "l1" : "l2"; }

/// W_o [D, H * head_dim] in the PyTorch Linear layout (out = concat_heads(attn) W_o^T), seen per query head q as
/// the column block W_o^q [D, head_dim]: heads = H, rows = D, cols = head_dim, head_stride = head_dim,
/// row_stride = the row pitch of W_o (H * head_dim when dense). No copy.
template <class T>
HeadsView<T> output_projection(T* data, Index hidden, Index query_heads, Index head_dim) {
  return HeadsView<T>(data, query_heads, hidden, head_dim, head_dim, query_heads * head_dim);
}

/// Per-head Gram matrices of W_o, G_q = (W_o^q)^T W_o^q [head_dim, head_dim], precomputed once per model and layer
/// for the L2 value norm.
template <class S>
struct OutputGram {
  std::vector<RowMatrix<S>> per_head;  // [H] of [head_dim, head_dim]

  Index heads() const { return static_cast<Index>(per_head.size()); }

  /// The same matrices in another scalar type.
  template <class U>
  OutputGram<U> cast() const {
    OutputGram<U> out;
    for (const RowMatrix<S>& g : per_head) out.per_head.push_back(g.template cast<U>());
    return out;
  }

  /// One Gram matrix per query head, made once per model layer (single-threaded: OutputGram is plain data shared
  /// by translation units of either threading mode).
  template <class T>
  static OutputGram compute(const HeadsView<const T>& w_o) {
    OutputGram g;
    g.per_head.resize(static_cast<std::size_t>(w_o.heads()));
    for (Index q = 0; q < w_o.heads(); ++q) {
      RowMatrix<S>& G = g.per_head[static_cast<std::size_t>(q)];
      G.setZero(w_o.cols(), w_o.cols());
      // W^T W is symmetric: a rank update of the lower triangle (half the FLOPs of a full product), mirrored.
      if constexpr (std::is_same_v<std::remove_const_t<T>, S>) {
        G.template selfadjointView<Eigen::Lower>().rankUpdate(w_o.head(q).transpose());
      } else {
        const RowMatrix<S> w = w_o.head(q).template cast<S>();
        G.template selfadjointView<Eigen::Lower>().rankUpdate(w.transpose());
      }
      G.template triangularView<Eigen::StrictlyUpper>() = G.transpose();
    }
    return g;
  }
};
}  // namespace kvevict
