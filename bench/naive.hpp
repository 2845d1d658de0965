#pragma once
/// The naive implementation of the policies, the baseline of the "x_naive" counter (the target is >= 5x at 32k): the
/// spec's pipeline (docs/algorithms.md#stages) transcribed stage by stage, each stage materialised, with the same
/// GEMM for the two matrix products.
///   - the float64 reference of tests/support/reference.hpp for every stage (element loops, full std::sort for
///     every top-k, [H, w, L] attention in double);
///   - its two matrix products replaced by float Eigen GEMMs, as the papers' PyTorch code uses a BLAS:
///       window logits  Q_win[q] K[q/G]^T                  [w, L] per query head, then scale, mask, exp, normalise
///       value term     V[q/G] (W_o^q)^T, the [L, D] projection materialised per query head, then its row norms
///     (the reference's own loops run a dot product per entry: 1.1 TFLOP of them for the L1 term at 32k).
/// What the library does instead: streams one query head at a time (O(w L) extra), never materialises [L, D]
/// (blocked L1, Gram-form L2), vectorised softmax, linear-time selection.
/// The naive selection is also checked against the library's (bench counter "agree").
/// Presets without an overload of select() here (CriticalSnapKV, AdaKVDefensive) have no naive baseline:
/// has_select_v is false for them and the benchmark skips those counters.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "reference.hpp"

namespace kvevict_bench::naive {

using kvevict::Index;
using kvevict_ref::Kept;
using FloatMatrix = kvevict::RowMatrix<float>;

struct Shape {
  int H, Hkv, w, L, d, D;
};

/// H and w from the window queries, or from the window attention when the layer gives that instead.
template <class KV, class Q, class W>
Shape shape_of(const kvevict::LayerInputs<KV, Q, W>& in) {
  const auto& window = in.queries.heads() == 0 ? in.attention : in.queries;
  return {static_cast<int>(window.heads()), static_cast<int>(in.keys.heads()), static_cast<int>(window.rows()),
          static_cast<int>(in.keys.rows()), static_cast<int>(in.keys.cols()),  static_cast<int>(in.w_o.rows())};
}

/// attn [H][w][L] in double (the reference's layout): the given window attention widened, or softmax rows of
/// logits from a float GEMM.
template <class KV, class Q, class W>
std::vector<double> window_attention(const kvevict::LayerInputs<KV, Q, W>& in, const Shape& s) {
  const int G = s.H / s.Hkv, P = s.L - s.w;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  std::vector<double> attn(static_cast<std::size_t>(s.H) * s.w * s.L, 0.0);
  if (in.queries.heads() == 0) {
    for (int q = 0; q < s.H; ++q)
      for (int i = 0; i < s.w; ++i)
        for (int j = 0; j < s.L; ++j)
          attn[(static_cast<std::size_t>(q) * s.w + i) * s.L + j] = static_cast<double>(in.attention.head(q)(i, j));
    return attn;
  }
  FloatMatrix logits;
  for (int q = 0; q < s.H; ++q) {
    const FloatMatrix k = in.keys.head(q / G).template cast<float>();
    logits.noalias() = in.queries.head(q).template cast<float>() * k.transpose();
    for (int i = 0; i < s.w; ++i) {
      double* row = &attn[(static_cast<std::size_t>(q) * s.w + i) * s.L];
      const int visible = P + i + 1;
      double row_max = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < visible; ++j) row_max = std::max(row_max, row[j] = logits(i, j) * scale);
      double sum = 0;
      for (int j = 0; j < visible; ++j) sum += row[j] = std::exp(row[j] - row_max);
      for (int j = 0; j < visible; ++j) row[j] /= sum;
    }
  }
  return attn;
}

/// N [Hkv][L] in double: the [L, D] projection V[q/G] (W_o^q)^T materialised per query head, then the row norms.
template <class KV, class Q, class W>
std::vector<double> value_norms(const kvevict::LayerInputs<KV, Q, W>& in, const Shape& s, kvevict::ValueNorm norm) {
  const int G = s.H / s.Hkv;
  std::vector<double> n(static_cast<std::size_t>(s.Hkv) * s.L, 0.0);
  FloatMatrix projected;
  for (int q = 0; q < s.H; ++q) {
    const FloatMatrix w_o = in.w_o.head(q).template cast<float>();                         // [D, d]
    projected.noalias() = in.values.head(q / G).template cast<float>() * w_o.transpose();  // [L, D]
    for (int j = 0; j < s.L; ++j) {
      double acc = 0;
      for (int r = 0; r < s.D; ++r) {
        const double o = projected(j, r);
        acc += norm == kvevict::ValueNorm::l1 ? std::fabs(o) : o * o;
      }
      n[static_cast<std::size_t>(q / G) * s.L + j] += norm == kvevict::ValueNorm::l1 ? acc : std::sqrt(acc);
    }
  }
  for (double& x : n) x /= G;
  return n;
}

inline kvevict_ref::Pool pool_of(kvevict::Pooling p) {
  return p == kvevict::Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max;
}

/// SnapKV's scores [Hkv][P] (mean aggregation of the materialised attention), shared by the mean-scored policies.
template <class KV, class Q, class W>
std::vector<double> mean_scores(const kvevict::ScoringParams& p, const kvevict::LayerInputs<KV, Q, W>& in,
                                const Shape& s) {
  return kvevict_ref::mean_scores(window_attention(in, s), s.H, s.Hkv, s.w, s.L, static_cast<int>(p.kernel),
                                  pool_of(p.pooling));
}

/// The kept tokens of one layer, per KV head ascending, for each preset (parameters read from the policy).
template <class KV, class Q, class W>
Kept select(const kvevict::SnapKV& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto& p = policy.params();
  const auto scores = mean_scores(p, in, s);
  return kvevict_ref::snapkv(scores, s.Hkv, s.w, s.L, n_kept);
}

template <class KV, class Q, class W>
Kept select(const kvevict::AdaKV& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto& p = policy.params();
  const auto scores = mean_scores(p, in, s);
  return kvevict_ref::adakv(scores, s.Hkv, s.w, s.L, n_kept, p.alpha);
}

template <class KV, class Q, class W>
Kept select(const kvevict::StreamingLLM& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  return kvevict_ref::streamingllm(static_cast<int>(in.keys.heads()), static_cast<int>(in.keys.rows()), n_kept,
                                   static_cast<int>(policy.params().sinks));
}

template <class KV, class Q, class W>
Kept select(const kvevict::CriticalKV& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto& p = policy.params();
  const auto scores = mean_scores(p, in, s);
  return kvevict_ref::criticalkv(scores, value_norms(in, s, p.value_norm), s.Hkv, s.w, s.L, n_kept,
                                 /*adaptive=*/true, p.alpha, p.eps, p.first_stage_ratio, /*quirks=*/false);
}

/// DefensiveKV's s' [Hkv][P] and forced tokens of one layer.
/// (value_term = false: s' = M; mass_forcing = false: nothing forced.)
template <class KV, class Q, class W>
std::pair<std::vector<double>, std::vector<std::vector<std::int64_t>>> defensive_scores(
    const kvevict::DefensiveSelector::Params& p, const kvevict::ScoringParams& c,
    const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto attn = window_attention(in, s);
  auto m = kvevict_ref::defensive_scores(attn, s.H, s.Hkv, s.w, s.L, static_cast<int>(c.kernel), pool_of(c.pooling),
                                         p.floor);
  auto sprime = p.value_term
                    ? kvevict_ref::defensive_value_scores(m, value_norms(in, s, p.value_norm), s.Hkv, s.w, s.L, true)
                    : std::move(m);
  auto forced = p.mass_forcing
                    ? kvevict_ref::mass_forced(attn, s.H, s.Hkv, s.w, s.L, p.mass_threshold, n_kept, false, 0.0)
                    : std::vector<std::vector<std::int64_t>>{};
  return {std::move(sprime), std::move(forced)};
}

template <class KV, class Q, class W>
Kept select(const kvevict::DefensiveKV& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto& p = policy.params();
  const auto [sprime, forced] = defensive_scores(p, p, in, n_kept);
  return kvevict_ref::defensivekv(sprime, forced, s.Hkv, s.w, s.L, n_kept, p.alpha, false, 0.0);
}

template <class KV, class Q, class W>
Kept select(const kvevict::LayerDefensiveKV& policy, const kvevict::LayerInputs<KV, Q, W>& in, std::int64_t n_kept) {
  const Shape s = shape_of(in);
  const auto& p = policy.params();
  auto [sprime, forced] = defensive_scores(p, p, in, n_kept);
  return kvevict_ref::layer_defensivekv({std::move(sprime)}, {std::move(forced)}, s.Hkv, s.w, s.L, n_kept, false,
                                        0.0)[0];
}

/// Fraction of the naive's kept (head, token) pairs that the library keeps too (1 = the same selection).
inline double agreement(const Kept& naive, const kvevict::Selection& sel) {
  std::int64_t same = 0, total = 0;
  for (std::size_t h = 0; h < naive.size(); ++h)
    for (std::int64_t j : naive[h]) {
      same += sel.kept(static_cast<Index>(h), j) ? 1 : 0;
      ++total;
    }
  return total > 0 ? static_cast<double>(same) / static_cast<double>(total) : 1.0;
}

/// Whether select(policy, inputs, n_kept) above has an overload for Policy (false: no naive baseline).
template <class Policy, class Inputs, class = void>
struct has_select : std::false_type {};
template <class Policy, class Inputs>
struct has_select<
    Policy, Inputs,
    std::void_t<decltype(naive::select(std::declval<const Policy&>(), std::declval<const Inputs&>(), std::int64_t{}))>>
    : std::true_type {};
template <class Policy, class Inputs>
constexpr bool has_select_v = has_select<Policy, Inputs>::value;

}  // namespace kvevict_bench::naive
