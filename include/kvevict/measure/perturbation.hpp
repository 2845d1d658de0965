#pragma once
/// What a selection costs, measured with future queries (docs/algorithms.md#measured): the output perturbation of the
/// layer and the attention mass the kept tokens retain.

#include <cmath>
#include <limits>
#include <vector>

#include "kvevict/core/convert.hpp"
#include "kvevict/core/error.hpp"
#include "kvevict/core/inputs.hpp"
#include "kvevict/core/selection.hpp"
#include "kvevict/core/views.hpp"

namespace kvevict {

/// Retained attention mass: mass[q, f] = sum over kept tokens j of head q/G of softmax_j(Q_f K^T / sqrt(d)),
/// the future query f attending to all L context tokens (full cache).
struct RetainedMass {
  RowMatrix<double> per_query;  ///< [H, F]
  double mean = 0;              ///< over heads and future queries
  double min = 0;               ///< the worst case (what the DefensiveKV paper reports)
};

/// Output perturbation: per future query f, || o_full(f) - o_kept(f) ||_2 where o = sum over query heads q of
/// softmax(Q_f K^T / sqrt(d)) V (W_o^q)^T (the attention part of the layer output, [D]), attention renormalised over
/// the kept tokens for o_kept.
struct OutputPerturbation {
  std::vector<double> per_query;  ///< [F]
  double mean = 0;
  double relative = 0;  ///< mean over f of ||o_full - o_kept|| / ||o_full||
};

namespace detail {

template <class Q, class KV>
void validate_future(const HeadsView<const Q>& future, const KVView<const KV>& keys, const Selection& sel,
                     const char* where) {
  require(future.heads() >= 1 && future.rows() >= 1, where,
          "future_queries must be a non-empty [H, F, head_dim] view, got [", future.heads(), ", ", future.rows(), ", ",
          future.cols(), "]");
  require(keys.heads() >= 1 && future.heads() % keys.heads() == 0, where, "future_queries heads (", future.heads(),
          ") must be a multiple of the KV heads (", keys.heads(), ")");
  require(future.cols() == keys.cols(), where, "future_queries head_dim (", future.cols(),
          ") must equal the keys head_dim (", keys.cols(), ")");
  require(sel.heads() == keys.heads() && sel.context_length() == keys.rows(), where, "the selection (", sel.heads(),
          " heads over ", sel.context_length(), " tokens) must match the keys (", keys.heads(), " heads over ",
          keys.rows(), " tokens)");
}

/// Softmax rows [F, L] of query head q over all context tokens, in double.
template <class Q, class KV>
RowMatrix<double> future_attention(const HeadsView<const Q>& future, const KVView<const KV>& keys, Index q) {
  static_assert(!is_quantized_v<KV>, "kvevict measures read float, double, half or bfloat16 caches: dequantize first");
  const Index G = future.heads() / keys.heads();
  RowMatrix<double> k;  // [L, d], read by page runs when the cache is paged
  read_block<double>(head_rows(keys, q / G), 0, keys.rows(), k);
  RowMatrix<double> a = future.head(q).template cast<double>() * k.transpose();
  a /= std::sqrt(static_cast<double>(keys.cols()));
  for (Index f = 0; f < a.rows(); ++f) {
    a.row(f).array() -= a.row(f).maxCoeff();
    a.row(f) = a.row(f).array().exp().matrix();
    a.row(f) /= a.row(f).sum();
  }
  return a;
}

}  // namespace detail

/// future_queries [H, F, head_dim] post-RoPE queries of positions after the context; keys [Hkv, L, d].
template <class Q, class KV>
RetainedMass retained_attention_mass(const HeadsView<const Q>& future_queries, const KVView<const KV>& keys,
                                     const Selection& sel) {
  detail::validate_future(future_queries, keys, sel, "retained_attention_mass");
  const Index H = future_queries.heads(), F = future_queries.rows(), G = H / keys.heads();
  RetainedMass out;
  out.per_query.resize(H, F);
  for (Index q = 0; q < H; ++q) {
    const RowMatrix<double> a = detail::future_attention(future_queries, keys, q);
    for (Index f = 0; f < F; ++f) {
      double m = 0;
      for (Selection::index_type j : sel.head(q / G)) m += a(f, static_cast<Index>(j));
      out.per_query(q, f) = m;
    }
  }
  out.mean = out.per_query.mean();
  out.min = out.per_query.minCoeff();
  return out;
}

/// future_queries [H, F, d]; in.keys, in.values [Hkv, L, d] and in.w_o (output_projection()) are read.
template <class KV, class Q, class W>
OutputPerturbation output_perturbation(const HeadsView<const Q>& future_queries, const LayerInputs<KV, Q, W>& in,
                                       const Selection& sel) {
  static_assert(!is_quantized_v<KV>, "kvevict measures read float, double, half or bfloat16 caches: dequantize first");
  const char* where = "output_perturbation";
  detail::validate_future(future_queries, in.keys, sel, where);
  const Index H = future_queries.heads(), F = future_queries.rows(), G = H / in.keys.heads();
  detail::require(in.values.heads() == in.keys.heads() && in.values.rows() == in.keys.rows(), where, "values must be [",
                  in.keys.heads(), ", ", in.keys.rows(), ", head_dim] like the keys");
  detail::require(in.w_o.heads() == H && in.w_o.cols() == in.values.cols() && in.w_o.rows() >= 1, where,
                  "w_o must be W_o [hidden, H * head_dim] with H = ", H, " and head_dim = ", in.values.cols(),
                  " (see output_projection())");
  RowMatrix<double> full = RowMatrix<double>::Zero(F, in.w_o.rows()), kept = full;
  for (Index q = 0; q < H; ++q) {
    RowMatrix<double> a = detail::future_attention(future_queries, in.keys, q);  // [F, L]
    RowMatrix<double> a_kept = RowMatrix<double>::Zero(F, a.cols());
    for (Selection::index_type j : sel.head(q / G)) a_kept.col(static_cast<Index>(j)) = a.col(static_cast<Index>(j));
    for (Index f = 0; f < F; ++f) {
      const double mass = a_kept.row(f).sum();
      if (mass > 0) a_kept.row(f) /= mass;
    }
    RowMatrix<double> v;  // [L, d]
    detail::read_block<double>(detail::head_rows(in.values, q / G), 0, in.values.rows(), v);
    const RowMatrix<double> vw = v * in.w_o.head(q).template cast<double>().transpose();  // [L, D]
    full.noalias() += a * vw;
    kept.noalias() += a_kept * vw;
  }
  OutputPerturbation out;
  out.per_query.resize(static_cast<std::size_t>(F));
  double rel = 0;
  for (Index f = 0; f < F; ++f) {
    const double e = (full.row(f) - kept.row(f)).norm();
    out.per_query[static_cast<std::size_t>(f)] = e;
    out.mean += e / static_cast<double>(F);
    const double n = full.row(f).norm();
    rel += (n > 0 ? e / n : 0.0) / static_cast<double>(F);
  }
  out.relative = rel;
  return out;
}

}  // namespace kvevict
