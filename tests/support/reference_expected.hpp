// kvevict reference for Expected Attention (docs/algorithms.md#expected-attention), tests only: float64, written from
// the text with explicit d x d RoPE matrices, as kvpress builds them (R(t) = cos * I + sin * P, averaged over the
// future positions), on the ragged layers of tests/support/reference_ragged.hpp (a dense layer is the case where
// every head holds positions 0 .. L-1).
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_EXPECTED_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_EXPECTED_HPP

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support/reference_ragged.hpp"

namespace kvevict_ref {
namespace expected {

struct Params {
  double theta = 10000.0;
  int rotary_dim = 0;        // 0: the whole head_dim
  bool interleaved = false;  // pairs (2i, 2i + 1) instead of (i, i + rd / 2)
  int future = 512;
  int sinks = 4;
  bool covariance = true;
  bool value_term = true;
};

using Matrix = std::vector<std::vector<double>>;  // [rows][cols]

inline Matrix zeros(int r, int c) {
  return Matrix(static_cast<std::size_t>(r), std::vector<double>(static_cast<std::size_t>(c), 0.0));
}
inline Matrix identity(int d) {
  Matrix m = zeros(d, d);
  for (int i = 0; i < d; ++i) m[static_cast<std::size_t>(i)][static_cast<std::size_t>(i)] = 1.0;
  return m;
}
inline Matrix product(const Matrix& a, const Matrix& b) {
  Matrix m = zeros(static_cast<int>(a.size()), static_cast<int>(b[0].size()));
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = 0; j < b[0].size(); ++j)
      for (std::size_t k = 0; k < b.size(); ++k) m[i][j] += a[i][k] * b[k][j];
  return m;
}
inline Matrix transpose(const Matrix& a) {
  Matrix m = zeros(static_cast<int>(a[0].size()), static_cast<int>(a.size()));
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = 0; j < a[0].size(); ++j) m[j][i] = a[i][j];
  return m;
}
inline std::vector<double> times(const Matrix& a, const std::vector<double>& x) {
  std::vector<double> y(a.size(), 0.0);
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t k = 0; k < x.size(); ++k) y[i] += a[i][k] * x[k];
  return y;
}

// R(t) [d, d]: pair (x, y) of rotary pair i turns by t * theta^(-2i / rd); the dimensions >= rd stay.
inline Matrix rope_matrix(double t, int d, const Params& p) {
  const int rd = p.rotary_dim == 0 ? d : p.rotary_dim;
  Matrix r = identity(d);
  for (int i = 0; i < rd / 2; ++i) {
    const double a = t * std::pow(p.theta, -2.0 * i / rd);
    const auto x = static_cast<std::size_t>(p.interleaved ? 2 * i : i);
    const auto y = static_cast<std::size_t>(p.interleaved ? 2 * i + 1 : i + rd / 2);
    r[x][x] = std::cos(a);
    r[x][y] = -std::sin(a);
    r[y][x] = std::sin(a);
    r[y][y] = std::cos(a);
  }
  return r;
}

// Scores [Hkv][P_h] of a layer: prefix entry j >= min(sinks, L_h) of head h gets the group mean of
// softmax_j(z_q) over [min(sinks, L_h), L_h), times ||v_j|| when value_term; entries j < sinks score 0.
inline ragged::Ragged scores(const ragged::Layer& l, const Params& p) {
  const int d = l.d, G = l.H / l.Hkv, w = l.w;
  const auto& pos0 = l.heads[0].pos;
  const std::int64_t T = pos0.back() + 1;  // the first future position
  Matrix rbar = zeros(d, d);
  for (int f = 0; f < p.future; ++f) {
    const Matrix r = rope_matrix(static_cast<double>(T + f), d, p);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j)
        rbar[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] +=
            r[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] / p.future;
  }
  ragged::Ragged out(static_cast<std::size_t>(l.Hkv));
  for (int h = 0; h < l.Hkv; ++h) {
    const auto& head = l.heads[static_cast<std::size_t>(h)];
    const int L = static_cast<int>(head.pos.size()), P = L - w, first = std::min(p.sinks, L);
    std::vector<double> mean_a(static_cast<std::size_t>(L), 0.0);
    for (int g = 0; g < G; ++g) {
      const int q = h * G + g;
      std::vector<std::vector<double>> pre;  // [w][d]
      for (int i = 0; i < w; ++i) {
        std::vector<double> post(static_cast<std::size_t>(d));
        for (int c = 0; c < d; ++c)
          post[static_cast<std::size_t>(c)] = l.q[static_cast<std::size_t>((q * w + i) * d + c)];
        const double t =
            static_cast<double>(pos0[pos0.size() - static_cast<std::size_t>(w) + static_cast<std::size_t>(i)]);
        pre.push_back(times(transpose(rope_matrix(t, d, p)), post));
      }
      std::vector<double> mu(static_cast<std::size_t>(d), 0.0);
      for (const auto& x : pre)
        for (int c = 0; c < d; ++c) mu[static_cast<std::size_t>(c)] += x[static_cast<std::size_t>(c)] / w;
      Matrix cov = zeros(d, d);
      for (const auto& x : pre)
        for (int a = 0; a < d; ++a)
          for (int b = 0; b < d; ++b)
            cov[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)] +=
                (x[static_cast<std::size_t>(a)] - mu[static_cast<std::size_t>(a)]) *
                (x[static_cast<std::size_t>(b)] - mu[static_cast<std::size_t>(b)]) / w;
      const std::vector<double> mu2 = times(rbar, mu);
      const Matrix cov2 = product(product(rbar, cov), transpose(rbar));
      std::vector<double> z;
      for (int j = first; j < L; ++j) {
        std::vector<double> k(static_cast<std::size_t>(d));
        for (int c = 0; c < d; ++c) k[static_cast<std::size_t>(c)] = head.keys[static_cast<std::size_t>(j * d + c)];
        double v = 0.0;
        for (int c = 0; c < d; ++c) v += mu2[static_cast<std::size_t>(c)] * k[static_cast<std::size_t>(c)];
        v /= std::sqrt(static_cast<double>(d));
        if (p.covariance) {
          const std::vector<double> ck = times(cov2, k);
          double quad = 0.0;
          for (int c = 0; c < d; ++c) quad += k[static_cast<std::size_t>(c)] * ck[static_cast<std::size_t>(c)];
          v += quad / (2.0 * d);
        }
        z.push_back(v);
      }
      if (z.empty()) continue;
      const double m = *std::max_element(z.begin(), z.end());
      double sum = 0.0;
      for (double& v : z) sum += (v = std::exp(v - m));
      for (int j = first; j < L; ++j)
        mean_a[static_cast<std::size_t>(j)] += z[static_cast<std::size_t>(j - first)] / sum / G;
    }
    for (int j = 0; j < P; ++j) {
      double s = j < first ? 0.0 : mean_a[static_cast<std::size_t>(j)];
      if (p.value_term) {
        double n = 0.0;
        for (int c = 0; c < d; ++c)
          n += head.values[static_cast<std::size_t>(j * d + c)] * head.values[static_cast<std::size_t>(j * d + c)];
        s *= std::sqrt(n);
      }
      out[static_cast<std::size_t>(h)].push_back(s);
    }
  }
  return out;
}

// Uniform selection: the first min(sinks, P_h, n_kept - w) entries of each head forced, then the window, then the
// scores (ties: higher position); head h keeps min(n_kept, L_h).
inline ragged::KeptRows select(const ragged::Layer& l, std::int64_t n_kept, const Params& p) {
  const ragged::Ragged s = scores(l, p);
  const ragged::Positions pos = ragged::positions(l);
  ragged::KeptRows kept(pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    std::vector<ragged::detail::Entry> e = ragged::detail::head_entries(s, pos, l.w, h);
    const std::int64_t P = static_cast<std::int64_t>(pos[h].size()) - l.w;
    const std::int64_t forced = std::min<std::int64_t>({p.sinks, P, std::max<std::int64_t>(0, n_kept - l.w)});
    for (std::int64_t j = 0; j < forced; ++j) e[static_cast<std::size_t>(j)].tier = ragged::detail::kForced;
    const std::int64_t b = std::min<std::int64_t>(n_kept, static_cast<std::int64_t>(pos[h].size()));
    for (const auto& x : ragged::detail::top_k(e, b)) kept[h].push_back(x.row);
  }
  ragged::detail::sort_rows(kept);
  return kept;
}

}  // namespace expected
}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_EXPECTED_HPP
