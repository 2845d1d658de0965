#pragma once
/// Stage "measure": how redundant each entry's key is among its head's keys (R-KV, arXiv 2505.24133,
/// docs/algorithms.md#redundancy), the term a redundancy-aware score subtracts.

#include <algorithm>
#include <cmath>

#include "kvevict/core/inputs.hpp"
#include "kvevict/observation/key_rows.hpp"
#include "kvevict/ranking/score_map.hpp"

namespace kvevict::extend {

/// redundancy [Hkv, L] (entries beyond a ragged head's L_h: 0). For KV head h with keys k_0 .. k_{L_h - 1}:
///   u_j = k_j / (||k_j|| + 1e-8),  C(i, j) = u_i . u_j for i != j, C(i, i) = 0;
///   in every row i, the last j with C(i, j) > 0.5 (its most recent near-copy; j = 0 when none) is set to 0;
///   m_j = (1 / L_h) sum_i C(i, j);  redundancy(h, j) = exp(m_j) / sum_t exp(m_t)   (a softmax over the head).
/// A key that many others resemble scores high; each row's most recent near-copy is spared, so of a run of
/// repeated keys the newest is the least redundant (R-KV's retain_direction "last", threshold 0.5).
/// O(L_h^2 d) time and O(L_h (d + 256)) memory per head, deterministic.
template <class S, class In>
RowMatrix<S> key_redundancy(const In& in, const LayerShape& shape) {
  RowMatrix<S> out = RowMatrix<S>::Zero(shape.kv_heads, shape.tokens);
  constexpr Index kRows = 256;
  RowMatrix<S> u;  // [L_h, d] the head's unit keys
  RowMatrix<S> c;  // [<= kRows, L_h] rows of C
  for (Index h = 0; h < shape.kv_heads; ++h) {
    const Index L = shape.length(h);
    if (L == 0) continue;
    u.resize(L, shape.head_dim);
    for_each_block_of_head<S>(in.keys, in.keys_scale, h, L, [&](Index j0, const RowMatrix<S>& rows) {
      for (Index r = 0; r < rows.rows(); ++r) u.row(j0 + r) = rows.row(r) / (rows.row(r).norm() + S(1e-8));
    });
    // m_j = (1 / L_h) sum over i != j of C(i, j), less each row's spared entry, from kRows rows of C at a time (c:
    // O(L_h) memory): the blocks' column sums less the diagonal, then one correction per row (its last j != i with
    // C(i, j) > 0.5, found from the end).
    Eigen::Matrix<S, 1, Eigen::Dynamic> m = Eigen::Matrix<S, 1, Eigen::Dynamic>::Zero(L);
    for (Index i0 = 0; i0 < L; i0 += kRows) {
      const Index rows = std::min(kRows, L - i0);
      c.noalias() = u.middleRows(i0, rows) * u.transpose();
      m += c.colwise().sum();
      for (Index r = 0; r < rows; ++r) {
        const Index i = i0 + r;
        m(i) -= c(r, i);
        Index spared = 0;
        for (Index j = L - 1; j > 0; --j)
          if (j != i && c(r, j) > S(0.5)) {
            spared = j;
            break;
          }
        if (spared != i) m(spared) -= c(r, spared);
      }
    }
    m /= static_cast<S>(L);
    const S top = m.maxCoeff();
    S total = S(0);
    for (Index j = 0; j < L; ++j) total += (out(h, j) = std::exp(m(j) - top));
    out.row(h).head(L) /= total;
  }
  return out;
}

/// R-KV's blend on a layer's map [Hkv, L]: every entry ranked by score (tiers scored and forced: forced entries rank
/// among themselves by it) gets (1 - rho) s - rho redundancy(h, j); the window and the tiers above it are unchanged.
/// `r` [Hkv, L]: key_redundancy of the layer; rho in [0, 1).
template <class S>
void weigh_by_redundancy(ScoreMap<S>& map, const RowMatrix<S>& r, double rho) {
  const S keep = static_cast<S>(1.0 - rho), take = static_cast<S>(rho);
  for (Index h = 0; h < map.heads; ++h)
    for (Index j = 0; j < map.length(h); ++j) {
      const Tier t = map.tier_of(h, j);
      if (t == Tier::scored || t == Tier::forced) map.at(h, j) = keep * map.at(h, j) - take * r(h, j);
    }
}

}  // namespace kvevict::extend
