#pragma once
/// Stage "value term" (docs/algorithms.md#value-term; CriticalKV, arXiv 2502.03805): how much evicting a token
/// perturbs the layer output,
/// || V[h][j, :] (W_o^q)^T ||_p over the D output dimensions, averaged over the query heads of each group.

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kvevict/core/convert.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/parallel.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/value/output_gram.hpp"

namespace kvevict::detail {

/// Rows per product of the L1 term (value_norms; value_bound.hpp computes chosen rows at the same slots).
constexpr Index kL1Block = 128;

/// proj = rows [n, d] x w^T [d, D] with Eigen's matrix-product kernel whatever n: a single row is computed as the
/// first of two (the second zero), since Eigen would take its matrix-vector path for it, which rounds otherwise.
/// Then a row's result depends only on its values, n and its slot in the block (value_bound.hpp relies on it).
/// With n = 1, proj has 2 rows: read row 0.
template <class S, class Rows, class WMat>
void project_block(const Rows& rows, const WMat& w, RowMatrix<S>& proj, RowMatrix<S>& pad) {
  if (rows.rows() == 1) {
    pad.setZero(2, rows.cols());
    pad.row(0) = rows.row(0);
    proj.noalias() = pad * w.transpose();
  } else {
    proj.noalias() = rows * w.transpose();
  }
}

/// Adds || V_h[j] (W^q)^T ||_1 to out[j] for the L rows of one KV head (v in its storage type, row j scaled by
/// scale(j) when quantized), in blocks of kL1Block rows so that the [L, D] projection is never materialised (extra
/// memory O(block * D): `proj`, reused).
template <class S, class KV, class WMat>
void accumulate_l1_norms(const HeadRows<KV>& v, const WMat& w, S* out, RowMatrix<S>& proj, RowMatrix<S>& buffer,
                         RowMatrix<S>& pad) {
  const Index L = v.rows;
  for (Index j0 = 0; j0 < L; j0 += kL1Block) {
    const Index n = std::min(kL1Block, L - j0);
    project_block<S>(block_in<S>(v, j0, n, buffer), w, proj, pad);  // [n, D]
    for (Index r = 0; r < n; ++r) out[j0 + r] += proj.row(r).cwiseAbs().sum();
  }
}

}  // namespace kvevict::detail

namespace kvevict::extend {
inline namespace KVEVICT_ABI_NAMESPACE {

/// N [Hkv, L]: N[h][j] = mean over the G query heads q of group h of || V[h][j, :] (W_o^q)^T ||_p, for the
/// entries j < length_of(h) of each head (the rest of the row is 0; L = the longest head).
/// `gram` is used (and required) for ValueNorm::l2; it may be null for l1. `values_scale` dequantizes int8 and fp8
/// values (docs/algorithms.md#quantized).
template <class S, class KV, class W, class Lengths>
RowMatrix<S> value_norms(const KVView<const KV>& values, const HeadsView<const W>& w_o, Index group, ValueNorm norm,
                         const OutputGram<S>* gram, Lengths length_of, const KVScale& values_scale = {}) {
  const Index Hkv = values.heads(), d = values.cols();
  Index longest = 0;
  for (Index h = 0; h < Hkv; ++h) longest = std::max(longest, length_of(h));
  RowMatrix<S> n = RowMatrix<S>::Zero(Hkv, longest);
  KVEVICT_ASSERT(norm == ValueNorm::l1 || gram != nullptr);
  struct Scratch {
    RowMatrix<S> v, w, grams, projected, pad;  // a block of values in S (when stored otherwise) [block, d]; L1:
                                               // W_o^q [D, d] (unless stored in S), [block, D]; L2: [d, G d],
                                               // [block, G d]; a padded single row [2, d]
  };
  // KV heads in parallel with KVEVICT_OPENMP; each writes row h of n only.
  detail::parallel_for_with<Scratch>(Hkv, [&](Index h, Scratch& scratch) {
    const Index L = length_of(h);
    const detail::HeadRows<KV> v = detail::head_rows(values, h, L, values_scale);  // converted block by block
    if (norm == ValueNorm::l1) {
      for (Index g = 0; g < group; ++g) {
        if constexpr (std::is_same_v<std::remove_const_t<W>, S>) {
          detail::accumulate_l1_norms<S>(v, w_o.head(h * group + g), n.row(h).data(), scratch.projected, scratch.v,
                                         scratch.pad);
        } else {
          scratch.w = w_o.head(h * group + g).template cast<S>();
          detail::accumulate_l1_norms<S>(v, scratch.w, n.row(h).data(), scratch.projected, scratch.v, scratch.pad);
        }
      }
      return;
    }
    // L2: sqrt(v G_q v^T) for the G query heads of the group at once: one [block, d] x [d, G d] product per block
    // of rows (a wider GEMM than G products of [d, d]), then row-wise dots with v.
    RowMatrix<S>& grams = scratch.grams;  // the group's Gram matrices side by side
    grams.resize(d, group * d);
    for (Index g = 0; g < group; ++g)
      grams.middleCols(g * d, d) = gram->per_head[static_cast<std::size_t>(h * group + g)];
    constexpr Index block = 256;
    for (Index j0 = 0; j0 < L; j0 += block) {
      const Index rows = std::min(block, L - j0);
      const detail::RowsRef<S> vb = detail::block_in<S>(v, j0, rows, scratch.v);
      scratch.projected.noalias() = vb * grams;
      for (Index g = 0; g < group; ++g)
        n.row(h).segment(j0, rows) +=
            (scratch.projected.middleCols(g * d, d).cwiseProduct(vb).rowwise().sum().cwiseMax(S(0)).cwiseSqrt())
                .transpose();
    }
  });
  n /= static_cast<S>(group);
  return n;
}

/// N [Hkv, L] over every row of the values.
template <class S, class KV, class W>
RowMatrix<S> value_norms(const KVView<const KV>& values, const HeadsView<const W>& w_o, Index group, ValueNorm norm,
                         const OutputGram<S>* gram = nullptr, const KVScale& values_scale = {}) {
  return value_norms<S>(
      values, w_o, group, norm, gram, [&](Index) { return values.rows(); }, values_scale);
}

/// N [Hkv, L] of the layer of `shape`: head h's own L_h entries (docs/algorithms.md#ragged), zeros beyond.
template <class S, class KV, class W>
RowMatrix<S> value_norms(const KVView<const KV>& values, const HeadsView<const W>& w_o, const LayerShape& shape,
                         ValueNorm norm, const OutputGram<S>* gram = nullptr, const KVScale& values_scale = {}) {
  return value_norms<S>(
      values, w_o, shape.group, norm, gram, [&](Index h) { return shape.length(h); }, values_scale);
}

/// Checks that the value-aware inputs are there, agree with the layer and are finite: values [Hkv, L, d] and
/// W_o [H, D, d] (as output_projection() views W_o [D, H * d]). A NaN must not vanish: the DefensiveKV value term
/// would turn it into a zero weight, an L2 norm's clamp at 0 could swallow it, and a window token's norm is not
/// always read. O(size of values and W_o), once.
template <class KV, class Q, class W>
void validate_value_inputs(const LayerInputs<KV, Q, W>& in, const LayerShape& s, ValueNorm norm, const char* where) {
  detail::require(in.values.heads() * in.values.rows() * in.values.cols() > 0, where,
                  "this policy needs values [kv_heads, tokens, head_dim] (LayerInputs::values)");
  detail::require(in.w_o.heads() * in.w_o.rows() * in.w_o.cols() > 0, where,
                  "this policy needs w_o [hidden, H * head_dim] (LayerInputs::w_o, built with output_projection())");
  detail::require(in.w_o.heads() == s.query_heads && in.w_o.cols() == in.values.cols(), where,
                  "w_o must have H * head_dim = ", s.query_heads, " * ", in.values.cols(), " columns, got ",
                  in.w_o.heads(), " * ", in.w_o.cols());
  detail::require_finite_entries(in.values, s, where, "values", in.values_scale);
  if (in.w_o_gram) {
    const auto& g = *in.w_o_gram;
    detail::require(g.heads() == s.query_heads, where, "w_o_gram must hold one Gram matrix per query head (",
                    s.query_heads, "), got ", g.heads(), "; make it with OutputGram::compute(w_o)");
    for (Index q = 0; q < g.heads(); ++q) {
      const auto& m = g.per_head[static_cast<std::size_t>(q)];
      detail::require(m.rows() == in.w_o.cols() && m.cols() == in.w_o.cols(), where, "w_o_gram head ", q, " must be [",
                      in.w_o.cols(), ", ", in.w_o.cols(), "] (head_dim x head_dim), got [", m.rows(), ", ", m.cols(),
                      "]");
      detail::require(std::isfinite((m.array() * 0).sum()), where, "w_o_gram head ", q, " is not finite");
    }
  }
  // W_o itself is read unless the L2 term has a precomputed Gram; it is checked when it is read.
  if (!(in.w_o_gram && norm == ValueNorm::l2)) detail::require_finite(in.w_o, where, "w_o");
}

/// The Gram matrices the L2 value term reads, in S: the engine's precomputed in.w_o_gram (widened or narrowed to S
/// if its scalar differs) or, without one, computed from W_o into `scratch`.
template <class S, class KV, class Q, class W>
const OutputGram<S>& output_gram(const LayerInputs<KV, Q, W>& in, OutputGram<S>& scratch) {
  if (in.w_o_gram) {
    if constexpr (std::is_same_v<gram_scalar_t<W>, S>) {
      return *in.w_o_gram;
    } else {
      scratch = in.w_o_gram->template cast<S>();
      return scratch;
    }
  }
  scratch = OutputGram<S>::compute(in.w_o);
  return scratch;
}

}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::extend
