#pragma once
/// Expected Attention (kvpress ExpectedAttentionPress): each key is scored by the attention that the queries of the
/// next positions are expected to pay it, from the mean and covariance of the window queries before RoPE, rotated
/// by the RoPE rotation averaged over those positions, times the value's norm (docs/algorithms.md#expected-attention).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/observation/key_rows.hpp"
#include "kvevict/observation/window_attention.hpp"
#include "kvevict/rope/rerotate.hpp"
#include "kvevict/selectors/selector.hpp"
#include "kvevict/shard/layer_shard.hpp"

namespace kvevict {

/// Per query head q (window queries un-rotated from their positions t_i: q_i = R(t_i)^T q_i^post, i < w):
///   mu_q = mean_i q_i [d],  Sigma_q = mean_i (q_i - mu_q)(q_i - mu_q)^T [d, d]  (population covariance)
///   Rbar = mean over t in [T, T + future) of R(t), T = the last window position + 1 (a block of scaled rotations)
///   mu'_q = Rbar mu_q,  Sigma'_q = Rbar Sigma_q Rbar^T
///   z_q[j] = mu'_q . k_j / sqrt(d) + k_j^T Sigma'_q k_j / (2 d)  for the head's post-RoPE keys k_j, j >= sinks
///            (computed as sum_i ((Rbar (q_i - mu_q)) . k_j)^2 / (2 d w): Sigma'_q has rank <= w)
///   a_q = softmax of z_q over the entries j in [sinks, L_h) of its KV head (window entries included)
/// Prefix entry j of KV head h (sinks <= j < P_h) scores mean over the group's q of a_q[j], times ||v_j||_2 when
/// value_term; the first min(sinks, P_h, n_kept - w) entries of each head are forced (kept first), then the
/// window; each head keeps its top budgets[h].
struct ExpectedAttentionSelector {
  static constexpr const char* type_name = "ExpectedAttentionSelector";
  struct Params {
    double rope_theta = 10000.0;                ///< the model's RoPE base (Llama 2: 10000, Llama 3: 500000)
    Index rotary_dim = 0;                       ///< its rotated dimensions, even (0: the whole head_dim)
    RopeLayout rope_layout = RopeLayout::half;  ///< its pairing (half: Hugging Face Llama's rotate_half)
    Index future_positions = 512;               ///< the next positions the rotation is averaged over (kvpress: 512)
    Index sinks = 4;                            ///< first entries of each head: kept, out of the softmax (kvpress: 4)
    bool covariance = true;                     ///< add k^T Sigma' k / (2 d) (false: the mean alone)
    bool value_term = true;                     ///< weight by ||v_j||_2 (false: the expected attention alone)
    Rope rope() const { return Rope{rope_theta, rotary_dim, rope_layout}; }
    void validate(const char* where) const {
      detail::require(std::isfinite(rope_theta) && rope_theta > 0.0, where, "rope_theta must be finite and > 0, got ",
                      rope_theta);
      detail::require(rotary_dim >= 0 && rotary_dim % 2 == 0, where,
                      "rotary_dim must be even and >= 0 (0: the whole head_dim), got ", rotary_dim);
      detail::require(future_positions >= 1, where, "future_positions must be >= 1, got ", future_positions);
      detail::require(sinks >= 0, where, "sinks must be >= 0, got ", sinks);
    }
  };
  template <class S>
  struct Layer {
    extend::ScoreMap<S> allocation;  ///< [Hkv, L]
  };

  ExpectedAttentionSelector() = default;
  explicit ExpectedAttentionSelector(const Params& p) : params_(p) {}
  const Params& params() const { return params_; }
  bool reads_values() const { return params_.value_term; }
  static constexpr bool reads_queries() { return true; }  // their mean and covariance: attention rows will not do
  void adjust_budget(extend::LayerBudget& /*budget*/, const extend::LayerShape& /*shape*/,
                     const ScoringParams& /*common*/, const char* /*where*/) const {}

  /// Sharded (docs/algorithms.md#sharded): every head is scored alone but for the window queries' positions, KV
  /// head 0's, which the rank holding global head 0 sends through budget.shard.
  static constexpr bool shardable_scores() { return true; }

  template <class S, class In>
  Layer<S> score(const In& in, const extend::LayerShape& shape, const ScoringParams& common,
                 const extend::LayerBudget& budget, const char* where) const {
    // The window queries' positions: those of the last w entries (of KV head 0: the window is the same tokens in
    // every head). First, before any check that could fail on one rank alone: a sharded layer exchanges them.
    const std::vector<std::int64_t> query_pos = window_positions(shape, budget.shard);
    validate_layer(in, shape, where);
    const Index d = shape.head_dim, G = shape.group;
    const Index rd = detail::rope_rotary_dim(params_.rope(), d, where);
    const std::vector<double> inv = detail::rope_inv_frequencies(params_.rope_theta, rd);
    std::vector<S> mean_cos, mean_sin;  // Rbar's pairs [rd / 2]
    averaged_rotation(inv, query_pos.back() + 1, mean_cos, mean_sin);
    const auto turn = [&](S* row) {
      detail::rope_rotate_row<S>(row, rd, params_.rope_layout, mean_cos.data(), mean_sin.data());
    };
    // k^T Sigma' k = (1 / w) sum_i ((Rbar c_i) . k)^2 with c_i = q_i - mu (Sigma' has rank <= w): the quadratic
    // term is a product with w rows per query head, as the window attention is, instead of d x d.
    const Index w = shape.window, F = params_.covariance ? w : 0;
    const S mean_scale = S(1) / std::sqrt(static_cast<S>(d)),
            factor_scale = S(1) / std::sqrt(S(2) * static_cast<S>(d) * static_cast<S>(w));

    RowMatrix<S> prefix = RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]
    std::vector<S> cos_tab(inv.size()), sin_tab(inv.size());
    // Per KV head, its group's rows [G + G * F, d]: mu'_g / sqrt(d), then (Rbar c_i) / sqrt(2 d w) for each g, i.
    RowMatrix<S> rows(G + G * F, d);
    for (Index h = 0; h < shape.kv_heads; ++h) {
      for (Index g = 0; g < G; ++g) {
        // Pre-RoPE queries [w, d]: each window query turned back by its position.
        RowMatrix<S> q = in.queries.head(h * G + g).template cast<S>();
        for (Index i = 0; i < w; ++i) {
          detail::rope_cos_sin(-query_pos[static_cast<std::size_t>(i)], inv, cos_tab.data(), sin_tab.data());
          detail::rope_rotate_row<S>(q.row(i).data(), rd, params_.rope_layout, cos_tab.data(), sin_tab.data());
        }
        const Eigen::Matrix<S, 1, Eigen::Dynamic> m = q.colwise().mean();
        rows.row(g) = m * mean_scale;
        turn(rows.row(g).data());
        for (Index i = 0; i < F; ++i) {
          auto r = rows.row(G + g * F + i);
          r = (q.row(i) - m) * factor_scale;
          turn(r.data());
        }
      }
      // Expected logits [G, L_h - sinks] from one product per block of the head's keys.
      const Index first = std::min(params_.sinks, shape.length(h));  // the softmax runs over [first, L_h)
      const Index n = shape.length(h) - first;
      RowMatrix<S> logits(G, n);
      extend::for_each_block_of_head<S>(
          in.keys, in.keys_scale, h, shape.length(h), [&](Index j0, const RowMatrix<S>& k) {
            const RowMatrix<S> p = k * rows.transpose();  // [b, G + G * F]
            for (Index g = 0; g < G; ++g)
              for (Index r = std::max<Index>(0, first - j0); r < k.rows(); ++r)
                logits(g, j0 + r - first) = p(r, g) + (F > 0 ? p.row(r).segment(G + g * F, F).squaredNorm() : S(0));
          });
      // Softmax of each query head's row, then the mean over the group, for the prefix entries past the sinks.
      for (Index g = 0; g < G && n > 0; ++g) {
        auto row = logits.row(g);
        row = (row.array() - row.maxCoeff()).exp().matrix();
        row /= row.sum();
      }
      for (Index j = first; j < shape.prefix_of(h); ++j) prefix(h, j) = logits.col(j - first).sum() / static_cast<S>(G);
    }
    if (params_.value_term) {
      extend::for_each_entry_block<S>(in.values, in.values_scale, shape, [&](Index h, Index j0, const RowMatrix<S>& v) {
        for (Index r = 0; r < v.rows() && j0 + r < shape.prefix_of(h); ++r) prefix(h, j0 + r) *= v.row(r).norm();
      });
    }
    Layer<S> layer{extend::scores_with_window(prefix, shape, common.reference_quirks)};
    layer.allocation.require_finite(where);
    const Index cap = std::max<Index>(0, static_cast<Index>(budget.n_kept) - shape.window);
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = 0; j < std::min({params_.sinks, shape.prefix_of(h), cap}); ++j)
        layer.allocation.promote(h, j, extend::Tier::forced);
    return layer;
  }

 private:
  /// The positions of KV head 0's last w entries [w]; of global head 0 on a sharded layer (sent by the rank that holds
  /// it: kv_heads are ascending, so it is that rank's first).
  static std::vector<std::int64_t> window_positions(const extend::LayerShape& shape, const shard::LayerShard* shard) {
    std::vector<std::int64_t> mine;
    if (!shard || shard->kv_heads.front() == 0)
      for (Index i = 0; i < shape.window; ++i) mine.push_back(shape.position(0, shape.length(0) - shape.window + i));
    if (!shard) return mine;
    for (std::vector<std::int64_t>& rank : shard::all_gather(*shard->comm, mine))
      if (!rank.empty()) return rank;
    return mine;  // no rank holds head 0: refused before scoring (every id in [0, Hkv) is held)
  }

  /// Rbar's pairs: the means of cos(t inv_i) and sin(t inv_i) over t in [first, first + future_positions), in double.
  template <class S>
  void averaged_rotation(const std::vector<double>& inv, std::int64_t first, std::vector<S>& mean_cos,
                         std::vector<S>& mean_sin) const {
    mean_cos.resize(inv.size());
    mean_sin.resize(inv.size());
    const auto F = static_cast<double>(params_.future_positions);
    for (std::size_t i = 0; i < inv.size(); ++i) {
      double c = 0.0, s = 0.0;
      for (Index t = 0; t < params_.future_positions; ++t) {
        const double a = static_cast<double>(first + t) * inv[i];
        c += std::cos(a);
        s += std::sin(a);
      }
      mean_cos[i] = static_cast<S>(c / F);
      mean_sin[i] = static_cast<S>(s / F);
    }
  }

  /// Window queries (not attention rows: the statistics need the queries), finite; values when value_term.
  template <class In>
  void validate_layer(const In& in, const extend::LayerShape& shape, const char* where) const {
    detail::require(in.queries.heads() * in.queries.rows() * in.queries.cols() > 0, where,
                    "Expected Attention needs the window queries [H, w, head_dim] (LayerInputs::queries): it takes "
                    "their mean and covariance, which attention rows do not give");
    detail::require_finite(in.queries, where, "queries");
    detail::require_finite_entries(in.keys, shape, where, "keys", in.keys_scale);
    if (!params_.value_term) return;
    detail::require(in.values.heads() * in.values.rows() * in.values.cols() > 0, where,
                    "this policy needs values [kv_heads, tokens, head_dim] (LayerInputs::values), or value_term = "
                    "false");
    detail::require(in.values.cols() == shape.head_dim, where, "values must have head_dim = ", shape.head_dim,
                    " columns, got ", in.values.cols());
    detail::require_finite_entries(in.values, shape, where, "values", in.values_scale);
  }

  Params params_;
};

}  // namespace kvevict
